"""P-EAGLE: EAGLE-3 made parallel, a whole block of drafts in one drafter pass (survey, "P-EAGLE").

EAGLE-3 (``eagle3.py``) drafts one token per layer pass: step s feeds the token drafted at s−1
and the layer's own output as the next hidden. P-EAGLE keeps EAGLE-3's fused taps, layer and
head, and fills the positions after the first with what is known before drafting: a learned
mask-token embedding ``mask_embed`` [H] in place of the missing token and a learned shared
hidden ``mask_hidden`` [n·H], fused by ``fc`` like the target's taps, in place of the missing
hidden. So a round of γ drafts is one pass over γ query rows: row 0 is EAGLE-3's first step
(the last verified token x_j with the target's fused taps at j−1), rows 1..γ−1 are mask rows at
positions j+1..j+γ−1, causal among themselves and over the committed keys. Every slot is read
out from its own row and drawn independently (no slot reads another's draw), so the q handed to
verification is the distribution each draft was drawn from.

Training (``ttt_steps`` = γ prediction depths per position): depth 0 at every position j is
EAGLE-3's step 0 (causal over the sequence); a depth-s row at base j attends to the depth-0 keys
at positions ≤ j and to its own chain's mask keys at depths 1..s, and nothing else. The mask
rows' inputs are the same everywhere, so each depth is one projection at shifted positions, and
the attention over a row's own chain is a gather (``chain_attention``), not a mask over
every depth's keys: the scores are γ · [T, T] plus γ² · T, where an unrolled mask over all depths
would be (γT)². Rows are at every position, as EAGLE-3 trains. The mask rows' keys never enter
the committed context (``consume`` keeps depth-0 keys only), so rollback is a crop.

vLLM 0.32 has this layout (``speculators_model_type: peagle``: EAGLE-3's weights plus
``mask_hidden`` [n·H] through ``fc``, the mask token by id through the draft's embedding) and
runs it as eagle3 with ``parallel_drafting``; ``components/export/vllm.py`` (``peagle_export``)
writes it, ``mask_embed`` as the ``drafter.mask_token_id`` row of the draft's own embedding
table. Knows nothing about losses, verification or engines.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from components.config import DrafterConfig
from components.drafters.base import (
    DEFAULT_SAMPLING,
    DraftBatch,
    DrafterError,
    DrafterSpec,
    DraftState,
    DraftTrainOutput,
    Proposal,
    SharedParts,
    row_settings,
    rows_at_anchors,
)
from components.drafters.capabilities import Capability
from components.drafters.eagle3 import Eagle3Drafter, shift_right
from components.drafters.layers import causal_mask, pad_kv_rows
from components.drafters.registry import register_drafter
from components.spec.sampling import SamplingParams


def chain_attention(q: Tensor, k0: Tensor, v0: Tensor, kc: Tensor, vc: Tensor) -> Tensor:
    """Depth-s rows attend causally to depth-0 keys and to their own chain.

    q [B, h, T, d] (row j's query), k0/v0 [B, h_kv, T, d] (depth-0 keys, row j sees i ≤ j),
    kc/vc [B, h_kv, T, s, d] (row j's own chain keys at depths 1..s) → [B, h, T, d]."""
    h, hk = q.shape[1], k0.shape[1]
    if hk != h:  # grouped KV heads: each serves h / h_kv query heads
        k0, v0 = k0.repeat_interleave(h // hk, 1), v0.repeat_interleave(h // hk, 1)
        kc, vc = kc.repeat_interleave(h // hk, 1), vc.repeat_interleave(h // hk, 1)
    scale = 1.0 / math.sqrt(q.shape[-1])
    t = q.shape[2]
    s0 = (q @ k0.transpose(-1, -2)) * scale  # [B, h, T, T]
    s0 = s0.masked_fill(~causal_mask(t, q.device)[0, 0], float("-inf"))
    sc = torch.einsum("bhtd,bhtsd->bhts", q, kc) * scale  # [B, h, T, s]
    p = torch.cat([s0, sc], dim=-1).float().softmax(-1).to(q.dtype)
    return p[..., :t] @ v0 + torch.einsum("bhts,bhtsd->bhtd", p[..., t:], vc)


@register_drafter("peagle")
class PEagleDrafter(Eagle3Drafter):
    """EAGLE-3's layer with learned mask rows: γ drafts in one pass."""

    def __init__(self, spec: DrafterSpec, shared: SharedParts):
        super().__init__(spec, shared)
        h = self.sizes.hidden_size
        self.mask_embed = nn.Parameter(torch.randn(h) * 0.02)  # [H] the missing token
        self.mask_hidden = nn.Parameter(torch.randn(len(self.layer_ids) * h) * 0.02)  # [n·H] the missing taps

    @staticmethod
    def max_speculative_tokens_for(cfg: DrafterConfig) -> int | None:
        return cfg.ttt_steps  # the depths it was trained for

    @property
    def max_speculative_tokens(self) -> int:
        return int(self.cfg.ttt_steps)

    def sequential_passes(self, gamma: int) -> int:
        return 1

    def _mask_inputs(self) -> tuple[Tensor, Tensor]:  # -> layer input [2H], residual [H]
        g = self.fc(self.mask_hidden.to(self.fc.weight.dtype))
        return self.midlayer.inputs(self.mask_embed.to(g.dtype)[None], g[None])[0], g

    def _finish(self, attn: Tensor, g: Tensor) -> Tensor:  # attention [B, T, H] + residual -> layer output
        out = g + attn
        return out + self.midlayer.mlp(self.midlayer.post_attention_layernorm(out))

    # ---------------------------------------------------------------- training
    def training_forward(self, batch: DraftBatch, generator: torch.Generator | None = None,
                         targets: bool = True) -> DraftTrainOutput:
        b, t = batch.input_ids.shape
        attn, dev = self.midlayer.self_attn, batch.input_ids.device
        base = torch.arange(t, device=dev).expand(b, t)
        g0 = shift_right(self.fuse(batch.hidden))  # [B, T, H]
        x0 = self.midlayer.inputs(self.embed(batch.input_ids), g0)
        out0, (k0, v0) = self.midlayer(x0, g0, base, None, causal_mask(t, dev))
        logits = [self.lm_head(self.norm(out0))]  # row j's depth 0 → x_{j+1}
        xm, gm = self._mask_inputs()
        xm = xm.expand(b, t, -1)
        chain_k: list[Tensor] = []
        chain_v: list[Tensor] = []
        for s in range(1, int(self.cfg.ttt_steps)):
            pos = base + s
            k, v = attn.project_kv(xm, pos)  # [B, h_kv, T, d]: row j's depth-s key
            chain_k.append(k)
            chain_v.append(v)
            o = chain_attention(attn.project_q(xm, pos), k0, v0, torch.stack(chain_k, 3), torch.stack(chain_v, 3))
            o = attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))
            logits.append(self.lm_head(self.norm(self._finish(o, gm))))  # row j's depth s → x_{j+s+1}
        return rows_at_anchors(torch.stack(logits, dim=2), batch, base, self.shared, targets, self.vocab)

    # ---------------------------------------------------------------- inference
    def _block(self, states: list[DraftState] | DraftState, last_token: Tensor, gamma: int) -> Tensor:
        """One pass of γ rows after each row's committed keys → readout logits [R, γ, R_vocab]."""
        if gamma > self.max_speculative_tokens:
            raise DrafterError(f"peagle drafts at most {self.max_speculative_tokens} tokens a pass "
                               f"(drafter.ttt_steps), asked {gamma}")
        many = isinstance(states, list)
        rows = states if many else [states]
        r, dev = last_token.shape[0], last_token.device
        if many:
            past, seen = pad_kv_rows([s.kv[0] if s.kv else None for s in rows], dev)  # [R, h, W, d], [R, W]
            starts = torch.tensor([s.length for s in rows], device=dev)
        else:
            past = rows[0].kv[0] if rows[0].kv else None
            seen = torch.ones(r, past[0].shape[2] if past is not None else 0, dtype=torch.bool, device=dev)
            starts = torch.full((r,), rows[0].length, device=dev)
        zeros = torch.zeros(1, 1, self.sizes.hidden_size, device=dev, dtype=self.fc.weight.dtype)
        if many:
            g_first = torch.cat([s.feats[:, -1:] if s.feats is not None else zeros for s in rows])  # [R, 1, H]
        else:
            g_first = rows[0].feats[:, -1:] if rows[0].feats is not None else zeros.expand(r, 1, -1)
        xm, gm = self._mask_inputs()
        x = torch.cat([self.midlayer.inputs(self.embed(last_token[:, None]), g_first),
                       xm.expand(r, gamma - 1, -1)], dim=1)  # [R, γ, 2H]
        g = torch.cat([g_first, gm.expand(r, gamma - 1, -1)], dim=1)  # [R, γ, H]
        positions = starts[:, None] + torch.arange(gamma, device=dev)[None, :]
        own = causal_mask(gamma, dev).expand(r, 1, gamma, gamma)
        mask = torch.cat([seen[:, None, None, :].expand(r, 1, gamma, -1), own], dim=-1)
        out, _ = self.midlayer(x, g, positions, past, mask)
        return self.lm_head(self.norm(out))

    def propose(self, state: DraftState, last_token: Tensor, sampling: SamplingParams = DEFAULT_SAMPLING,
                generator: torch.Generator | None = None, num_speculative_tokens: int | None = None) -> Proposal:
        gamma = num_speculative_tokens or self.num_speculative_tokens
        logits = self._block(state, last_token, gamma)  # [B, γ, R]
        tokens, probs = self.draw(logits, sampling, generator)  # every slot drawn from its own q
        return self.proposal(tokens, logits, probs)

    def propose_many(self, states: list[DraftState], last_tokens: Tensor,
                     sampling: SamplingParams | list[SamplingParams], num_speculative_tokens: int | list[int] | None = None,
                     generators: list[torch.Generator | None] | None = None) -> list[Proposal]:
        """``propose`` for many batch-1 states in one pass (committed keys right-padded and
        masked) at the longest γ; each row is then drawn at its own γ from its own generator."""
        per_row, samplings, gens = row_settings(len(states), sampling, num_speculative_tokens, generators,
                                                self.num_speculative_tokens)
        logits = self._block(states, last_tokens, max(per_row))
        out = []
        for i, g in enumerate(per_row):
            row = logits[i:i + 1, :g]
            tokens, probs = self.draw(row, samplings[i], gens[i])
            out.append(self.proposal(tokens, row, probs))
        return out

    def capabilities(self) -> frozenset[Capability]:
        return frozenset({Capability.BATCHED_PROPOSE, Capability.ROUND_LIMIT})
