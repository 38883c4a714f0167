"""The preallocated KV cache holds exactly what HF's ``DynamicLayer`` would, grows in place
within its headroom, takes over tensors set from outside, and leaves every engine's output
unchanged (greedy, token for token)."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from components.engine import SpeculativeEngine, target_only_generate
from components.engine.batch import BatchEngine
from components.engine.cache.ragged import RaggedCache
from components.engine.cache.slab import MIN_HEADROOM, SlabLayer, preallocate
from components.engine.tree import TreeEngine
from tests.components.engine.batch.test_continuous import batch_prompts, requests
from tests.components.engine.test_engine_greedy import random_drafter


def _kv(b: int, t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:  # [b, 2, t, 8] each
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 2, t, 8, generator=g), torch.randn(b, 2, t, 8, generator=g)


def test_slab_layer_appends_in_place_and_equals_dynamic_layer():
    slab, plain = SlabLayer(), DynamicLayer()
    for i, (t, crop) in enumerate([(5, 0), (3, -2), (1, 0), (4, -1), (2, 0)]):
        k, v = _kv(3, t, i)
        got, ref = slab.update(k, v), plain.update(k, v)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
        if i == 0:
            buffer, capacity = slab._k, slab.capacity
        slab.crop(crop)
        plain.crop(crop)
    assert slab._k is buffer and slab.capacity == capacity == 5 + MIN_HEADROOM  # never reallocated
    assert slab.keys._base is buffer and torch.equal(slab.keys, plain.keys) and torch.equal(slab.values, plain.values)


def test_slab_layer_takes_over_tensors_set_from_outside():
    slab = SlabLayer()
    slab.update(*_kv(3, 6, 0))
    slab.keys, slab.values = slab.keys[[2, 0]], slab.values[[2, 0]]  # a row select: a fresh tensor
    expected = [torch.cat([x, y], dim=2) for x, y in zip((slab.keys, slab.values), _kv(2, 2, 1))]
    got = slab.update(*_kv(2, 2, 1))
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert slab.keys._base is slab._k and slab._k.shape[0] == 3  # the buffer keeps its 3 rows
    slab.keys, slab.values = slab.keys[:, :, 3:], slab.values[:, :, 3:]  # a leading trim: still a view
    buffer = slab._k
    slab.update(*_kv(2, 1, 2))
    assert slab._k is buffer and slab.get_seq_length() == 6


def test_rows_leave_and_join_inside_the_buffer():
    """``keep_rows`` and ``add_rows`` equal indexing and a right-aligned concat, without a new
    buffer while rows and the left margin have room."""
    slab = SlabLayer()
    k0, v0 = _kv(4, 6, 0)
    slab.update(k0, v0)
    buffer = slab._k
    slab.keep_rows([0, 2, 3])
    assert torch.equal(slab.keys, k0[[0, 2, 3]]) and torch.equal(slab.values, v0[[0, 2, 3]])
    slab.keys, slab.values = slab.keys[:, :, 2:], slab.values[:, :, 2:]  # a leading trim: 2 free slots left
    short, long = _kv(1, 3, 1), _kv(1, 6, 2)
    slab.add_rows(*short)  # narrower than the batch: right-aligned
    assert torch.equal(slab.keys[3:, :, 1:], short[0]) and torch.equal(slab.values[3:, :, 1:], short[1])
    slab.keep_rows([0, 1, 3])
    slab.add_rows(*long)  # wider by 2: the view takes in the 2 free slots on the left
    assert slab._k is buffer and slab.keys._base is buffer and slab.keys.shape == (4, 2, 6, 8)
    assert torch.equal(slab.keys[:2, :, 2:], k0[[0, 2], :, 2:]) and torch.equal(slab.keys[2:3, :, 3:], short[0])
    assert torch.equal(slab.keys[3:], long[0]) and torch.equal(slab.values[3:], long[1])
    assert bool(torch.isfinite(slab.keys).all())  # slots taken in on the left are finite (masked later)
    before = slab.keys.clone()
    slab.add_rows(*_kv(1, 2, 3))  # a fifth row: the buffer grows
    assert slab._k is not buffer and slab.keys.shape[0] == 5 and torch.equal(slab.keys[:4], before)


def test_slab_layer_reallocates_when_full():
    slab = SlabLayer()
    slab.update(*_kv(1, 10, 0))
    first = slab._k
    for i in range(MIN_HEADROOM):
        slab.update(*_kv(1, 1, i + 1))
    assert slab._k is first
    keys_before = slab.keys.clone()
    slab.update(*_kv(1, 1, 99))
    assert slab._k is not first and slab.capacity > 10 + MIN_HEADROOM + 1
    assert torch.equal(slab.keys[:, :, :-1], keys_before)


def test_ragged_batch_sees_the_same_logits_with_a_preallocated_cache(tiny_target):
    """Admission, rounds with rejected slots, compaction and a row leaving: the next-token logits
    of every row are identical whether the cache grows by cat or in its buffer."""
    prompts = batch_prompts(tiny_target)[:4]

    def run(prealloc: bool) -> list[torch.Tensor]:
        ragged, logits = None, []
        for p in prompts:
            cache = tiny_target.forward(torch.tensor([p]), use_cache=True).cache
            part = RaggedCache.single(preallocate(cache) if prealloc else cache)
            ragged = part if ragged is None else (ragged.concat(part) or ragged)
        for rnd, width in enumerate([1, 4, 3, 1, 5, 2]):
            lens = ragged.valid.sum(dim=1)
            ids = (torch.arange(ragged.batch_size * width).reshape(-1, width) * 7 + rnd) % 500 + 5
            out = tiny_target.forward(ids, attention_mask=ragged.attention_mask(width), cache=ragged.cache,
                                      use_cache=True, position_ids=lens[:, None] + torch.arange(width))
            logits.append(out.logits)
            keep = torch.arange(width)[None, :] <= (torch.arange(ragged.batch_size)[:, None] + rnd) % width
            ragged.commit(keep)
            if rnd == 2:
                ragged.compact()
            if rnd == 3:
                ragged.select([0, 2, 3])
            if rnd == 4:  # a request joins, inside the buffer's free row
                cache = tiny_target.forward(torch.tensor([prompts[1][:5]]), use_cache=True).cache
                ragged.concat(RaggedCache.single(preallocate(cache) if prealloc else cache))
        return logits

    for a, b in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_engines_are_lossless_with_and_without_preallocation(tiny_target):
    reqs = requests(tiny_target)
    refs = [target_only_generate(tiny_target, r.prompt_ids, r.max_new_tokens, preallocate_cache=False).tokens
            for r in reqs]
    assert [target_only_generate(tiny_target, r.prompt_ids, r.max_new_tokens).tokens for r in reqs] == refs
    drafter = random_drafter(tiny_target, "dspark")
    for prealloc in (True, False):
        got = BatchEngine(tiny_target, drafter, max_batch_size=3, preallocate=prealloc).generate(requests(tiny_target))
        assert [r.tokens for r in got] == refs
        single = SpeculativeEngine(tiny_target, drafter, preallocate=prealloc)
        tree = TreeEngine(tiny_target, drafter, preallocate=prealloc)
        for eng in (single, tree):
            assert [eng.generate(r.prompt_ids, r.max_new_tokens).tokens for r in reqs[:3]] == refs[:3]
