"""The adaptive cap's set-up as the serve and eval stages share it: the DLoop gate, the profiled
batch sizes, and one engine built over a stored profile."""

from __future__ import annotations

from components.engine.adaptive.policy import AdaptiveDraftLength
from components.engine.adaptive.setup import adaptive_engine, loop_gate_for, profile_batch_sizes
from components.engine.settings import DEFAULT_LOOP_GATE, OPEN_GATE, resolve_settings
from tests.components.engine.test_engine_greedy import random_drafter


def test_the_gate_is_open_under_the_adaptive_cap_unless_set():
    assert loop_gate_for(None, adaptive=True) == OPEN_GATE
    assert loop_gate_for(None, adaptive=False) == DEFAULT_LOOP_GATE
    assert loop_gate_for(-2.0, adaptive=True) == -2.0


def test_profiles_cover_one_row_up_to_the_largest_batch():
    assert profile_batch_sizes(1) == [1]
    assert profile_batch_sizes(8) == [1, 2, 4, 8]
    assert profile_batch_sizes(12) == [1, 2, 4, 8, 12]


def test_the_engine_drafts_under_the_policy_priced_by_the_stored_profile(tiny_target, tmp_path):
    drafter = random_drafter(tiny_target, "dspark")
    settings = resolve_settings(drafter, num_speculative_tokens=2, loop_gate=OPEN_GATE)
    engine, stored = adaptive_engine(tiny_target, drafter, settings, tmp_path, 2)
    assert engine.settings is settings and engine.max_batch_size == 2 and not stored.reused
    assert isinstance(engine.draft_length, AdaptiveDraftLength) and engine.draft_length.round_time is stored.times
    assert stored.times.batch_sizes == [1, 2]
    _, reread = adaptive_engine(tiny_target, drafter, settings, tmp_path, 2)
    assert reread.reused and reread.path == stored.path
