"""Engine features state what they need of a drafter and check it when they are built: a drafter
that does not declare a required capability is refused by name (DLoop stages, carryover, the
causal tree builder), one without an optional fast path is served row by row with the same
output (batched propose / consume), and one that does not read the target's K/V is never handed
it. No attribute of the drafter is probed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from components.drafters.capabilities import Capability, CapabilityError
from components.engine import (
    OracleDrafter,
    PromptLookupDrafter,
    SpeculativeEngine,
    TargetDrafter,
    TreeEngine,
)
from components.engine.batch import BatchEngine
from tests.components.engine.batch.test_continuous import requests
from tests.components.engine.test_engine_carryover import carry_drafter
from tests.components.engine.test_engine_greedy import MAX_NEW, prompts, random_drafter

ENGINE_SOURCES = Path(__file__).resolve().parents[3] / "components" / "engine"


def without(drafter, *caps: Capability):
    """``drafter`` declaring what it declared less ``caps`` (its methods are all still there)."""
    kept = frozenset(drafter.capabilities()) - set(caps)
    drafter.capabilities = lambda: kept  # shadows the class's method on this instance
    return drafter


def forbid(monkeypatch, drafter, method: str) -> None:
    """Calling ``drafter.<method>`` fails the test."""
    def called(*args, **kwargs):
        raise AssertionError(f"{method} called although the drafter does not declare it")
    monkeypatch.setattr(drafter, method, called)


def test_dloop_stages_need_own_context(tiny_target):
    drafter = random_drafter(tiny_target, "dspark")
    SpeculativeEngine(tiny_target, drafter, loop_stages=2)  # declared: fine
    without(drafter, Capability.OWN_CONTEXT)
    SpeculativeEngine(tiny_target, drafter, loop_stages=1)  # one stage needs nothing more
    message = r"loop_stages=2 \(DLoop\) needs capability own_context; drafter 'dspark' \(DSparkDrafter\)"
    with pytest.raises(CapabilityError, match=message):
        SpeculativeEngine(tiny_target, drafter, loop_stages=2)
    with pytest.raises(CapabilityError, match=message):
        BatchEngine(tiny_target, drafter, loop_stages=2)
    with pytest.raises(CapabilityError, match="needs capability own_context; drafter 'eagle3'"):
        SpeculativeEngine(tiny_target, random_drafter(tiny_target, "eagle3"), loop_stages=3)
    with pytest.raises(CapabilityError, match="drafter 'PromptLookupDrafter' .*declares: none"):
        SpeculativeEngine(tiny_target, PromptLookupDrafter(tiny_target.vocab_size, 4), loop_stages=2)


def test_carryover_needs_carryover(tiny_target):
    drafter = carry_drafter(tiny_target, "dspark")
    SpeculativeEngine(tiny_target, drafter, carryover=True)
    without(drafter, Capability.CARRYOVER)
    with pytest.raises(CapabilityError, match="carryover=True needs capability carryover; drafter 'dspark'"):
        SpeculativeEngine(tiny_target, drafter, carryover=True)
    with pytest.raises(CapabilityError, match="needs capability carryover"):
        BatchEngine(tiny_target, drafter, carryover=True)


def test_causal_tree_builder_needs_a_causal_tree_head(tiny_target):
    drafter = random_drafter(tiny_target, "dspark")
    TreeEngine(tiny_target, drafter, builder="causal")
    without(drafter, Capability.CAUSAL_TREE_HEAD)
    TreeEngine(tiny_target, drafter, builder="ddtree")  # per-depth marginals need nothing more
    message = "tree engine builder 'causal' needs capability causal_tree_head; drafter 'dspark'"
    with pytest.raises(CapabilityError, match=message):
        TreeEngine(tiny_target, drafter, builder="causal")
    with pytest.raises(CapabilityError, match=message):  # refused when built, not in its first tree round
        BatchEngine(tiny_target, drafter, tree_budget=8, tree_builder="causal")


@pytest.mark.parametrize("name", ["dspark", "eagle3"])
def test_without_batched_propose_rows_propose_one_by_one(tiny_target, greedy_refs, monkeypatch, name):
    """The same drafter, its ``propose_many`` undeclared (and booby-trapped): the batch engine
    proposes per row, losslessly, with the same drafts (so the same acceptance) as batched."""
    batched = BatchEngine(tiny_target, random_drafter(tiny_target, name), max_batch_size=4).generate(
        requests(tiny_target))
    drafter = without(random_drafter(tiny_target, name), Capability.BATCHED_PROPOSE)
    forbid(monkeypatch, drafter, "propose_many")
    results = BatchEngine(tiny_target, drafter, max_batch_size=4).generate(requests(tiny_target))
    assert [r.tokens for r in results] == greedy_refs
    assert [r.accepted for r in results] == [r.accepted for r in batched]


def test_without_batched_consume_rows_consume_one_by_one(tiny_target, greedy_refs, monkeypatch):
    """``consume_many`` undeclared: admission and acceptance consume per row, losslessly, and
    the drafter's states (so its drafts and their acceptance) are those of the batched path."""
    batched = BatchEngine(tiny_target, random_drafter(tiny_target, "dspark"), max_batch_size=4).generate(
        requests(tiny_target))
    drafter = without(random_drafter(tiny_target, "dspark"), Capability.BATCHED_CONSUME)
    forbid(monkeypatch, drafter, "consume_many")
    results = BatchEngine(tiny_target, drafter, max_batch_size=4).generate(requests(tiny_target))
    assert [r.tokens for r in results] == greedy_refs
    assert [r.accepted for r in results] == [r.accepted for r in batched]


def test_batched_paths_are_taken_when_declared(tiny_target, monkeypatch):
    """The fast paths are really used by a drafter that declares them (one call for many rows)."""
    drafter = random_drafter(tiny_target, "dspark")
    calls = {"propose_many": 0, "consume_many": 0}
    for method in calls:
        original = getattr(drafter, method)

        def counted(*args, _original=original, _method=method, **kwargs):
            calls[_method] += 1
            return _original(*args, **kwargs)
        monkeypatch.setattr(drafter, method, counted)
    BatchEngine(tiny_target, drafter, max_batch_size=4).generate(requests(tiny_target))
    assert calls["propose_many"] > 0 and calls["consume_many"] > 0


def test_a_drafter_not_declaring_target_kv_is_never_handed_it(tiny_target, references, greedy_refs, monkeypatch):
    """``with_target_kv`` undeclared (and booby-trapped), in every engine path that drafts (chain,
    tree, batched and per-row batch proposals, the hybrid over it): never called, output unchanged."""
    from components.engine import HybridDrafter, SuffixDrafter
    from tests.components.engine.doubles import TargetKVReader

    def reader(**kw) -> TargetKVReader:
        made = without(TargetKVReader(tiny_target, **kw), Capability.TARGET_KV)
        forbid(monkeypatch, made, "with_target_kv")
        return made

    prompt = prompts(tiny_target)[0]
    assert SpeculativeEngine(tiny_target, reader()).generate(prompt, MAX_NEW).tokens == references[0]
    assert TreeEngine(tiny_target, reader(pad=True), budget=8).generate(prompt, MAX_NEW).tokens == references[0]
    for batched in (True, False):
        results = BatchEngine(tiny_target, reader(batched=batched), max_batch_size=2).generate(requests(tiny_target))
        assert [r.tokens for r in results] == greedy_refs
    hybrid = HybridDrafter(reader(batched=True), SuffixDrafter(tiny_target.vocab_size, 4), 1.0)
    assert Capability.TARGET_KV not in hybrid.capabilities()
    forbid(monkeypatch, hybrid, "with_target_kv")
    results = BatchEngine(tiny_target, hybrid, max_batch_size=2).generate(requests(tiny_target))
    assert [r.tokens for r in results] == greedy_refs


def test_model_free_drafters_declare_no_capabilities(tiny_target):
    for drafter in (OracleDrafter([1, 2], tiny_target.vocab_size, 2),
                    PromptLookupDrafter(tiny_target.vocab_size, 2), TargetDrafter(tiny_target, 2)):
        assert drafter.capabilities() == frozenset()


def test_the_engine_probes_no_drafter_attribute():
    probes = re.compile(r"hasattr\(.*drafter|isinstance\(.*Drafter\)|getattr\(\s*(self\.)?drafter")
    found = [f"{path.relative_to(ENGINE_SOURCES)}:{i}: {line.strip()}"
             for path in sorted(ENGINE_SOURCES.rglob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1) if probes.search(line)]
    assert not found, found
