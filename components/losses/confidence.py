"""Confidence-head loss and the DSpark loss mix.

DSpark (survey lines 348–350; reference/dspark-dflash-facts.md §2–3) trains a confidence head
π_k = σ(c_k) to predict the acceptance rate of position k given that its prefix survived; the
target is π*_k = 1 − TV(p_k, q_k), detached, and the loss is BCE-with-logits. The draft itself
is trained with a fixed mix of CE on the target tokens and TV (survey line 503):

    L = w_ce·CE + w_tv·TV + w_conf·BCE(c, sg[1 − TV]),   default 0.1 / 0.9 / 1.0,

each term a weighted mean over valid positions with the same position weights (DeepSpec
normalises each term by its own summed weight; with shared weights and mask these agree).
DeepSpec's code uses the full L1 norm ‖p − q‖₁ = 2·TV for the 0.9 term; `tv_as_l1=True`
reproduces that, the default follows the survey's "0.9 TV". The confidence gradient reaches
only the confidence logits here; whatever produced them (backbone, Markov table) is the
caller's business. This module knows nothing about the heads themselves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from components.losses.common import (
    LossOutput,
    acceptance_stats,
    check_logits,
    gather_tokens,
    position_mean,
    safe_tokens,
    target_probs,
    upcast,
    valid_mask,
    weighted_mean,
)
from components.losses.fused import fused_available, fused_tv_ce
from components.losses.overlap import overlap_tv


def confidence_terms(
    confidence_logits: Tensor,  # [N, γ] the head's logits c_k
    alpha: Tensor,  # [N, γ] acceptance rates 1 − TV (detached inside)
) -> Tensor:  # [N, γ]
    """BCE-with-logits of σ(c) against the detached target clamp(α, 0, 1), per position."""
    target = alpha.detach().clamp(0.0, 1.0)
    logits = upcast(confidence_logits)
    return F.binary_cross_entropy_with_logits(logits, target.to(logits.dtype), reduction="none")


def confidence_loss(
    target_logits: Tensor,  # [N, γ, V]
    draft_logits: Tensor,  # [N, γ, V]
    *,
    confidence_logits: Tensor | None = None,  # [N, γ]
    valid: Tensor | None = None,  # [N, γ] bool
    weights: Tensor | None = None,  # [γ] or [N, γ]
    temperature: float = 1.0,
) -> LossOutput:
    """The confidence head's loss alone (gradient only into confidence_logits)."""
    if confidence_logits is None:
        raise ValueError("confidence loss needs confidence_logits [N, γ]")
    check_logits(target_logits, draft_logits, temperature)
    with torch.no_grad():
        p = target_probs(target_logits, temperature)
        alpha = overlap_tv(p, upcast(draft_logits))[0]
    mask = valid_mask(valid, alpha)
    _check_confidence_shape(confidence_logits, mask)
    term = confidence_terms(confidence_logits, alpha)
    alpha, tau = acceptance_stats(alpha, mask)
    return LossOutput(weighted_mean(term, mask, weights), position_mean(term, mask), alpha, tau)


def _check_confidence_shape(confidence_logits: Tensor, mask: Tensor) -> None:
    if tuple(confidence_logits.shape) != tuple(mask.shape):
        raise ValueError(
            f"confidence logits {tuple(confidence_logits.shape)} must be [N, γ] = {tuple(mask.shape)}"
        )


def tv_ce_confidence_loss(
    target_logits: Tensor,  # [N, γ, V]
    draft_logits: Tensor,  # [N, γ, V] (Markov-corrected, if the drafter has a Markov head)
    *,
    target_tokens: Tensor | None = None,  # [N, γ] long, needed when ce_weight > 0
    confidence_logits: Tensor | None = None,  # [N, γ], needed when confidence_weight > 0
    valid: Tensor | None = None,  # [N, γ] bool
    weights: Tensor | None = None,  # [γ] or [N, γ]
    temperature: float = 1.0,
    ce_weight: float = 0.1,
    tv_weight: float = 0.9,
    confidence_weight: float = 1.0,
    tv_as_l1: bool = False,
    fused: bool = True,
) -> LossOutput:
    """w_ce·CE + w_tv·TV (or L1) + w_conf·BCE(c, sg[1 − TV]); see the module docstring.
    ``fused``: α, TV and CE by one CPU kernel where it runs (``fused.py``; the same values)."""
    check_logits(target_logits, draft_logits, temperature)
    if fused and fused_available(target_logits, draft_logits):  # one kernel for α, TV and log q(token)
        mask = valid_mask(valid, draft_logits[..., 0])
        tokens = safe_tokens(target_tokens, mask) if ce_weight else torch.zeros_like(mask, dtype=torch.long)
        alpha, tv, log_q = fused_tv_ce(target_logits, draft_logits, tokens, temperature)
        ce = -log_q
    else:
        logits = upcast(draft_logits)
        alpha, tv = overlap_tv(target_probs(target_logits, temperature), logits)
        mask = valid_mask(valid, tv)
        ce = -gather_tokens(torch.log_softmax(logits, dim=-1), target_tokens, mask) if ce_weight else None
    term = (tv_weight * (2.0 if tv_as_l1 else 1.0)) * tv
    parts = {"tv": weighted_mean(tv.detach(), mask, weights)}
    if ce_weight:
        term = term + ce_weight * ce
        parts["ce"] = weighted_mean(ce.detach(), mask, weights)
    if confidence_weight:
        if confidence_logits is None:
            raise ValueError("dspark loss needs confidence_logits [N, γ] (or confidence_weight=0)")
        _check_confidence_shape(confidence_logits, mask)
        conf = confidence_terms(confidence_logits, alpha)
        term = term + confidence_weight * conf
        parts["confidence"] = weighted_mean(conf.detach(), mask, weights)
    alpha_mean, tau = acceptance_stats(alpha, mask)
    loss = weighted_mean(term, mask, weights)
    return LossOutput(loss, position_mean(term, mask), alpha_mean, tau, parts)
