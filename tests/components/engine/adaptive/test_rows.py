"""Each row's survival estimate for the adaptive cap: scaled by the row's own record."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from numpy.testing import assert_allclose

from components.engine.adaptive.rows import RowSurvival, row_calibrated


def test_row_calibration_scales_by_the_rows_own_record():
    survival = np.array([0.9, 0.8, 0.6])
    assert row_calibrated(None, [3.0, 1.0]) is None
    same = row_calibrated(survival, [0.0, 0.0])  # no record yet: as the head says
    assert_allclose(same, survival)
    doubted = row_calibrated(survival, [11.0, 1.0])  # predicted 11 accepted, got 1: (1+4)/(11+4)
    assert_allclose(doubted, survival / 3)
    trusted = row_calibrated(survival, [1.0, 11.0])  # got more than predicted: capped at 1
    assert float(trusted.max()) <= 1.0 and bool((trusted[1:] <= trusted[:-1]).all())


def test_a_row_records_what_its_confidences_predicted_and_what_it_got():
    row = RowSurvival()
    row.settle(3, 1)  # no confidences yet: nothing to record
    assert row.hits == [0.0, 0.0]
    row.refresh(torch.tensor([[0.9, 0.5, 0.5]]), calibrate=True)  # survival 0.9, 0.45, 0.225
    assert_allclose(row.raw, [0.9, 0.45, 0.225])
    row.settle(2, 1)  # drafted two: predicted 1.35, accepted 1
    assert row.hits == pytest.approx([1.35, 1.0])
    row.clear()
    assert row.raw is None and row.survival is None and row.hits == pytest.approx([1.35, 1.0])
    fallback = np.array([0.8, 0.6])
    assert_allclose(row.estimate(fallback, calibrate=True), row_calibrated(fallback, row.hits))
    assert_allclose(row.estimate(fallback, calibrate=False), fallback)
