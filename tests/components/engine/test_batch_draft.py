"""The batch engine's drafting step: per-row calibration of the confidence head's survival."""

from __future__ import annotations

import torch

from components.engine.batch import BatchEngine, Request
from components.engine.batch_draft import _row_calibrated
from components.engine.schedule import AdaptiveDraftLength
from components.spec.cost import ProfileTable
from tests.components.engine.test_batch_engine import batch_prompts
from tests.components.engine.test_engine_greedy import random_drafter


def test_row_calibration_scales_by_the_rows_own_record():
    survival = torch.tensor([0.9, 0.8, 0.6], dtype=torch.float64)
    assert _row_calibrated(None, [3.0, 1.0]) is None
    same = _row_calibrated(survival, [0.0, 0.0])  # no record yet: as the head says
    torch.testing.assert_close(same, survival)
    doubted = _row_calibrated(survival, [11.0, 1.0])  # predicted 11 accepted, got 1: (1+4)/(11+4)
    torch.testing.assert_close(doubted, survival / 3)
    trusted = _row_calibrated(survival, [1.0, 11.0])  # got more than predicted: capped at 1
    assert float(trusted.max()) <= 1.0 and bool((trusted[1:] <= trusted[:-1]).all())


def test_rows_keep_their_own_record(tiny_target):
    """A random drafter's head predicts acceptance it does not get: every drafting row's
    predicted sum grows past its accepted sum, and its survival is scaled down for it."""
    engine = BatchEngine(tiny_target, random_drafter(tiny_target, "dspark"), max_batch_size=3,
                         draft_length=AdaptiveDraftLength(ProfileTable([1, 512], [1.0, 1.0])))
    for p in batch_prompts(tiny_target)[:3]:
        engine.add(Request(p, 30))
    for _ in range(6):
        engine.step()
    rows = [r for r in engine.batch.rows if r.hits[0] > 0]
    assert rows and all(r.hits[0] > r.hits[1] for r in rows)
    for r in rows:
        if r.raw_survival is not None:
            assert bool((r.survival <= r.raw_survival + 1e-12).all())
