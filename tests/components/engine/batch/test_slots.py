"""The batch engine on the fast step's static slab (``target.batch_cache == "slots"``:
``cache.slots.SlotCache``): lossless like the ragged path — greedy outputs equal the target's own
(float32; a flip only at a near-tie the eval's rule names), sampled ones the batch-1 engine's on
the same target with the same seed — and every slab row handed back when requests end or are
cancelled. Through the kernel where this CPU runs it, else the decoder's torch reference."""

from __future__ import annotations

import pytest
import torch

from components.engine import PromptLookupDrafter, SuffixDrafter
from components.engine.batch import BatchEngine
from components.engine.cache.slots import SlotCache, SlotPool, SlotsExhausted
from components.target.fast import KernelGemm, StepTarget
from components.target.kernels import RowsGemm, why_unavailable
from tests.components.engine.batch.test_continuous import requests, sampled_alone_and_batched
from tests.components.engine.test_engine_carryover import carry_drafter
from tests.components.engine.test_engine_greedy import random_drafter
from tests.components.target.test_step import _same_or_near_tie


@pytest.fixture(scope="module")
def slot_target(tiny_target, tmp_path_factory) -> StepTarget:
    taps = tuple(range(tiny_target.num_layers))
    if why_unavailable() is None:
        kernel = RowsGemm.build(tmp_path_factory.mktemp("kernels"))
        return StepTarget(tiny_target, taps, 256, KernelGemm(kernel), kernel)
    return StepTarget(tiny_target, taps, 256)


def _drafter(target, kind: str):
    if kind == "plain":
        return None
    if kind == "prompt_lookup":
        return PromptLookupDrafter(target.vocab_size, 4)
    if kind == "suffix":
        return SuffixDrafter(target.vocab_size, 8)
    return random_drafter(target, kind)


def _lossless(tiny_target, reqs, results, greedy_refs) -> None:
    for req, res, ref in zip(reqs, results, greedy_refs):
        _same_or_near_tie(tiny_target, list(req.prompt_ids), res.tokens, ref)


@pytest.mark.parametrize("kind", ["plain", "dspark", "eagle3", "prompt_lookup", "suffix"])
@pytest.mark.parametrize("max_batch", [2, 16])
def test_greedy_equals_the_target_and_frees_every_row(tiny_target, slot_target, greedy_refs, kind, max_batch):
    engine = BatchEngine(slot_target, _drafter(tiny_target, kind), max_batch_size=max_batch)
    assert engine.pool is not None and engine.pool.rows == max_batch
    reqs = requests(tiny_target)
    results = engine.generate(reqs)
    _lossless(tiny_target, reqs, results, greedy_refs)
    assert not engine.has_work and engine.batch.cache is None
    assert sorted(engine.pool.free) == list(range(max_batch))  # every row handed back


def test_dloop_and_carryover_on_slots_are_lossless(tiny_target, slot_target, greedy_refs):
    drafter = carry_drafter(tiny_target, "dspark", carryover=True)
    engine = BatchEngine(slot_target, drafter, loop_stages=2, loop_gate=float("-inf"), carryover=True,
                         max_batch_size=4)
    reqs = requests(tiny_target)
    _lossless(tiny_target, reqs, engine.generate(reqs), greedy_refs)


@pytest.mark.parametrize("rule", ["speculative", "gumbel"])
def test_sampling_matches_the_single_request_engine_on_the_same_target(slot_target, rule):
    expected, got = sampled_alone_and_batched(slot_target, rule)
    assert got == expected


def test_cancel_hands_the_row_back_and_others_continue(tiny_target, slot_target, greedy_refs):
    engine = BatchEngine(slot_target, random_drafter(tiny_target, "dspark"), max_batch_size=8)
    reqs = requests(tiny_target)
    for r in reqs:
        engine.add(r)
    done = {}
    for _ in range(2):
        done.update({o.request_id: o.result.tokens for o in engine.step() if o.finished and o.result})
    victim = reqs[2].request_id
    engine.cancel(victim)
    engine.step()
    assert victim not in engine.running
    assert len(engine.pool.free) == engine.pool.rows - len(engine.running)
    while engine.has_work:
        done.update({o.request_id: o.result.tokens for o in engine.step() if o.finished and o.result})
    for r, ref in zip(reqs, greedy_refs):
        if r.request_id != victim:
            _same_or_near_tie(tiny_target, list(r.prompt_ids), done[r.request_id], ref)
    assert len(engine.pool.free) == engine.pool.rows


def test_slot_cache_bookkeeping():
    k = [torch.zeros(3, 1, 8, 2)]
    pool = SlotPool(k, [x.clone() for x in k])
    a = SlotCache(pool, [pool.acquire()], [4])
    b = SlotCache(pool, [pool.acquire(), pool.acquire()], [2, 5])
    with pytest.raises(SlotsExhausted, match="3 rows"):
        pool.acquire()
    a.concat(b)
    assert a.rows == [0, 1, 2] and a.lengths == [4, 2, 5] and b.rows == []
    a.commit(torch.tensor([[True, True, False], [True, False, False], [False, False, False]]))
    assert a.lengths == [6, 3, 5] and a.length == 6 and a.attention_mask(3) is None
    a.select([2, 0])
    assert a.rows == [2, 0] and a.lengths == [5, 6] and pool.free == [1]


def test_a_rounds_padding_is_left_out_of_the_pass_and_the_real_tokens_agree(tiny_target, slot_target):
    """Rows with fewer new tokens than the pass's width go through the kernel as ragged rows: the
    real positions' logits and taps are those of the padded pass, the padding's are zeros."""
    prompts = [tiny_target.tokenizer.encode(t)[:n] for t, n in (("def f(x): return x", 5), ("import os\nimport re", 7))]
    outs = {}
    for ragged in (False, True):
        pool = slot_target.slot_pool(2)
        cache = SlotCache(pool, [], [])
        for ids in prompts:
            cache.concat(slot_target.prefill_slot(pool, torch.tensor([ids])).cache)
        new = torch.tensor([[11, 12, 13, 14], [21, 22, 0, 0]])  # row 1: two real tokens, two padding
        assert cache.attention_mask(4, [4, 2] if ragged else None) is None
        outs[ragged] = slot_target.forward(new, layer_ids=[0], cache=cache, use_cache=True)
    padded, ragged = outs[False], outs[True]
    real = torch.tensor([[True] * 4, [True, True, False, False]])
    assert torch.allclose(padded.logits[real], ragged.logits[real], atol=1e-4)
    assert torch.allclose(padded.hidden[real], ragged.hidden[real], atol=1e-4)
    assert not ragged.logits[~real].any()
