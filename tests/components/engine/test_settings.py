"""The engines' drafting settings: resolved once per drafter, handed to every engine as is."""

from __future__ import annotations

import pytest

from components.engine import BatchEngine, SpeculativeEngine, TreeEngine
from components.engine.settings import DEFAULT_LOOP_GATE, EngineSettings, resolve_settings
from tests.components.engine.test_engine_greedy import random_drafter


def test_resolving_fills_in_the_drafters_gamma_and_keeps_the_rest(tiny_target):
    drafter = random_drafter(tiny_target, "dspark")
    own = resolve_settings(drafter)
    assert own.num_speculative_tokens == drafter.num_speculative_tokens and own.loop_gate == DEFAULT_LOOP_GATE
    looped = resolve_settings(drafter, num_speculative_tokens=3, loop_stages=2, loop_gate=-1.0)
    assert (looped.num_speculative_tokens, looped.loop_stages, looped.loop_gate, looped.max_cap) == (3, 2, -1.0, 6)
    assert looped.describe()["loop_stages"] == "2" and set(looped.describe()) == set(EngineSettings().describe())


def test_no_drafter_is_plain_decoding(tiny_target):
    plain = resolve_settings(None, num_speculative_tokens=5, loop_stages=3)
    assert plain.num_speculative_tokens == 0 and plain.max_cap == 0
    with pytest.raises(ValueError, match="need a drafter"):
        resolve_settings(None, tree_budget=4)


def test_what_a_drafter_cannot_serve_is_refused_when_resolving(tiny_target):
    drafter = random_drafter(tiny_target, "dspark")
    with pytest.raises(ValueError, match="loop_stages must be >= 1"):
        resolve_settings(drafter, loop_stages=0)
    with pytest.raises(ValueError, match="per block"):
        resolve_settings(drafter, num_speculative_tokens=drafter.max_speculative_tokens + 1)
    with pytest.raises(ValueError, match="not combined with DLoop stages or carryover"):
        resolve_settings(drafter, loop_stages=2, tree_budget=8)
    with pytest.raises(ValueError, match="builder 'bush'"):
        resolve_settings(drafter, tree_budget=8, tree_builder="bush")


def test_every_engine_takes_the_resolved_settings_as_they_are(tiny_target):
    drafter = random_drafter(tiny_target, "dspark")
    settings = resolve_settings(drafter, num_speculative_tokens=3, tree_budget=6)
    assert SpeculativeEngine(tiny_target, drafter, settings=settings).settings is settings
    assert TreeEngine(tiny_target, drafter, settings=settings).settings is settings
    batch = BatchEngine(tiny_target, drafter, settings=settings)
    assert batch.settings is settings and batch.drafting.settings is settings and batch.trees.settings is settings
    assert (batch.num_speculative_tokens, batch.max_cap) == (3, 3)
