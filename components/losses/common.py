"""Shared plumbing of the drafter losses: inputs, outputs, distributions, masked reductions.

Every loss in this package sees a batch of N draft blocks with γ draft positions each:
target logits `[N, γ, V]` (the frozen target's distribution p at each position), draft logits
`[N, γ, V]` (the drafter's q), optional target tokens `[N, γ]`, a valid mask `[N, γ]` and
optional position weights `[γ]` or `[N, γ]`. This module turns logits into float32/float64
log-probabilities, reduces per-position terms to a weighted mean over valid positions, and
computes the acceptance statistics a trainer logs (α_k = 1 − TV(p_k, q_k), the estimate
τ = 1 + Σ_k Π_{i≤k} α_i of the acceptance length, survey lines 115–117).

It knows nothing about models, tokenizers, Ray or how blocks were cut from sequences: a block
is just a row of γ positions. The target is a constant here: no gradient ever flows into
target logits. Masked positions must hold finite logits (padding rows of zeros are fine);
they never reach the loss value or its gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class LossInputs:
    """One batch as every registered loss reads it (fields a loss does not use are ignored)."""

    draft_logits: Tensor  # [N, γ, V] the drafter's logits, any float dtype
    target_logits: Tensor | None = None  # [N, γ, V] the target's logits (detached inside)
    target_tokens: Tensor | None = None  # [N, γ] long, the token at each draft position
    valid: Tensor | None = None  # [N, γ] bool, False = padding / outside the loss mask
    position_weights: Tensor | None = None  # [γ] or [N, γ], non-negative
    confidence_logits: Tensor | None = None  # [N, γ] a confidence head's logits (DSpark)


@dataclass
class LossOutput:
    """A loss value plus detached per-position statistics for logging.

    `metrics()` is the only place that moves numbers to the host (one sync), so a trainer
    can call it on logging steps only.
    """

    loss: Tensor  # [] differentiable, weighted mean over valid positions (or blocks)
    per_position: Tensor  # [γ] detached, mean over valid blocks of the per-position term
    alpha: Tensor | None = None  # [γ] detached, mean α_k = 1 − TV(p_k, q_k) (NaN: no data)
    tau: Tensor | None = None  # [] detached, mean over blocks of 1 + Σ_k Π_{i≤k} α_i
    terms: dict[str, Tensor] = field(default_factory=dict)  # name -> [] detached parts

    def metrics(self, prefix: str = "") -> dict[str, float]:
        """Flat float metrics: loss, each term, per-position term and α (1-based), τ."""
        out = {f"{prefix}loss": float(self.loss.detach())}
        out.update({f"{prefix}{k}": float(v) for k, v in self.terms.items()})
        out.update(_per_position_metrics(f"{prefix}per_position", self.per_position))
        if self.alpha is not None:
            out.update(_per_position_metrics(f"{prefix}alpha", self.alpha))
        if self.tau is not None:
            out[f"{prefix}tau"] = float(self.tau)
        return {k: v for k, v in out.items() if not math.isnan(v)}


def _per_position_metrics(name: str, values: Tensor) -> dict[str, float]:
    return {f"{name}/{k + 1}": v for k, v in enumerate(values.tolist())}


def upcast(x: Tensor) -> Tensor:  # [...] any float -> float32, float64 stays float64
    """Half-precision inputs are computed in float32; float64 stays float64 (tests)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def check_logits(target_logits: Tensor, draft_logits: Tensor, temperature: float) -> None:
    """Same [N, γ, V] shape for both logit tensors and a positive temperature."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if target_logits.shape != draft_logits.shape or target_logits.dim() != 3:
        raise ValueError(
            f"target logits {tuple(target_logits.shape)} and draft logits "
            f"{tuple(draft_logits.shape)} must have the same shape [N, γ, V]"
        )


def _scaled_target(target_logits: Tensor, temperature: float) -> Tensor:  # [N, γ, V]
    target = upcast(target_logits.detach())
    return target / temperature if temperature != 1.0 else target


@torch.no_grad()
def target_log_probs(target_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """log p `[N, γ, V]`, detached; −inf (zero-probability tokens) clamped to the most
    negative finite float, so p·log p and min(log p, ·) never produce NaN."""
    log_p = torch.log_softmax(_scaled_target(target_logits, temperature), dim=-1)
    return log_p.clamp_(min=torch.finfo(log_p.dtype).min)


@torch.no_grad()
def target_probs(target_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """p `[N, γ, V]`, detached."""
    return torch.softmax(_scaled_target(target_logits, temperature), dim=-1)


def log_probs(
    target_logits: Tensor,  # [N, γ, V]
    draft_logits: Tensor,  # [N, γ, V]
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """(log p, log q) `[N, γ, V]` each; temperature divides the target logits only."""
    check_logits(target_logits, draft_logits, temperature)
    log_q = torch.log_softmax(upcast(draft_logits), dim=-1)
    return target_log_probs(target_logits, temperature), log_q


@torch.no_grad()
def alpha_from_log_q(p: Tensor, log_q: Tensor) -> Tensor:  # [N, γ, V] x2 -> [N, γ] detached
    """α = Σ min(p, q) for metrics, with one full-size temporary."""
    q = log_q.detach().exp()
    return torch.minimum(q, p, out=q).sum(-1)


def valid_mask(valid: Tensor | None, like: Tensor) -> Tensor:  # -> [N, γ] bool
    """The valid mask as bool `[N, γ]`, all True when None; `like` is any `[N, γ, ...]`."""
    shape = tuple(like.shape[:2])
    if valid is None:
        return torch.ones(shape, dtype=torch.bool, device=like.device)
    if tuple(valid.shape) != shape:
        raise ValueError(f"valid mask {tuple(valid.shape)} must be [N, γ] = {shape}")
    return valid.to(device=like.device, dtype=torch.bool)


def prefix_mask(valid: Tensor) -> Tensor:  # [N, γ] bool -> [N, γ] bool
    """Valid positions up to (excluding) each block's first invalid one.

    Block objectives multiply along the block and cannot skip a missing position, so a
    block is truncated at its first invalid position (as DSpark's cumprod eval mask does).
    """
    return torch.cumprod(valid.to(torch.int32), dim=1).bool()


def gather_tokens(
    log_probs_: Tensor,  # [N, γ, V]
    tokens: Tensor | None,  # [N, γ] long (any value at invalid positions, e.g. -100)
    valid: Tensor,  # [N, γ] bool
) -> Tensor:  # [N, γ]
    """log-probability of each position's token; invalid positions read token 0."""
    return log_probs_.gather(-1, safe_tokens(tokens, valid).unsqueeze(-1)).squeeze(-1)


def safe_tokens(tokens: Tensor | None, valid: Tensor) -> Tensor:  # [N, γ] -> [N, γ] long
    """Each position's token, 0 at invalid positions (what ``gather_tokens`` reads)."""
    if tokens is None:
        raise ValueError("this loss needs target_tokens [N, γ]")
    if tuple(tokens.shape) != tuple(valid.shape):
        raise ValueError(
            f"target tokens {tuple(tokens.shape)} must be [N, γ] = {tuple(valid.shape)}"
        )
    return torch.where(valid, tokens.to(device=valid.device, dtype=torch.long), 0)


def weight_matrix(
    valid: Tensor,  # [N, γ] bool
    weights: Tensor | None,  # [γ] or [N, γ], non-negative
    dtype: torch.dtype = torch.float32,
) -> Tensor:  # [N, γ]
    """Position weights broadcast to `[N, γ]` and zeroed at invalid positions."""
    w = valid.to(dtype)
    if weights is None:
        return w
    if weights.dim() not in (1, 2) or weights.shape[-1] != valid.shape[1]:
        raise ValueError(f"position weights {tuple(weights.shape)} must be [γ] or [N, γ]")
    if weights.dim() == 2 and tuple(weights.shape) != tuple(valid.shape):
        raise ValueError(f"position weights {tuple(weights.shape)} must be [N, γ]")
    return w * weights.detach().to(device=valid.device, dtype=dtype)


def weighted_mean(
    term: Tensor,  # [N, γ] per-position loss
    valid: Tensor,  # [N, γ] bool
    weights: Tensor | None = None,  # [γ] or [N, γ]
) -> Tensor:  # []
    """Σ w·term / Σ w over valid positions; 0 when nothing is valid. Invalid terms are
    replaced (not multiplied) by zero, so NaN/inf there cannot leak into value or grad."""
    w = weight_matrix(valid, weights, term.dtype)
    safe = torch.where(valid, term, torch.zeros((), dtype=term.dtype, device=term.device))
    return (w * safe).sum() / w.sum().clamp_min(torch.finfo(term.dtype).tiny)


def position_mean(
    values: Tensor,  # [N, γ]
    valid: Tensor,  # [N, γ] bool
) -> Tensor:  # [γ] detached, NaN where no block is valid
    """Unweighted mean over valid blocks at each position, for logging."""
    values = values.detach()
    count = valid.sum(0)
    total = torch.where(
        valid, values, torch.zeros((), dtype=values.dtype, device=values.device)
    ).sum(0)
    return torch.where(count > 0, total / count.clamp_min(1), torch.full_like(total, math.nan))


def survival(alpha: Tensor, prefix: Tensor) -> Tensor:  # [N, γ], [N, γ] bool -> [N, γ]
    """Π_{i≤k} α_i per block, zero from the first invalid position on."""
    return torch.cumprod(torch.where(prefix, alpha, torch.zeros_like(alpha)), dim=1)


@torch.no_grad()
def acceptance_stats(
    alpha: Tensor,  # [N, γ] per-position acceptance α = 1 − TV
    valid: Tensor,  # [N, γ] bool
) -> tuple[Tensor, Tensor]:  # ([γ], [])
    """Mean α per position over valid blocks, and mean τ = 1 + Σ_k Π_{i≤k} α_i over blocks
    with at least one valid position (each block truncated at its first invalid position)."""
    alpha = alpha.detach()
    prefix = prefix_mask(valid)
    tau_block = 1.0 + survival(alpha, prefix).sum(1)  # [N]
    has = prefix[:, 0].to(tau_block.dtype)
    tau = (tau_block * has).sum() / has.sum()  # 0/0 = NaN when no block is valid; no sync
    return position_mean(alpha, valid), tau


def block_mean(values: Tensor, keep: Tensor) -> Tensor:  # [N], [N] bool -> []
    """Mean of per-block values over kept blocks; 0 when none is kept (no NaN, no grad)."""
    safe = torch.where(keep, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return safe.sum() / keep.sum().clamp_min(1).to(values.dtype)
