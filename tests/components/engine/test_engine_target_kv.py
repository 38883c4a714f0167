"""Every engine hands a drafter declaring ``Capability.TARGET_KV`` views of the target's own K/V
before it drafts, and what it hands is exactly the committed context at that moment: n-1
positions (a batch's padding and rejected drafts masked out), equal to the target's own forward
over the committed tokens. Batch-1 chains (HF cache, preallocated or not; the fast step's
static cache), token trees, the batch engine (ragged cache and slot slab; batched and per-row
proposals; rows joining mid-run; a lone row's tree rounds) and the hybrid, greedy output
unchanged. The drafter is a stand-in (``doubles.TargetKVReader``: prompt lookup that checks
what it reads) until the H-Spec drafter exists."""

from __future__ import annotations

import pytest

from components.drafters.capabilities import Capability
from components.engine import BatchEngine, HybridDrafter, SpeculativeEngine, TreeEngine
from components.engine.hybrid import MODEL, SUFFIX
from components.target.fast import StepTarget
from tests.components.engine.batch.test_continuous import requests
from tests.components.engine.doubles import TargetKVReader
from tests.components.engine.test_engine_greedy import MAX_NEW, prompts
from tests.components.engine.test_hybrid import ScriptedSuffix, full

TOLERANCE = 1e-4  # the views against a fresh forward over the same tokens (float32; the fast step's own ops)


@pytest.fixture(scope="module")
def step_target(tiny_target) -> StepTarget:
    """The fast step over the fixture target (the decoder's torch reference: no kernel build)."""
    return StepTarget(tiny_target, (0,), 256)  # the reader's tap


def _read_right(reader: TargetKVReader, holes: bool = False) -> None:
    """Every propose read the committed context (checked there), handed once per drafting round."""
    assert reader.checked and max(reader.errors) < TOLERANCE
    if holes:  # a batch's padding or rejected drafts were masked out, not just absent
        assert any(h > 0 for _, h in reader.checked)


@pytest.mark.parametrize("preallocate", [True, False])
def test_the_chain_engine_hands_the_committed_context(tiny_target, references, preallocate):
    reader = TargetKVReader(tiny_target)
    engine = SpeculativeEngine(tiny_target, reader, preallocate=preallocate)
    for prompt, ref in zip(prompts(tiny_target), references):
        assert engine.generate(prompt, MAX_NEW).tokens == ref
    _read_right(reader)
    assert reader.attached == len(reader.checked)


def test_the_chain_engine_on_the_fast_step_hands_its_static_cache(tiny_target, step_target, references):
    reader = TargetKVReader(tiny_target)
    engine = SpeculativeEngine(step_target, reader)
    for prompt, ref in zip(prompts(tiny_target), references):
        assert engine.generate(prompt, MAX_NEW).tokens == ref
    _read_right(reader)


def test_the_tree_engine_hands_the_committed_context(tiny_target, references):
    reader = TargetKVReader(tiny_target, pad=True)
    engine = TreeEngine(tiny_target, reader, budget=8)
    for prompt, ref in zip(prompts(tiny_target), references):
        assert engine.generate(prompt, MAX_NEW).tokens == ref
    _read_right(reader)
    assert reader.attached == len(reader.checked)


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("preallocate", [True, False])
def test_the_batch_engine_hands_each_row_its_row(tiny_target, greedy_refs, batched, preallocate):
    """Two rows at a time out of six requests: rows join while others run (their prompts are in
    the ragged cache before anyone drafts), padding and rejected drafts are holes, and rounds
    in which a row proposed nothing are consumed before the views are handed (``flush``)."""
    reader = TargetKVReader(tiny_target, batched=batched, quiet=True)
    engine = BatchEngine(tiny_target, reader, max_batch_size=2, preallocate=preallocate)
    results = engine.generate(requests(tiny_target))
    assert [r.tokens for r in results] == greedy_refs
    assert any(0 < len(r.accepted) < r.rounds for r in results)  # plain rounds between drafting ones
    _read_right(reader, holes=True)
    assert reader.attached == len(reader.checked)


def test_the_batch_engines_lone_row_tree_rounds_hand_the_compacted_cache(tiny_target, greedy_refs, monkeypatch):
    reader = TargetKVReader(tiny_target, pad=True)
    engine = BatchEngine(tiny_target, reader, max_batch_size=4, tree_budget=8)
    trees, played = engine.trees.round, []
    monkeypatch.setattr(engine.trees, "round", lambda batch, row: played.append(len(reader.checked)) or trees(batch, row))
    assert [r.tokens for r in engine.generate(requests(tiny_target))] == greedy_refs
    assert played and played[-1] < len(reader.checked)  # tree rounds were played, and read the views
    _read_right(reader, holes=True)


def test_the_batch_engine_on_slots_hands_each_row_its_slab_row(tiny_target, step_target, greedy_refs):
    reader = TargetKVReader(tiny_target, batched=True)
    engine = BatchEngine(step_target, reader, max_batch_size=2)
    assert engine.pool is not None
    assert [r.tokens for r in engine.generate(requests(tiny_target))] == greedy_refs
    _read_right(reader)


def test_the_hybrid_hands_the_views_to_its_trained_side(tiny_target, references, greedy_refs):
    """Declared when the trained drafter declares it; the views reach the trained side's state in
    either engine, and model rounds read them (suffix rounds do not)."""
    reader = TargetKVReader(tiny_target, batched=True)
    draft = HybridDrafter(reader, ScriptedSuffix(full(prompts(tiny_target), references), tiny_target.vocab_size, 8), 0.0)
    assert Capability.TARGET_KV in draft.capabilities() and draft.target_kv_layers == reader.target_kv_layers
    engine = SpeculativeEngine(tiny_target, draft)
    for prompt, ref in zip(prompts(tiny_target), references):
        assert engine.generate(prompt, MAX_NEW).tokens == ref
    reqs = requests(tiny_target)
    draft = HybridDrafter(reader, ScriptedSuffix(full([r.prompt_ids for r in reqs], greedy_refs),
                                                 tiny_target.vocab_size, 8), 0.0)
    assert [r.tokens for r in BatchEngine(tiny_target, draft, max_batch_size=2).generate(reqs)] == greedy_refs
    assert draft.drafted_by[SUFFIX] > 0 and draft.drafted_by[MODEL] > 0
    _read_right(reader, holes=True)
    assert reader.attached > len(reader.checked)  # handed every round, read on model rounds


@pytest.mark.parametrize("engine", ["chain", "batch"])
def test_the_engine_proposes_from_the_state_it_keeps(tiny_target, references, greedy_refs, monkeypatch, engine):
    """The state handed the views is the one the engine keeps and consumes: a wrapper that marks
    the state a failed ``propose`` came from (``serving.fallback``) turns that request plain for
    good after one failure, instead of failing again every round."""
    from components.serving.fallback import GuardedDrafter

    reader = TargetKVReader(tiny_target)

    def broken(*args, **kwargs):
        raise RuntimeError("drafter broke")
    monkeypatch.setattr(reader, "propose", broken)
    guarded = GuardedDrafter(reader, tiny_target.vocab_size)
    if engine == "chain":
        out = SpeculativeEngine(tiny_target, guarded).generate(prompts(tiny_target)[0], MAX_NEW)
        assert out.tokens == references[0] and out.rounds > 1
        expected = 1
    else:
        reqs = requests(tiny_target)
        results = BatchEngine(tiny_target, guarded, max_batch_size=2).generate(reqs)
        assert [r.tokens for r in results] == greedy_refs
        expected = sum(r.rounds > 0 for r in results)  # one failure per request that had a round
    assert guarded.failures == expected and reader.attached == expected
