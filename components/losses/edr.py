"""EDR: the expected number of draft–verify rounds over a whole recorded sequence, exactly, and
a surrogate whose gradient is its exact gradient (Zhao and Cai 2026, as the survey's "Training
the drafter" describes it; reference/methods-notes.md §5).

Speculative decoding over one target rollout is a Markov reward process. A round starts at an
anchor s (the last committed token); draft k of its block is accepted, given drafts 1..k−1
were, with probability c[s, k] = 1 − TV(p, q) at that slot (the drafter's own distribution for
a round started at s: a parallel drafter's depends on s, an autoregressive one's does not).
With S_k = Π_{i≤k} c[s, i], the round accepts exactly j drafts with probability
P_s(j) = S_j − S_{j+1} (j < γ) or S_γ (j = γ), and the next round starts at s + j + 1 (the
target's correction or bonus token). Every round costs one; the sequence ends after its last
anchor. So, over anchors 0..n−1 of a row::

    R(s) = 1 + Σ_j P_s(j) · R(s + j + 1),   R(s ≥ n) = 0        (values, backward)
    ω(0) = 1,  ω(s') = Σ_{s + j + 1 = s'} ω(s) · P_s(j)          (occupancy, forward)
    E[#rounds] = R(0) = Σ_s ω(s)

``round_values`` computes both by dynamic programming (differentiable through R). The gradient
of R(0) with respect to round s's acceptances holds every other round fixed, so it is
ω(s) · Σ_j ∇P_s(j) · R(s + j + 1): the temporal-difference form, ``edr_surrogate``'s gradient,
with ω and R detached (one forward of the drafter over every anchor, no second pass).

Two checks fall out (both tested): for an autoregressive drafter (c[s, k] a function of the
position s + k alone) with blocks as long as the sequence, every position is drafted exactly
once, so E[#rounds] = 1 + Σ_{t<n} (1 − c_t), the summed TV (the survey writes the sum to L, its
last rejection starting one more round; here the last position's correction ends the sequence);
and ``round_values`` equals brute-force enumeration of every acceptance outcome.

Knows acceptance probabilities and lengths; nothing about drafters, anchors or batches (the
``edr`` training objective lays a batch out for it).
"""

from __future__ import annotations

import torch
from torch import Tensor


def outcome_probs(accept: Tensor) -> Tensor:  # [..., γ] conditional acceptances -> [..., γ+1]
    """P(exactly j drafts accepted), j = 0..γ, from the conditional acceptances c_1..c_γ."""
    survive = torch.cumprod(accept, dim=-1)  # S_1..S_γ
    ones = torch.ones_like(survive[..., :1])
    before = torch.cat([ones, survive], dim=-1)  # S_0..S_γ
    after = torch.cat([survive, torch.zeros_like(ones)], dim=-1)  # S_1..S_γ, 0
    return before - after


def round_values(accept: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """(values [B, S + γ + 1], occupancy [B, S]) for rows of ``accept`` [B, S, γ] (c[b, s, k]: the
    round at anchor s accepting its draft k + 1, given the drafts before it were) with
    ``lengths`` [B] anchors each (entries past a row's length are ignored). ``values[:, s]`` is
    R(s), zero from a row's length on, so ``values[:, 0]`` is E[#rounds]; differentiable
    through the values; the occupancy is computed without gradients."""
    b, s_max, gamma = accept.shape
    probs = outcome_probs(accept)  # [B, S, γ+1]
    live = torch.arange(s_max, device=accept.device)[None, :] < lengths[:, None]  # [B, S]
    zero = accept.new_zeros(b)
    values = [zero] * (s_max + gamma + 1)  # R(s) per anchor, zeros past the end
    for s in range(s_max - 1, -1, -1):
        nxt = torch.stack(values[s + 1:s + gamma + 2], dim=-1)  # [B, γ+1]: R(s + j + 1)
        values[s] = torch.where(live[:, s], 1.0 + (probs[:, s] * nxt).sum(-1), zero)
    with torch.no_grad():
        occ = accept.new_zeros(b, s_max + gamma + 1)
        occ[:, 0] = (lengths > 0).to(accept.dtype)
        p = probs.detach()
        for s in range(s_max):
            occ[:, s + 1:s + gamma + 2] += occ[:, s:s + 1] * p[:, s] * live[:, s:s + 1]
        occupancy = occ[:, :s_max] * live
    return torch.stack(values, dim=1), occupancy


def edr_surrogate(accept: Tensor, lengths: Tensor) -> Tensor:  # [B, S, γ], [B] -> [B]
    """E[#rounds] per row, valued exactly, whose gradient w.r.t. ``accept`` is the exact gradient
    of E[#rounds]: R(0) + Σ_s ω(s) Σ_j (P_s(j) − sg[P_s(j)]) · R(s + j + 1), ω and R detached."""
    gamma = accept.shape[-1]
    with torch.no_grad():
        values, occupancy = round_values(accept.detach(), lengths)
    nxt = values.unfold(1, gamma + 1, 1)[:, 1:accept.shape[1] + 1]  # [B, S, γ+1]: R(s + j + 1)
    probs = outcome_probs(accept)
    delta = ((probs - probs.detach()) * nxt).sum(-1)  # [B, S] zero-valued, carries the gradient
    return values[:, 0] + (occupancy * delta).sum(1)
