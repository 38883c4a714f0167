"""Profiled engine round times: the grid, its interpolation, and the adaptive policy pricing
rounds from it from the first round on."""

from __future__ import annotations

import json
import os

import pytest
import torch

from components.engine.adaptive.policy import AdaptiveDraftLength
from components.engine.adaptive.profile import profile_key, profile_round_times, stored_round_times
from components.engine.adaptive.times import RoundTimes
from components.engine.batch import BatchEngine
from components.engine.settings import resolve_settings
from tests.components.engine.adaptive.test_policy import GAMMA, run_rounds
from tests.components.engine.test_engine_greedy import random_drafter


def test_profile_covers_every_batch_size_and_cap(tiny_target):
    drafter = random_drafter(tiny_target, "dspark")
    table = profile_round_times(tiny_target, drafter, batch_sizes=(3, 1), context=8, rounds=1)
    caps = BatchEngine(tiny_target, drafter).max_cap + 1
    assert table.batch_sizes == [1, 3] and tuple(table.seconds.shape) == (2, caps)
    assert bool((table.seconds > 0).all())
    with pytest.raises(ValueError, match="needs a drafter"):
        profile_round_times(tiny_target, None)


def test_a_stored_profile_is_reused_for_the_same_setting_only(tiny_target, tmp_path):
    drafter = random_drafter(tiny_target, "dspark")
    where, noticed = tmp_path / "profiles", []
    first = stored_round_times(where, tiny_target, drafter, (1,), notice=noticed.append, context=8, rounds=1)
    path = first.path
    assert not first.reused and path.is_file() and path.parent == where and not list(where.glob("*.tmp"))
    assert noticed == [path] and first.describe() == f"measured: {path.name}"
    again = stored_round_times(where, tiny_target, drafter, (1,), notice=noticed.append, context=8, rounds=1)
    assert again.reused and again.path == path and torch.equal(again.times.seconds, first.times.seconds)
    assert noticed == [path]  # nothing to wait for: no notice
    other = stored_round_times(where, tiny_target, drafter, (1, 2), context=8, rounds=1)
    assert not other.reused and other.times.batch_sizes == [1, 2] and other.path != path  # another setting
    path.write_text("{not json")
    with pytest.raises(ValueError, match=rf"{path.name}: unreadable .*delete it"):
        stored_round_times(where, tiny_target, drafter, (1,), context=8, rounds=1)


def test_round_times_interpolate_in_batch_size_and_hold_the_last_cap():
    table = RoundTimes([1, 4], torch.tensor([[1.0, 2.0], [4.0, 8.0]]))
    assert table(1, 0) == 1.0 and table(4, 1) == 8.0
    assert table(2, 0) == pytest.approx(2.0)  # linear between profiled sizes
    assert table(8, 1) == pytest.approx(16.0)  # above the largest: in proportion to B
    assert table(4, 5) == 8.0  # caps above the profiled ones: held
    assert table.row(2, 3).tolist() == pytest.approx([2.0, 4.0, 4.0, 4.0])  # every cap at once
    assert RoundTimes.from_dict(table.to_dict())(2, 1) == pytest.approx(table(2, 1))
    with pytest.raises(ValueError, match="batch sizes"):
        RoundTimes([4, 1], torch.ones(2, 2))
    with pytest.raises(ValueError, match="does not match"):
        RoundTimes([1], torch.ones(2, 2))


def profiled(seconds) -> RoundTimes:
    """A profile that is exactly the simulated clock ``seconds(batch, cap)``, at batch 4."""
    return RoundTimes([4], torch.tensor([[seconds(4, g) for g in range(GAMMA + 1)]]))


def test_policy_on_a_profile_that_says_drafting_loses_stays_plain_from_the_start():
    """Every drafted token costs a full plain round's time and half of them are accepted: the
    profiled policy plays plain rounds from the first one, apart from its re-checks."""
    def true_seconds(batch, cap):
        return 0.01 * (cap + 1)

    caps = run_rounds(AdaptiveDraftLength(round_time=profiled(true_seconds)), 4, 0.5, true_seconds, 0.5)
    assert caps[0] == 0 and caps.count(0) >= len(caps) - 5  # tries of drafting back off: rounds 1, 3, 7, ...


def test_policy_on_a_profile_that_says_drafting_is_free_drafts_fully_from_the_start():
    def true_seconds(batch, cap):
        return 0.01

    policy = AdaptiveDraftLength(round_time=profiled(true_seconds))
    caps = run_rounds(policy, 4, 0.9, true_seconds, 0.9)
    assert caps[0] == GAMMA and caps.count(0) <= 1 + len(caps) // policy.recheck


def test_policy_needs_a_forward_table_or_a_round_profile():
    with pytest.raises(ValueError, match="round_time"):
        AdaptiveDraftLength()


def test_without_confidences_the_policy_climbs_past_the_caps_it_has_seen():
    """A drafter with no confidence head (prompt lookup) at batch 1: survival comes from the
    acceptance seen so far. Cap 1 is cheap and caps above it cost more; the drafter accepts 90%
    at every position. Positions never drafted inherit the acceptance of the ones before, so the
    policy goes on to the full cap instead of staying at 1 (where it would learn nothing of
    positions 2+)."""
    def true_seconds(batch, cap):
        return 0.013 if cap == 0 else 0.018 if cap == 1 else 0.028

    table = RoundTimes([1], torch.tensor([[true_seconds(1, g) for g in range(GAMMA + 1)]]))
    policy, caps, gen = AdaptiveDraftLength(round_time=table), [], torch.Generator().manual_seed(0)
    for _ in range(40):
        cap = policy.cap(policy.empirical_survival(GAMMA)[None, :], GAMMA)
        caps.append(cap)
        hits = (torch.rand(cap, generator=gen) < 0.9).long()
        accepted = int(hits.cumprod(0).sum()) if cap else 0  # leading drafts accepted
        seconds = true_seconds(1, cap)
        policy.observe([accepted] if cap else [], [cap] if cap else [], 0.0, seconds, seconds, cap + 1)
    assert caps[-20:].count(GAMMA) >= 16
    assert 0.2 < float(policy.empirical_survival(GAMMA)[-1]) < 0.8  # true: 0.9^7 = 0.48


def test_dloop_caps_are_timed_at_each_stages_ends_and_interpolated_between():
    from components.engine.adaptive.profile import _fill_caps, profiled_caps

    assert profiled_caps(21, 7) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 14, 15, 21]
    assert profiled_caps(7, 7) == list(range(8)) and profiled_caps(5, 2) == [0, 1, 2, 3, 4, 5]
    filled = _fill_caps({0: 1.0, 1: 2.0, 2: 2.0, 3: 4.0, 6: 7.0}, 6)
    assert filled == [1.0, 2.0, 2.0, 4.0, 5.0, 6.0, 7.0]


def test_a_dloop_profile_covers_every_cap_of_every_stage(tiny_target):
    drafter = random_drafter(tiny_target, "dspark")
    settings = resolve_settings(drafter, num_speculative_tokens=3, loop_stages=3, loop_gate=float("-inf"))
    engine = BatchEngine(tiny_target, drafter, settings=settings)
    table = profile_round_times(tiny_target, drafter, batch_sizes=(1,), settings=settings, context=8, rounds=1)
    assert engine.max_cap == 9 and tuple(table.seconds.shape) == (1, 10) and bool((table.seconds > 0).all())
    assert bool((table.seconds[0, 1:] >= table.seconds[0, :-1]).all())  # a wider cap never costs less


def test_profiles_of_different_drafters_are_kept_apart(tiny_target, tmp_path):
    """The profile's file is named by its key, so the key tells drafters apart by their declared
    identity."""
    from components.config import DrafterConfig
    from components.drafters import build_drafter

    small = random_drafter(tiny_target, "dspark")
    wider = build_drafter(DrafterConfig(name="dspark", num_layers=2), tiny_target).eval()
    keys = [json.dumps(profile_key(tiny_target, d, (1,), resolve_settings(d)), sort_keys=True) for d in (small, wider)]
    assert len(set(keys)) == 2
    assert profile_key(tiny_target, small, (1,), resolve_settings(small, loop_stages=2)) \
        != profile_key(tiny_target, small, (1,), resolve_settings(small))


def test_a_profile_is_keyed_by_the_processor_it_was_timed_on(tiny_target, monkeypatch):
    """Another processor (a shared profile directory, a VM moved to other hardware) is another key."""
    from components.engine.adaptive import profile

    d = random_drafter(tiny_target, "dspark")
    here = profile_key(tiny_target, d, (1,), resolve_settings(d))
    assert here["host"] == profile.host_processor(tiny_target.device) and here["host"].endswith(f" x {os.cpu_count()}")
    monkeypatch.setattr(profile.os, "cpu_count", lambda: 1024)
    assert profile_key(tiny_target, d, (1,), resolve_settings(d)) != here
