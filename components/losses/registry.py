"""Name → loss registry, so a config picks a drafter loss and its position weighting by name.

    loss = build_loss("lk_hybrid", eta=3.0, weighting={"kind": "decay", "kappa": 7})
    out = loss(LossInputs(draft_logits=..., target_logits=..., valid=...))
    out.loss.backward(); log(out.metrics())

Every registered loss is a function `fn(target_logits, draft_logits, *, <data>, <params>)`
returning a `LossOutput`; the data keywords it may take are `target_tokens`, `valid`,
`weights` and `confidence_logits`, everything else keyword-only is a hyperparameter that
`build_loss` checks strictly. The trainer calls every loss the same way and never branches
on its name. This module knows nothing about config files or trainers.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import Tensor

from components.losses.block import bv_loss, e2e_tv_loss
from components.losses.common import LossInputs, LossOutput, valid_mask
from components.losses.confidence import confidence_loss, tv_ce_confidence_loss
from components.losses.divergences import (
    acceptance_rate,
    ce_loss,
    kl_loss,
    lk_hybrid_loss,
    lk_likelihood_loss,
    tv_loss,
)
from components.losses.onpolicy import opd_loss
from components.losses.weights import DPACE_MODES, decay_weights, dpace_weights

LossFn = Callable[..., LossOutput]
DATA_KEYWORDS = ("target_tokens", "valid", "weights", "confidence_logits")
WEIGHTING_KINDS = ("none", "decay", "dpace")
DPACE_SOURCES = ("tv", "confidence")

LOSSES: dict[str, LossFn] = {
    "ce": ce_loss,
    "kl": kl_loss,
    "tv": tv_loss,
    "lk_hybrid": lk_hybrid_loss,
    "lk_likelihood": lk_likelihood_loss,
    "e2e_tv": e2e_tv_loss,
    "bv": bv_loss,
    "tv_ce_confidence": tv_ce_confidence_loss,
    "confidence": confidence_loss,
    "opd": opd_loss,
}


def register_loss(name: str, fn: LossFn) -> LossFn:
    """Add a loss under a new name (the signature convention is in the module docstring)."""
    if name in LOSSES:
        raise ValueError(f"loss {name!r} is already registered")
    LOSSES[name] = fn
    return fn


def loss_params(fn: LossFn) -> dict[str, Any]:
    """The hyperparameters of a loss function and their defaults."""
    sig = inspect.signature(fn).parameters.values()
    return {
        p.name: p.default
        for p in sig
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in DATA_KEYWORDS
    }


@dataclass(frozen=True)
class PositionWeighting:
    """How a built loss weights draft positions when the batch brings no weights of its own.

    kind: "none" | "decay" (exp(−(k−1)/κ)) | "dpace" (weights.dpace_weights, detached).
    source: where D-PACE reads α: "tv" = 1 − TV of this batch, "confidence" = σ(confidence
    logits), the drafter's own confidences."""

    kind: str = "none"
    kappa: float = 7.0
    mode: str = "tau_grad"
    source: str = "tv"
    per_block: bool = False

    def __post_init__(self) -> None:
        _check_choice("weighting kind", self.kind, WEIGHTING_KINDS)
        _check_choice("D-PACE mode", self.mode, DPACE_MODES)
        _check_choice("D-PACE source", self.source, DPACE_SOURCES)

    def weights(self, inputs: LossInputs, temperature: float = 1.0) -> Tensor | None:
        """[γ] (or [N, γ] for per-block D-PACE) weights for this batch, or None."""
        draft = inputs.draft_logits
        if self.kind == "decay":
            return decay_weights(draft.shape[1], self.kappa, device=draft.device)
        if self.kind == "none":
            return None
        with torch.no_grad():
            if self.source == "confidence":
                if inputs.confidence_logits is None:
                    raise ValueError("D-PACE source 'confidence' needs confidence_logits")
                alpha = torch.sigmoid(inputs.confidence_logits.float())
            else:
                if inputs.target_logits is None:
                    raise ValueError("D-PACE source 'tv' needs target_logits")
                alpha = acceptance_rate(inputs.target_logits, draft, temperature)
        valid = valid_mask(inputs.valid, draft)
        return dpace_weights(alpha, valid, mode=self.mode, per_block=self.per_block)


def _check_choice(what: str, value: str, known: tuple[str, ...]) -> None:
    if value not in known:
        raise ValueError(f"unknown {what} {value!r}; known: {', '.join(known)}")


@dataclass(frozen=True)
class DrafterLoss:
    """A registered loss bound to its hyperparameters and position weighting."""

    name: str
    fn: LossFn
    params: Mapping[str, Any] = field(default_factory=dict)
    weighting: PositionWeighting = field(default_factory=PositionWeighting)

    def __call__(self, inputs: LossInputs) -> LossOutput:
        accepted = inspect.signature(self.fn).parameters
        data = {
            "target_tokens": inputs.target_tokens,
            "valid": inputs.valid,
            "weights": self._weights(inputs),
            "confidence_logits": inputs.confidence_logits,
        }
        data = {k: v for k, v in data.items() if k in accepted}
        return self.fn(inputs.target_logits, inputs.draft_logits, **data, **self.params)

    def _weights(self, inputs: LossInputs) -> Tensor | None:
        """The batch's own weights times the configured weighting (either may be absent)."""
        scheduled = self.weighting.weights(inputs, self.params.get("temperature", 1.0))
        given = inputs.position_weights
        if scheduled is None or given is None:
            return given if scheduled is None else scheduled
        return given.to(scheduled.device, scheduled.dtype) * scheduled


def build_loss(
    name: str,
    *,
    weighting: PositionWeighting | Mapping[str, Any] | None = None,
    **params: Any,
) -> DrafterLoss:
    """The loss registered as `name` with `params`; unknown names or keys raise ValueError."""
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; known losses: {', '.join(sorted(LOSSES))}")
    fn = LOSSES[name]
    known = loss_params(fn)
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ValueError(
            f"unknown parameter(s) {unknown} for loss {name!r}; known: {', '.join(known) or '-'}"
        )
    return DrafterLoss(name, fn, dict(params), _as_weighting(weighting))


def _as_weighting(weighting: PositionWeighting | Mapping[str, Any] | None) -> PositionWeighting:
    if weighting is None:
        return PositionWeighting()
    if isinstance(weighting, PositionWeighting):
        return weighting
    names = {f.name for f in fields(PositionWeighting)}
    unknown = sorted(set(weighting) - names)
    if unknown:
        raise ValueError(f"unknown weighting key(s) {unknown}; known: {', '.join(sorted(names))}")
    return PositionWeighting(**weighting)
