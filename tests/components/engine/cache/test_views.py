"""In-place views of the target's K/V (``cache.views.target_kv``): for every kind of cache the
engines keep, the view is what the cache holds over the committed context (a ragged batch: its
valid slots, masked right; compared with each row's own batch-1 forward too), it shares the
cache's storage (a write into the cache shows through), and other caches or layer types are
refused by name."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

from components.drafters import TargetKV
from components.engine.cache import RaggedCache, SlotCache, preallocate, target_kv
from components.engine.core import crop_cache
from components.target.fast import StepTarget
from components.target.step import StaticCache
from tests.components.engine.batch.test_continuous import batch_prompts


@pytest.fixture(scope="module")
def step_target(tiny_target) -> StepTarget:
    """The fast step over the fixture target (the decoder's torch reference: no kernel build)."""
    return StepTarget(tiny_target, (), 128)


def _layers(target) -> list[int]:
    return [0, target.num_layers - 1]


def _own_keys(target, tokens: list[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:  # [1, h_kv, S, d] each
    """A batch-1 forward's keys/values of ``layer`` over ``tokens``: the committed K/V to expect."""
    cache = target.forward(torch.tensor([tokens]), use_cache=True).cache
    return cache.layers[layer].keys, cache.layers[layer].values


def _shares(view: torch.Tensor, held: torch.Tensor) -> bool:
    return view.untyped_storage().data_ptr() == held.untyped_storage().data_ptr()


@pytest.mark.parametrize("slab", [False, True])
def test_an_hf_cache_is_read_whole_and_in_place(tiny_target, slab):
    prompt = batch_prompts(tiny_target)[0]
    cache = tiny_target.forward(torch.tensor([prompt]), use_cache=True).cache
    if slab:
        tiny_target.forward(torch.tensor([[5, 6, 7]]), cache=preallocate(cache), use_cache=True)  # into the buffer
        crop_cache(cache, len(prompt))  # the drafts rejected: the engines crop to the committed slots
    layers = _layers(tiny_target)
    kv = target_kv(cache, layers)
    assert isinstance(kv, TargetKV) and kv.layers == layers and kv.valid is None and kv.slots == len(prompt)
    for i, (k, v) in zip(layers, kv.kv):
        held = cache.layers[i]
        assert torch.equal(k, held.keys) and torch.equal(v, held.values)  # [1, h_kv, S, d]
        assert _shares(k, held.keys) and _shares(v, held.values)
        own_k, own_v = _own_keys(tiny_target, prompt, i)
        torch.testing.assert_close(k, own_k, atol=1e-5, rtol=1e-5)  # keys as attention reads them (RoPE'd)
        torch.testing.assert_close(v, own_v, atol=1e-5, rtol=1e-5)
        held.keys[0, 0, -1, 0] = 123.0
        assert k[0, 0, -1, 0] == 123.0  # a view, not a copy
    assert target_kv(cache, layers, row=0).kv[0][0].shape == kv.kv[0][0].shape


def test_a_static_cache_is_read_up_to_its_length(tiny_target, step_target):
    prompt = batch_prompts(tiny_target)[1]
    out = step_target.forward(torch.tensor([prompt + [5, 6]]), use_cache=True)
    cache = out.cache
    assert isinstance(cache, StaticCache)
    crop_cache(cache, len(prompt))  # two rejected drafts: still in the slab, past ``length``
    layers = _layers(tiny_target)
    kv = target_kv(cache, layers)
    assert kv.valid is None and kv.slots == len(prompt)
    for i, (k, v) in zip(layers, kv.kv):
        assert torch.equal(k, cache.k[i][:, :, :len(prompt)]) and torch.equal(v, cache.v[i][:, :, :len(prompt)])
        assert _shares(k, cache.k[i]) and _shares(v, cache.v[i])
        own_k, own_v = _own_keys(tiny_target, prompt, i)
        torch.testing.assert_close(k, own_k, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v, own_v, atol=1e-4, rtol=1e-4)
        cache.v[i][0, 0, 0, 0] = -7.0
        assert v[0, 0, 0, 0] == -7.0


def _ragged(target, prompts: list[list[int]], slab: bool) -> tuple[RaggedCache, list[list[int]]]:
    """Rows of different lengths (left padding), after a round whose drafts were partly rejected
    (holes) → the cache and each row's committed tokens."""
    ragged = None
    for p in prompts:
        out = target.forward(torch.tensor([p]), use_cache=True)
        part = RaggedCache.single(preallocate(out.cache) if slab else out.cache)
        ragged = part if ragged is None else (ragged.concat(part) or ragged)
    new = torch.tensor([[11, 12, 13], [21, 22, 23], [31, 32, 33]])[:len(prompts)]  # [B, 3]: x_{n-1}, two drafts
    lens = ragged.valid.sum(dim=1)
    target.forward(new, attention_mask=ragged.attention_mask(3), cache=ragged.cache, use_cache=True,
                   position_ids=lens[:, None] + torch.arange(3)[None, :])
    kept = [1, 3, 2][:len(prompts)]  # row 0 rejects both drafts, row 1 accepts both, row 2 one
    ragged.commit(torch.arange(3)[None, :] < torch.tensor(kept)[:, None])
    return ragged, [p + new[b, :kept[b]].tolist() for b, p in enumerate(prompts)]


@pytest.mark.parametrize("slab", [False, True])
def test_a_ragged_row_is_its_valid_slots_with_the_holes_masked(tiny_target, slab):
    prompts = batch_prompts(tiny_target)[:3]
    cache, committed = _ragged(tiny_target, prompts, slab)
    assert not bool(cache.valid.all())  # padding and a rejected draft
    layers = _layers(tiny_target)
    whole = target_kv(cache, layers)
    assert whole.valid is not None and torch.equal(whole.valid, cache.valid)  # [B, L]
    for b, tokens in enumerate(committed):
        kv = target_kv(cache, layers, row=b)
        assert torch.equal(kv.valid, cache.valid[b:b + 1]) and int(kv.valid.sum()) == len(tokens)
        for i, (k, v) in zip(layers, kv.kv):
            held = cache.cache.layers[i]
            assert k.shape == (1, *held.keys.shape[1:])  # [1, h_kv, L, d]: every slot, holes included
            assert torch.equal(k, held.keys[b:b + 1]) and torch.equal(v, held.values[b:b + 1])
            assert _shares(k, held.keys) and _shares(v, held.values)
            own_k, own_v = _own_keys(tiny_target, tokens, i)
            torch.testing.assert_close(k[:, :, kv.valid[0]], own_k, atol=1e-5, rtol=1e-5)  # in position order
            torch.testing.assert_close(v[:, :, kv.valid[0]], own_v, atol=1e-5, rtol=1e-5)
            last = int(torch.nonzero(kv.valid[0])[-1])
            held.keys[b, 0, last, 0] = 99.0
            assert k[0, 0, last, 0] == 99.0


def test_a_slot_row_is_its_committed_slots_of_its_slab_row(tiny_target, step_target):
    prompts = [batch_prompts(tiny_target)[i] for i in (2, 0)]
    pool = step_target.slot_pool(3)
    pool.acquire()  # slab row 0 taken by someone else: the batch's rows are slab rows 1 and 2
    cache = SlotCache(pool, [], [])
    for p in prompts:
        cache.concat(step_target.prefill_slot(pool, torch.tensor([p])).cache)
    assert cache.rows == [1, 2]
    new = torch.tensor([[11, 12, 13], [21, 22, 23]])
    cache.attention_mask(3, [3, 3])
    step_target.forward(new, cache=cache, use_cache=True)
    kept = [1, 3]
    cache.commit(torch.arange(3)[None, :] < torch.tensor(kept)[:, None])
    layers = _layers(tiny_target)
    for b, p in enumerate(prompts):
        tokens = p + new[b, :kept[b]].tolist()
        kv = target_kv(cache, layers, row=b)
        assert kv.valid is None and kv.slots == len(tokens) == cache.lengths[b]
        for i, (k, v) in zip(layers, kv.kv):
            r = cache.rows[b]
            assert torch.equal(k, pool.k[i][r:r + 1, :, :len(tokens)]) and torch.equal(v, pool.v[i][r:r + 1, :, :len(tokens)])
            assert _shares(k, pool.k[i]) and _shares(v, pool.v[i])
            own_k, own_v = _own_keys(tiny_target, tokens, i)
            torch.testing.assert_close(k, own_k, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(v, own_v, atol=1e-4, rtol=1e-4)
            pool.k[i][r, 0, 0, 0] = 42.0
            assert k[0, 0, 0, 0] == 42.0
    with pytest.raises(ValueError, match="ask for one row at a time"):
        target_kv(cache, layers)
    cache.select([1])
    assert target_kv(cache, layers).slots == cache.lengths[0]  # a lone row needs no ``row``


def test_what_cannot_be_viewed_is_refused_by_name(tiny_target):
    prompt = batch_prompts(tiny_target)[0]
    cache = tiny_target.forward(torch.tensor([prompt]), use_cache=True).cache
    with pytest.raises(TypeError, match=r"no in-place view of a builtins\.dict"):
        target_kv({}, [0])
    with pytest.raises(ValueError, match=rf"layers \[{tiny_target.num_layers}\] are not among"):
        target_kv(cache, [0, tiny_target.num_layers])
    with pytest.raises(IndexError, match="row 1 of a cache of 1 rows"):
        target_kv(cache, [0], row=1)
    window = DynamicCache()
    window.layers = [DynamicSlidingWindowLayer(sliding_window=4)]
    with pytest.raises(TypeError, match="DynamicSlidingWindowLayer, whose keys are not every committed position"):
        target_kv(window, [0])
    assert target_kv(cache, []).kv == []
