"""ReTrace-style rejected-suffix reuse (survey, "Recycling rejected work"): the gate that fuses
the last round's rejected drafts into the next block's input embeddings.

A round that rejects draft m + 1 (of G) leaves drafts m + 2..G: the drafter's own states z of
guesses for positions the next block predicts again. The next block (anchored at the
correction token) gets, in input slot s, the state of the draft that predicted the token slot s
predicts (``align``), "corrected" by the verification's verdict at the first rejection, the
signal embed(target token) − embed(rejected draft), through a gated residual:

    u_s = W_z norm(z_s) + W_c signal,   e'_s = e_s + present_s · σ(W_g [e_s; u_s]) ⊙ u_s

W_z and W_c start at zero, so a drafter built with ``drafter.retrace=true`` starts as exactly the
one it was loaded from. No extra forward pass: z comes from the round's own drafter pass, the
signal from its verification. Where the survey is silent, chosen here: the states are the
drafter's final (normed) slot states, detached; the correction signal is the token-embedding
difference (the paper's verification signals are not specified in the survey); only the
drafts after the rejected one are recycled (in DFlash's layout the rejected draft itself also
aligns with the anchor slot, and is used there). Trained by the ``retrace`` objective
(draft → verify against the data → re-draft reading the recycled inputs).

Knows the block layout (which slot predicts which token) and nothing about engines or losses.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from components.drafters.exchange import Recycled
from components.drafters.layers import RMSNorm


class RecycleGate(nn.Module):
    """e' = e + present · σ(W_g[e; u]) ⊙ u, u = W_z norm(z) + W_c signal (W_z, W_c zero at start)."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden, eps)
        self.state_proj = nn.Linear(hidden, hidden, bias=False)
        self.signal_proj = nn.Linear(hidden, hidden, bias=False)
        self.gate = nn.Linear(2 * hidden, hidden)
        self.reset()

    @torch.no_grad()
    def reset(self) -> None:
        nn.init.zeros_(self.state_proj.weight)
        nn.init.zeros_(self.signal_proj.weight)
        nn.init.normal_(self.gate.weight, std=0.02)
        nn.init.zeros_(self.gate.bias)

    def forward(self, e: Tensor, recycled: Recycled) -> Tensor:
        """e [..., bs, H] embedded block inputs; recycled's states [..., bs, H], present [..., bs],
        signal [..., H] → [..., bs, H]."""
        z = recycled.states.to(e.dtype)
        u = self.state_proj(self.norm(z)) + self.signal_proj(recycled.signal.to(e.dtype)).unsqueeze(-2)
        g = torch.sigmoid(self.gate(torch.cat([e, u], dim=-1)))
        return e + recycled.present.unsqueeze(-1).to(e.dtype) * g * u


def align(states: Tensor, drafts: Tensor, accepted: Tensor, correction: Tensor, block_size: int,
          first_slot: int, embed: nn.Module) -> Recycled:
    """The next blocks' recycled inputs from rounds that drafted ``drafts`` [..., G] with slot
    states ``states`` [..., G, H], accepted ``accepted`` [...] of them and got ``correction`` [...]
    from the target at the first rejected position: slot s reads draft j = m + 1 + s − first_slot
    where m ≤ j < G (a full accept, m = G, recycles nothing)."""
    g = drafts.shape[-1]
    slots = torch.arange(block_size, device=drafts.device)
    j = accepted.unsqueeze(-1) + 1 + slots - first_slot  # [..., bs]
    present = (j >= accepted.unsqueeze(-1)) & (j < g) & (accepted < g).unsqueeze(-1)
    idx = j.clamp(0, g - 1)
    picked = torch.gather(states, -2, idx.unsqueeze(-1).expand(*idx.shape, states.shape[-1]))
    picked = picked * present.unsqueeze(-1).to(picked.dtype)
    rejected = torch.gather(drafts, -1, accepted.clamp(max=g - 1).unsqueeze(-1)).squeeze(-1)
    signal = (embed(correction) - embed(rejected)) * (accepted < g).unsqueeze(-1).to(picked.dtype)
    return Recycled(picked.detach(), present, signal.detach())


def stack_recycled(rows: list[Recycled | None], block_size: int, hidden: int, device: torch.device) -> Recycled | None:
    """Batch-1 recycled inputs of many rows (None: the row recycles nothing) as one [R, ...] batch."""
    if all(r is None for r in rows):
        return None
    like = next(r for r in rows if r is not None)
    states = like.states.new_zeros(len(rows), block_size, hidden)
    present = torch.zeros(len(rows), block_size, dtype=torch.bool, device=device)
    signal = like.signal.new_zeros(len(rows), hidden)
    for i, r in enumerate(rows):
        if r is not None:
            states[i], present[i], signal[i] = r.states[0], r.present[0], r.signal[0]
    return Recycled(states, present, signal)
