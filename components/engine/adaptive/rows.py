"""Each row's survival estimate for the adaptive cap, and the round's cap over the rows.

The cap is asked of the draft-length policy with each row's survival estimate: its latest
proposal's confidences, scaled by the row's own record of accepted against predicted drafts
(when the policy calibrates), else the acceptance seen over all rows scaled the same way.
``RowSurvival`` is that estimate and record, one per row of the batch; ``round_cap`` asks the
policy with them.

Knows confidences, acceptance counts and the policy's interface; nothing about drafters,
verification or the target.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor

from components.engine.adaptive.policy import DraftLengthPolicy

ROW_DECAY = 0.8  # per round, on a row's predicted/accepted sums
ROW_PRIOR = 4.0  # pseudo-tokens on both sides of a row's ratio: about one round's worth of evidence


@dataclass
class RowSurvival:
    """One row's survival estimate between rounds and its record (predicted against accepted)."""

    survival: NDArray | None = None  # [γ'] float64: this round's proposal's survival, calibrated for this row
    raw: NDArray | None = None  # [γ'] float64: the same as the confidence head gave it
    hits: list[float] = field(default_factory=lambda: [0.0, 0.0])  # this row's Σ predicted, Σ accepted

    def settle(self, num_drafts: int, accepted: int) -> None:
        """A row that drafted ``num_drafts`` last round and accepted ``accepted`` adds what its
        confidences predicted and what it got (decayed), for ``row_calibrated``: the head's
        error is not the same on every request."""
        if self.raw is None:
            return
        self.hits[0] = ROW_DECAY * self.hits[0] + float(self.raw[:num_drafts].sum())
        self.hits[1] = ROW_DECAY * self.hits[1] + float(accepted)

    def refresh(self, confidences: Tensor | NDArray | None, calibrate: bool) -> None:
        """This round's confidences [1, γ'] (None: no proposal, a plain round: no fresh estimate,
        so the next cap reads the acceptance seen so far; a stale low confidence would keep the
        row plain for good), scaled by the row's record when ``calibrate``."""
        conf = survival_from_confidences(confidences)
        self.raw = conf[0] if conf is not None else None
        self.survival = row_calibrated(self.raw, self.hits) if calibrate else self.raw

    def clear(self) -> None:
        """No estimate until the row's next proposal (its record is kept)."""
        self.survival = self.raw = None

    def estimate(self, fallback: NDArray, calibrate: bool) -> NDArray:  # fallback [max_cap] → [max_cap] float64
        """The row's survival: its latest confidences (already scaled by its record), extended
        past their length by the acceptance seen over all rows (``fallback``); without fresh
        confidences (after a plain round), that acceptance alone, scaled by the row's record."""
        if self.survival is None and calibrate:
            return row_calibrated(fallback, self.hits)
        return _fill(self.survival, fallback)


def round_cap(policy: DraftLengthPolicy, rows: list[RowSurvival], max_cap: int,
              remaining: list[int] | None) -> int:
    """The policy's cap for this round over the speculating rows' estimates (``remaining``:
    tokens left per row when the batch is draining, its time being that of its last row)."""
    fallback = policy.empirical_survival(max_cap)
    survival = np.stack([r.estimate(fallback, policy.calibrate) for r in rows])  # [B', max_cap]
    return policy.cap(survival, max_cap, remaining=remaining)


def row_calibrated(survival: NDArray | None, hits: list[float]) -> NDArray | None:
    """A row's survival [γ'] scaled by what its own past rounds got against what its
    confidences predicted, (accepted + m) / (predicted + m), monotone and at most 1. The
    policy's per-position calibration works over all rows; this one catches the request the
    head is steadily wrong about (a hard continuation in a batch of easy ones)."""
    if survival is None:
        return None
    ratio = (hits[1] + ROW_PRIOR) / (hits[0] + ROW_PRIOR)
    return np.minimum.accumulate(np.clip(survival * ratio, 0.0, 1.0), axis=-1)


def survival_from_confidences(confidences: Tensor | NDArray | None) -> NDArray | None:
    """Confidence-head outputs [1, γ'] (P(draft k accepted | prefix accepted)) → survival [1, γ']
    float64 (numpy: a round's estimates are a few floats, on which torch's per-op cost outweighs
    the arithmetic)."""
    if confidences is None:
        return None
    c = confidences.detach().to("cpu", torch.float64).numpy() if isinstance(confidences, Tensor) else confidences
    return np.cumprod(np.clip(np.asarray(c, np.float64), 0.0, 1.0), axis=-1)


def _fill(survival: NDArray | None, fallback: NDArray) -> NDArray:  # → [len(fallback)] float64
    if survival is None:
        return fallback
    s, n = survival[: fallback.shape[0]], min(survival.shape[0], fallback.shape[0])
    if n == 0:
        return fallback
    return np.concatenate([s, fallback[n:] / max(float(fallback[n - 1]), 1e-9) * s[-1]])  # extend by empirical α
