"""The budget curve's record selection (the training itself is the train stage's, tested there)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tests.bench.benches import load_bench

curve = load_bench("budget_curve")


def _record(prompt: int, response: int) -> SimpleNamespace:
    return SimpleNamespace(input_ids=np.arange(prompt + response), prompt_len=prompt)


def test_a_budget_is_the_shortest_prefix_holding_its_response_tokens():
    records = [_record(50, 10), _record(5, 20), _record(7, 30), _record(1, 40)]
    assert curve.budget_records(records, 10) == records[:1]
    assert curve.budget_records(records, 11) == records[:2]
    assert curve.budget_records(records, 60) == records[:3]
    assert curve.budget_records(records, 100) == records


def test_a_budget_past_the_split_is_refused_with_what_it_holds():
    with pytest.raises(SystemExit, match="101 response tokens asked, the training split holds 100"):
        curve.budget_records([_record(50, 10), _record(5, 20), _record(7, 30), _record(1, 40)], 101)


def test_one_objective_per_budget():
    """The drafter trains with the config's objective (Domino's curriculum); a chain is refused."""
    from components.confload import load

    assert curve.only_stage(load("domino.yaml")).name == "base_anchored"
    assert curve.only_stage(load("dspark.yaml")).name == "offline"
    with pytest.raises(SystemExit, match=r"\['offline', 'opd'\].*one objective"):
        curve.only_stage(load("dspark.yaml", ["train.objectives=[offline,opd]"]))


def test_drafters_side_by_side_parse_their_specs():
    from bench.drafters import parse_drafter

    assert parse_drafter("dspark") == ("dspark", "dspark", [])
    assert parse_drafter("eagle3 drafter.layer_ids=[1,14,27]") == ("eagle3", "eagle3", ["drafter.layer_ids=[1,14,27]"])
    assert parse_drafter("plain=domino train.objectives=[offline]") == ("plain", "domino", ["train.objectives=[offline]"])
    with pytest.raises(SystemExit, match="start with the drafter's preset name"):
        parse_drafter("drafter.layer_ids=[1,2]")
