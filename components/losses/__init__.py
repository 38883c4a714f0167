"""Drafter training losses as pure, batched PyTorch: no models, no Ray, no I/O.

Inputs everywhere: target logits `[N, γ, V]`, draft logits `[N, γ, V]` (N draft blocks of γ
positions), optional target tokens `[N, γ]`, a valid mask `[N, γ]` and position weights `[γ]`
or `[N, γ]`. Every loss returns a `LossOutput`: a scalar loss (weighted mean over valid
positions, or mean over blocks for block objectives) plus detached per-position statistics,
among them α_k = 1 − TV(p_k, q_k) and τ, for logging.

Modules: `divergences` (CE, KL, TV, LK), `block` (E2E-TV, BV), `confidence` (confidence head,
DSpark mix), `onpolicy` (Draft-OPD's two streams), `weights` (decay, D-PACE), `registry` (name → loss for configs), `overlap` (fused
α/TV with a hand-written backward), `common` (inputs, outputs, masked reductions).
"""

from components.losses.block import bv_loss, bv_prefix_terms, e2e_tv_loss
from components.losses.common import LossInputs, LossOutput
from components.losses.confidence import confidence_loss, confidence_terms, tv_ce_confidence_loss
from components.losses.divergences import (
    acceptance_rate,
    ce_loss,
    kl_loss,
    kl_terms,
    lk_hybrid_loss,
    lk_lambda,
    lk_likelihood_loss,
    log_alpha_terms,
    tv_loss,
    tv_terms,
)
from components.losses.onpolicy import greedy_accepted, opd_loss
from components.losses.overlap import overlap_tv
from components.losses.registry import (
    LOSSES,
    DrafterLoss,
    PositionWeighting,
    build_loss,
    loss_params,
    register_loss,
)
from components.losses.weights import decay_weights, dpace_weights

__all__ = [
    "LOSSES",
    "DrafterLoss",
    "LossInputs",
    "LossOutput",
    "PositionWeighting",
    "acceptance_rate",
    "build_loss",
    "bv_loss",
    "bv_prefix_terms",
    "ce_loss",
    "confidence_loss",
    "confidence_terms",
    "decay_weights",
    "dpace_weights",
    "e2e_tv_loss",
    "greedy_accepted",
    "kl_loss",
    "kl_terms",
    "lk_hybrid_loss",
    "lk_lambda",
    "lk_likelihood_loss",
    "log_alpha_terms",
    "loss_params",
    "opd_loss",
    "overlap_tv",
    "register_loss",
    "tv_ce_confidence_loss",
    "tv_loss",
    "tv_terms",
]
