"""Position weights for per-token drafter losses: a fixed decay and adaptive D-PACE-style weights.

Why weight positions at all (survey lines 511–519): the acceptance length is a sum of products,
τ ≈ 1 + Σ_k Π_{i≤k} α_i, so position k only pays off if every position before it was accepted.

- `decay_weights`: w_k = exp(−(k − 1)/κ), k 1-based (DFlash/Domino use κ = 7 for blocks of 16;
  DeepSpec's DSpark code uses exp(−k/4) with k 0-based, i.e. κ = 4 here).
- `dpace_weights`: adaptive weights from current acceptance estimates α (1 − TV, or a
  confidence head's σ(c)), always detached. The survey only says D-PACE derives its weights
  "from a differentiable surrogate of the acceptance length built from the drafter's own
  confidences" (line 519); the paper itself was not available. We take the surrogate
  τ(α) = 1 + Σ_k Π_{i≤k} α_i and use its sensitivity as the weight of position k:

      mode="tau_grad" (default):  w_k = ∂τ/∂α_k = Π_{i<k} α_i · (1 + Σ_{j>k} Π_{k<i≤j} α_i)
                                  (survey line 513; for constant α ≈ α^{k−1}, line 515)
      mode="survival":            w_k = Π_{i<k} α_i   (the chance position k is reached)

  With detached tau_grad weights, Σ_k w_k·TV_k has exactly the gradient of the E2E-TV loss at
  the current point, so this is the per-token (linearised) form of E2E.

This module knows nothing about logits or models: it maps numbers per position to weights.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from components.losses.common import position_mean

DPACE_MODES = ("tau_grad", "survival")


def decay_weights(
    gamma: int,
    kappa: float = 7.0,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:  # [γ]
    """w_k = exp(−(k − 1)/κ) for k = 1..γ; κ = inf gives uniform weights."""
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    if not kappa > 0:
        raise ValueError(f"kappa must be > 0, got {kappa}")
    k = torch.arange(gamma, device=device, dtype=dtype)  # k − 1
    return torch.exp(-k / kappa) if math.isfinite(kappa) else torch.ones_like(k)


def _log_survival(alpha: Tensor, floor: float) -> Tensor:  # [..., γ] -> [..., γ]
    """log Π_{i≤k} α_i, with α clamped to [floor, 1] so logs stay finite."""
    return torch.cumsum(alpha.clamp(floor, 1.0).log(), dim=-1)


def _tau_grad(alpha: Tensor, floor: float) -> Tensor:  # [..., γ] -> [..., γ]
    """∂τ/∂α_k = Σ_{j≥k} Π_{i≤j} α_i / α_k, in log space without dividing by small α."""
    log_s = _log_survival(alpha, floor)
    suffix = torch.logcumsumexp(log_s.flip(-1), dim=-1).flip(-1)  # log Σ_{j≥k} Π_{i≤j} α_i
    return torch.exp(suffix - alpha.clamp(floor, 1.0).log())


def _survival_before(alpha: Tensor, floor: float) -> Tensor:  # [..., γ] -> [..., γ]
    """Π_{i<k} α_i (1 at k = 1)."""
    log_s = _log_survival(alpha, floor)
    return torch.exp(torch.cat([torch.zeros_like(log_s[..., :1]), log_s[..., :-1]], dim=-1))


@torch.no_grad()
def dpace_weights(
    alpha: Tensor,  # [γ] or [N, γ] per-position acceptance estimates in [0, 1]
    valid: Tensor | None = None,  # [N, γ] bool, only with alpha [N, γ]
    *,
    mode: str = "tau_grad",
    per_block: bool = False,
    normalize: bool = True,
    floor: float = 1e-6,
) -> Tensor:  # [γ] (or [N, γ] when per_block)
    """Adaptive position weights from acceptance estimates; detached (no graph).

    alpha [N, γ] is averaged over valid blocks per position unless per_block (a position with
    no valid block counts as α = 0 there). normalize rescales each weight vector to mean 1 so
    that a weighted mean keeps the scale of an unweighted one."""
    if mode not in DPACE_MODES:
        raise ValueError(f"unknown D-PACE mode {mode!r}; known: {', '.join(DPACE_MODES)}")
    alpha = alpha.detach().float() if alpha.dtype != torch.float64 else alpha.detach()
    if alpha.dim() == 2 and not per_block:
        mask = torch.ones_like(alpha, dtype=torch.bool) if valid is None else valid.bool()
        alpha = torch.nan_to_num(position_mean(alpha, mask), nan=0.0)
    elif alpha.dim() == 1 and per_block:
        raise ValueError("per_block D-PACE weights need alpha [N, γ]")
    w = _tau_grad(alpha, floor) if mode == "tau_grad" else _survival_before(alpha, floor)
    if normalize:
        w = w / w.mean(-1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny)
    return w
