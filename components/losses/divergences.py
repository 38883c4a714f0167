"""Per-token drafter losses: CE, forward KL, TV and the two LK losses.

Each draft position contributes one term of the same kind (survey lines 456–503):

- CE            −log q(x) on the target's tokens (hard labels),
- KL            KL(p ‖ q) = Σ p (log p − log q), p = target, q = draft,
- TV            ½ Σ |p − q| = 1 − α, where α = Σ min(p, q) is the acceptance rate of
                speculative sampling (survey lines 47–51),
- LK hybrid     λ·KL + (1 − λ)·TV, λ = exp(−η·sg[ᾱ_k]) with ᾱ_k the acceptance rate at draft
                position k averaged over the batch (survey lines 480–484, 491–501),
- LK likelihood −log α, computed as −logsumexp(min(log p, log q)), finite even when p and q
                barely overlap (survey lines 486–488).

All work happens in float32 (float64 stays float64) on `log_softmax`/`softmax` outputs,
vectorised over blocks, positions and vocabulary; KL's sums are batched dot products and TV/α
come from the fused `overlap.overlap_tv`, to keep full-size temporaries few. The module knows
nothing about blocks as sequences: see `block.py` for objectives that multiply along the block.
"""

from __future__ import annotations

import torch
from torch import Tensor

from components.losses.common import (
    LossOutput,
    acceptance_stats,
    alpha_from_log_q,
    check_logits,
    gather_tokens,
    log_probs,
    position_mean,
    target_probs,
    upcast,
    valid_mask,
    weighted_mean,
)
from components.losses.overlap import log_overlap, overlap_tv

# ---------------------------------------------------------------- per-position terms


def _dot(a: Tensor, b: Tensor) -> Tensor:  # [N, γ, V] x2 -> [N, γ]
    """Σ_v a·b as a batched matmul: no full-size temporary."""
    return torch.einsum("...v,...v->...", a, b)


def kl_terms(log_p: Tensor, log_q: Tensor, p: Tensor | None = None) -> Tensor:
    """KL(p ‖ q) `[N, γ]` from log p (finite, detached), log q `[N, γ, V]` (and p if at hand).

    Σ p log p − Σ p log q as two dot products; a token with p = 0 contributes 0."""
    p = log_p.exp() if p is None else p
    return _dot(p, log_p) - _dot(p, log_q)


def tv_terms(p: Tensor, q: Tensor) -> Tensor:  # [N, γ, V] x2 -> [N, γ]
    """TV(p, q) = ½ Σ |p − q| per position from probabilities (plain autograd; the losses
    use the faster `overlap.overlap_tv` from draft logits)."""
    return 0.5 * (p - q).abs().sum(-1)


def log_alpha_terms(log_p: Tensor, log_q: Tensor) -> Tensor:  # [N, γ, V] x2 -> [N, γ]
    """log α = log Σ min(p, q) per position, in log space (accurate when α is small)."""
    return log_overlap(log_p, log_q)


def acceptance_rate(
    target_logits: Tensor,  # [N, γ, V]
    draft_logits: Tensor,  # [N, γ, V]
    temperature: float = 1.0,
) -> Tensor:  # [N, γ]
    """α = Σ min(p, q) = 1 − TV(p, q), differentiable w.r.t. the draft logits."""
    check_logits(target_logits, draft_logits, temperature)
    return overlap_tv(target_probs(target_logits, temperature), upcast(draft_logits))[0]


def _output(
    term: Tensor,  # [N, γ] per-position loss
    valid: Tensor,  # [N, γ] bool
    weights: Tensor | None,  # [γ] or [N, γ]
    alpha: Tensor | None,  # [N, γ] acceptance rates (for metrics), or None
    terms: dict[str, Tensor] | None = None,
) -> LossOutput:
    alpha_mean, tau = acceptance_stats(alpha, valid) if alpha is not None else (None, None)
    return LossOutput(
        loss=weighted_mean(term, valid, weights),
        per_position=position_mean(term, valid),
        alpha=alpha_mean,
        tau=tau,
        terms=terms or {},
    )


# ---------------------------------------------------------------- losses


def ce_loss(
    target_logits: Tensor | None,  # [N, γ, V] only for α metrics; may be None
    draft_logits: Tensor,  # [N, γ, V]
    *,
    target_tokens: Tensor | None = None,  # [N, γ] long
    valid: Tensor | None = None,  # [N, γ] bool
    weights: Tensor | None = None,  # [γ] or [N, γ]
    temperature: float = 1.0,
) -> LossOutput:
    """Cross-entropy −log q(x) on the target tokens (hard labels)."""
    mask = valid_mask(valid, draft_logits)
    log_q = torch.log_softmax(upcast(draft_logits), dim=-1)
    term = -gather_tokens(log_q, target_tokens, mask)
    alpha = None
    if target_logits is not None:
        check_logits(target_logits, draft_logits, temperature)
        alpha = alpha_from_log_q(target_probs(target_logits, temperature), log_q)
    return _output(term, mask, weights, alpha)


def kl_loss(
    target_logits: Tensor,  # [N, γ, V]
    draft_logits: Tensor,  # [N, γ, V]
    *,
    valid: Tensor | None = None,  # [N, γ] bool
    weights: Tensor | None = None,  # [γ] or [N, γ]
    temperature: float = 1.0,
) -> LossOutput:
    """Forward KL(p ‖ q): CE against the target's full distribution."""
    log_p, log_q = log_probs(target_logits, draft_logits, temperature)
    p = log_p.exp()
    mask = valid_mask(valid, log_q)
    return _output(kl_terms(log_p, log_q, p), mask, weights, alpha_from_log_q(p, log_q))


def tv_loss(
    target_logits: Tensor,  # [N, γ, V]
    draft_logits: Tensor,  # [N, γ, V]
    *,
    valid: Tensor | None = None,  # [N, γ] bool
    weights: Tensor | None = None,  # [γ] or [N, γ]
    temperature: float = 1.0,
) -> LossOutput:
    """TV(p, q) = ½ Σ |p − q| = 1 − α."""
    check_logits(target_logits, draft_logits, temperature)
    alpha, tv = overlap_tv(target_probs(target_logits, temperature), upcast(draft_logits))
    return _output(tv, valid_mask(valid, tv), weights, alpha.detach())


def lk_lambda(
    alpha: Tensor,  # [N, γ] acceptance rates (detached inside)
    valid: Tensor,  # [N, γ] bool
    eta: float,
    per_block: bool = False,
) -> Tensor:  # [γ] or [N, γ]
    """λ = exp(−η·sg[α]); α averaged over valid blocks per position unless per_block.

    A position with no valid block gets λ = 1 (it contributes nothing anyway)."""
    alpha = alpha.detach()
    if not per_block:
        alpha = torch.nan_to_num(position_mean(alpha, valid), nan=0.0)
    return torch.exp(-eta * alpha)


def lk_hybrid_loss(
    target_logits: Tensor,  # [N, γ, V]
    draft_logits: Tensor,  # [N, γ, V]
    *,
    valid: Tensor | None = None,  # [N, γ] bool
    weights: Tensor | None = None,  # [γ] or [N, γ]
    temperature: float = 1.0,
    eta: float = 3.0,
    per_block: bool = False,
) -> LossOutput:
    """LK hybrid λ·KL + (1 − λ)·TV, λ = exp(−η·sg[ᾱ_k]) per draft position.

    η = 3 follows the survey's listing (line 491); η = 0 gives KL, η → ∞ gives TV."""
    log_p, log_q = log_probs(target_logits, draft_logits, temperature)
    p = log_p.exp()
    mask = valid_mask(valid, log_q)
    kl = kl_terms(log_p, log_q, p)
    alpha, tv = overlap_tv(p, upcast(draft_logits))
    lam = lk_lambda(alpha, mask, eta, per_block)
    term = lam * kl + (1.0 - lam) * tv
    parts = {
        "kl": weighted_mean(kl.detach(), mask, weights),
        "tv": weighted_mean(tv.detach(), mask, weights),
        "lambda": lam.mean() if not per_block else weighted_mean(lam, mask),
    }
    return _output(term, mask, weights, alpha.detach(), parts)


def lk_likelihood_loss(
    target_logits: Tensor,  # [N, γ, V]
    draft_logits: Tensor,  # [N, γ, V]
    *,
    valid: Tensor | None = None,  # [N, γ] bool
    weights: Tensor | None = None,  # [γ] or [N, γ]
    temperature: float = 1.0,
) -> LossOutput:
    """LK likelihood −log α, α = Σ min(p, q); its gradient is ∇TV / α."""
    log_p, log_q = log_probs(target_logits, draft_logits, temperature)
    mask = valid_mask(valid, log_q)
    term = -log_alpha_terms(log_p, log_q)
    return _output(term, mask, weights, torch.exp(-term.detach()))
