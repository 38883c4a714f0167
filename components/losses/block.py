"""Block objectives: E2E-TV (token-wise verification) and BV loss (block verification).

Both score a whole draft block instead of each position alone (survey lines 509–545).

E2E-TV (Li et al., 2026; survey lines 519–521) maximises the expected number of accepted draft
tokens under token-wise verification, with gradients through the products:

    L_E2E = −Σ_{k=1}^{γ} Π_{i=1}^{k} (1 − TV(p_i, q_i))            per block, mean over blocks.

BV loss (Kim et al., 2026; survey lines 523–531) is the same quantity for block verification,
whose running weight w_k (lines 145–147) turns, along a target-generated block x_1..x_γ, into a
running minimum of likelihood ratios r_k = Π_{i≤k} q_i(x_i)/p_i(x_i):

    L_BV = −log Σ_{k=1}^{γ} min(1, r_1, …, r_k),

with "the last token of each prefix integrated over the vocabulary" (line 531). We read this as
the exact expectation over x_k ~ p_k with the prefix x_{<k} fixed: writing m_{k−1} =
min(1, r_1, …, r_{k−1}) and R_{k−1} = r_{k−1} (m_0 = R_0 = 1),

    E_{x_k~p_k}[min(m_{k−1}, R_{k−1}·q_k(x_k)/p_k(x_k))] = Σ_x min(m_{k−1}·p_k(x), R_{k−1}·q_k(x)),

so  L_BV = −log Σ_k Σ_x min(m_{k−1} p_k(x), R_{k−1} q_k(x)),  which for γ = 1 is −log Σ min(p, q),
exactly the LK likelihood loss as the survey states. Everything runs in log space (cumsum,
cummin, logsumexp), so tiny ratios and acceptances never hit log(0).

A block is truncated at its first invalid position (a product cannot skip a missing position);
blocks with no valid position are left out of the mean. Position weights are optional here
(the survey's objectives use none); when given, they scale each prefix term of the sum.
This module knows nothing about how blocks were drafted or verified at inference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from components.losses.common import (
    LossOutput,
    acceptance_stats,
    alpha_from_log_q,
    block_mean,
    check_logits,
    gather_tokens,
    log_probs,
    position_mean,
    prefix_mask,
    survival,
    target_probs,
    upcast,
    valid_mask,
    weight_matrix,
)
from components.losses.overlap import log_overlap, overlap_tv


def e2e_tv_loss(
    target_logits: Tensor,  # [N, γ, V]
    draft_logits: Tensor,  # [N, γ, V]
    *,
    valid: Tensor | None = None,  # [N, γ] bool
    weights: Tensor | None = None,  # [γ] or [N, γ], scales each prefix term
    temperature: float = 1.0,
) -> LossOutput:
    """−E[accepted draft tokens] under token-wise verification, −Σ_k Π_{i≤k} α_i per block.

    per_position[k] is the mean survival Π_{i≤k} α_i; the loss is −(their weighted sum)."""
    check_logits(target_logits, draft_logits, temperature)
    p = target_probs(target_logits, temperature)
    alpha = overlap_tv(p, upcast(draft_logits))[0]  # [N, γ] = 1 − TV
    mask = valid_mask(valid, alpha)
    prefix = prefix_mask(mask)
    surv = survival(alpha, prefix)  # [N, γ], 0 after the first invalid position
    w = weight_matrix(prefix, weights, surv.dtype)
    loss = block_mean(-(w * surv).sum(1), prefix[:, 0])
    alpha_mean, tau = acceptance_stats(alpha, mask)  # same α metrics as per-token losses
    return LossOutput(loss, position_mean(surv, prefix), alpha_mean, tau)


def bv_prefix_terms(
    log_p: Tensor,  # [N, γ, V] target log-probs
    log_q: Tensor,  # [N, γ, V] draft log-probs
    log_ratio: Tensor,  # [N, γ] log q_i(x_i) − log p_i(x_i) at the block's tokens
) -> Tensor:  # [N, γ]
    """log Σ_x min(m_{k−1} p_k(x), R_{k−1} q_k(x)) for every prefix length k."""
    log_r = torch.cumsum(log_ratio, dim=1)  # log R_k, k = 1..γ
    log_r_prev = torch.cat([torch.zeros_like(log_r[:, :1]), log_r[:, :-1]], dim=1)  # R_{k−1}
    log_m_prev = torch.cummin(log_r_prev, dim=1).values  # includes R_0 = 1, so ≤ 0
    return log_overlap(log_p, log_q, log_m_prev, log_r_prev)


def bv_loss(
    target_logits: Tensor,  # [N, γ, V]
    draft_logits: Tensor,  # [N, γ, V]
    *,
    target_tokens: Tensor | None = None,  # [N, γ] long, the target-generated block
    valid: Tensor | None = None,  # [N, γ] bool
    weights: Tensor | None = None,  # [γ] or [N, γ], scales each prefix term
    temperature: float = 1.0,
) -> LossOutput:
    """BV loss −log Σ_k E_{x_k~p_k}[min(1, r_1, …, r_k)], last token integrated (see module).

    per_position[k] is the mean prefix term (k-prefix acceptance probability under block
    verification); terms["bv_accepted"] is their summed mean, the expected accepted drafts."""
    log_p, log_q = log_probs(target_logits, draft_logits, temperature)
    mask = valid_mask(valid, log_q)
    prefix = prefix_mask(mask)
    tok_q = gather_tokens(log_q, target_tokens, prefix)
    tok_p = gather_tokens(log_p, target_tokens, prefix)
    log_ratio = torch.where(prefix, tok_q - tok_p, torch.zeros_like(tok_q))
    terms = bv_prefix_terms(log_p, log_q, log_ratio)  # [N, γ]
    w = weight_matrix(prefix, weights, terms.dtype)
    keep = prefix[:, 0]
    # Invalid positions: weight 0 -> log 0 = −inf; empty blocks: all zeros (finite, dropped).
    logw = torch.where(w > 0, w.clamp_min(torch.finfo(w.dtype).tiny).log(), -torch.inf)
    logw = torch.where(keep.unsqueeze(1), logw, torch.zeros_like(logw))
    safe_terms = torch.where(prefix, terms, torch.zeros_like(terms))
    loss = block_mean(-torch.logsumexp(safe_terms + logw, dim=1), keep)
    with torch.no_grad():
        accepted = torch.where(prefix, terms.exp(), torch.zeros_like(terms))
        alpha_mean, tau = acceptance_stats(alpha_from_log_q(log_p.exp(), log_q), mask)
    extra = {"bv_accepted": block_mean(accepted.sum(1), keep)}
    return LossOutput(loss, position_mean(accepted, prefix), alpha_mean, tau, extra)
