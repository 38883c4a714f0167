"""Draft-OPD's two-stream distillation loss for blocks anchored where decoding rounds start.

Draft-OPD (reference/methods-notes.md §1) replays the drafter at the anchors where rounds
actually start and splits each block at its first rejection. With greedy drafting, draft j is
accepted while the drafter's argmax equals the data token, so the accepted count m of a block
is the length of its leading run of matches. Then:

- *trajectory stream*: positions 1..m+1 (the accepted drafts and the correction position) hold
  tokens drawn from the target, so they get the forward KL(p ‖ q);
- *rejected stream*: position m+1 holds the drafter's own rejected token, drawn from q, so it
  gets the reverse KL(q ‖ p), weighted by decay^m (the paper's 0.8^(offset−1));
- loss = (w_t·Σ KL_fwd + w_r·Σ decay^m·KL_rev) / (N_traj + Σ decay^m).

The paper estimates both KLs from the one observed token (teacher top-1 log-probs); here the
target's full distribution is at hand, so both are exact. Positions after m+1 are never reached
in that round and get no loss. With confidence logits (DSpark) the confidence head keeps
training on the reached positions (BCE to sg[α], as in the DSpark recipe).

Knows logits and masks only; which anchors the blocks come from is the caller's business.
"""

from __future__ import annotations

import torch
from torch import Tensor

from components.losses.common import (
    LossOutput,
    acceptance_stats,
    check_logits,
    log_probs,
    position_mean,
    upcast,
    valid_mask,
)
from components.losses.confidence import confidence_terms
from components.losses.divergences import kl_terms


def greedy_accepted(draft_logits: Tensor, target_tokens: Tensor, valid: Tensor) -> Tensor:  # -> [N] long
    """Leading positions where the drafter's argmax equals the data token (valid ones only)."""
    match = (draft_logits.detach().argmax(-1) == target_tokens) & valid
    return torch.cumprod(match.to(torch.int32), dim=1).sum(1).long()


def opd_loss(
    target_logits: Tensor,  # [N, γ, V]
    draft_logits: Tensor,  # [N, γ, V]
    *,
    target_tokens: Tensor | None = None,  # [N, γ] long (required: acceptance is greedy matching)
    valid: Tensor | None = None,  # [N, γ] bool
    confidence_logits: Tensor | None = None,  # [N, γ]
    decay: float = 0.8,
    trajectory_weight: float = 1.0,
    rejected_weight: float = 1.0,
    confidence_weight: float = 1.0,
) -> LossOutput:
    """Forward KL on the trajectory, decayed reverse KL on the first rejected draft."""
    check_logits(target_logits, draft_logits, 1.0)
    if target_tokens is None:
        raise ValueError("opd loss needs target_tokens [N, γ]")
    mask = valid_mask(valid, draft_logits)
    gamma = mask.shape[1]
    log_p, log_q = log_probs(target_logits, upcast(draft_logits))
    p = log_p.exp()
    m = greedy_accepted(draft_logits, target_tokens, mask)  # [N]
    pos = torch.arange(gamma, device=mask.device).unsqueeze(0)  # [1, γ]
    traj = mask & (pos <= m.unsqueeze(1))  # [N, γ] accepted + correction position
    rej = mask & (pos == m.unsqueeze(1))  # [N, γ] the first rejected draft (m < γ)
    q = log_q.exp()
    fwd = kl_terms(log_p, log_q, p)  # [N, γ] KL(p ‖ q)
    rev = torch.einsum("...v,...v->...", q, log_q - log_p)  # [N, γ] KL(q ‖ p)
    w_rej = rej.to(fwd.dtype) * decay ** m.to(fwd.dtype).unsqueeze(1)
    zero = torch.zeros((), dtype=fwd.dtype, device=fwd.device)
    num = trajectory_weight * torch.where(traj, fwd, zero).sum() + rejected_weight * (w_rej * torch.where(rej, rev, zero)).sum()
    den = (traj.sum() + w_rej.sum()).clamp_min(1.0)
    loss = num / den
    alpha = torch.minimum(p, q.detach()).sum(-1)  # [N, γ] 1 − TV, for logging
    terms = {"fwd_kl": (torch.where(traj, fwd, zero).sum() / traj.sum().clamp_min(1)).detach(),
             "rev_kl": (torch.where(rej, rev, zero).sum() / rej.sum().clamp_min(1)).detach(),
             "greedy_accepted": m[mask[:, 0]].float().mean().detach() if bool(mask[:, 0].any()) else zero}
    if confidence_logits is not None and confidence_weight:
        conf = confidence_terms(confidence_logits, alpha.detach())
        conf_mean = torch.where(traj, conf, zero).sum() / traj.sum().clamp_min(1)
        loss = loss + confidence_weight * conf_mean
        terms["confidence"] = conf_mean.detach()
    alpha_k, tau = acceptance_stats(alpha, mask)
    per_position = position_mean(torch.where(traj, fwd, zero), traj)
    return LossOutput(loss, per_position, alpha_k, tau, terms)


__all__ = ["greedy_accepted", "opd_loss"]
