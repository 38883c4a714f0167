"""Prompt prefixes kept across requests (``cache.prefix.PrefixStore``): blocks keyed by their whole
prefix, least recently used out first (a prefix's deeper blocks before its first); a prompt
prefilled after a kept prefix gets the bits of its whole pass (logits and slab row), so the batch
engine's output is the same with the store as without it."""

from __future__ import annotations

import pytest
import torch

from components.engine import SuffixDrafter
from components.engine.batch import BatchEngine, Request
from components.engine.cache.prefix import BLOCK, PrefixStore
from components.target.fast import KernelGemm, StepTarget
from components.target.kernels import rows_gemm, why_unavailable

LAYERS, HEADS, SLOTS, DIM = 2, 2, 128, 4


def _slab(rows: int = 2) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return ([torch.zeros(rows, HEADS, SLOTS, DIM) for _ in range(LAYERS)],
            [torch.zeros(rows, HEADS, SLOTS, DIM) for _ in range(LAYERS)])


def _fill(k: list[torch.Tensor], v: list[torch.Tensor], row: int, ids: list[int]) -> None:
    """Slot s of the row as a function of the prompt's tokens up to s (what a prefill writes)."""
    for i in range(LAYERS):
        for s in range(len(ids)):
            k[i][row, :, s] = sum(ids[:s + 1]) + i
            v[i][row, :, s] = -(sum(ids[:s + 1]) + i)


def test_a_kept_prefix_is_copied_and_only_its_own_prefix_matches():
    store, (k, v) = PrefixStore(4 * BLOCK), _slab()
    first = list(range(1, 2 * BLOCK + 5))  # two full blocks and a partial one
    _fill(k, v, 0, first)
    store.keep(first, k, v, 0)
    assert store.tokens == 2 * BLOCK
    again = first[:2 * BLOCK] + [99] * 9
    assert store.load(again, k, v, 1, len(again) - 8) == 2 * BLOCK
    assert all(torch.equal(x[1, :, :2 * BLOCK], x[0, :, :2 * BLOCK]) for x in (*k, *v))
    assert store.load(again, k, v, 1, 2 * BLOCK - 1) == BLOCK  # a limit short of the second block
    other_start = [7] + first[1:]  # the same second block after another first one: no match at all
    assert store.load(other_start, k, v, 1, len(other_start)) == 0
    assert store.hits == 3 * BLOCK


def test_the_least_recently_used_blocks_leave_first_and_a_prefixs_first_block_last():
    store, (k, v) = PrefixStore(2 * BLOCK), _slab()
    a, b, c = list(range(1, 2 * BLOCK + 1)), list(range(500, 500 + BLOCK)), list(range(900, 900 + BLOCK))
    for ids in (a, b):
        _fill(k, v, 0, ids)
        store.keep(ids, k, v, 0)  # b: the store is full, a's second block leaves, not its first
    assert store.tokens == 2 * BLOCK
    assert store.load(a + [1] * 8, k, v, 1, 2 * BLOCK) == BLOCK
    assert store.load(b, k, v, 1, BLOCK) == BLOCK  # b is now the most recent, a's block the least
    _fill(k, v, 0, c)
    store.keep(c, k, v, 0)
    assert store.load(a, k, v, 1, BLOCK) == 0 and store.load(b, k, v, 1, BLOCK) == BLOCK
    assert store.load(c, k, v, 1, BLOCK) == BLOCK and torch.equal(k[0][1, :, :BLOCK], k[0][0, :, :BLOCK])
    store.clear()
    assert store.tokens == 0 and store.load(c, k, v, 1, BLOCK) == 0


@pytest.fixture(scope="module")
def slot_target(tiny_target, tmp_path_factory) -> StepTarget:
    if why_unavailable() is not None:
        pytest.skip(f"kernel: {why_unavailable()}")
    kernel = rows_gemm(tmp_path_factory.mktemp("kernels"))  # built once per process
    if kernel.same_bits_rows is None:
        pytest.skip(f"the {kernel.isa} build declares no row count past which a pass's bits are its rows' own")
    return StepTarget(tiny_target, (), 256, KernelGemm(kernel), kernel)


def _prompts(vocab: int) -> list[list[int]]:
    shared = [(7 * i + 3) % vocab for i in range(2 * BLOCK + 3)]
    return [shared + [(11 * i + j) % vocab for i in range(tail)] for j, tail in enumerate((9, 14, 30, 5))]


def test_a_prefill_after_a_kept_prefix_has_the_bits_of_the_whole_pass(tiny_target, slot_target):
    store, pool = PrefixStore(8 * BLOCK), slot_target.slot_pool(3)
    first, *others = _prompts(tiny_target.vocab_size)
    slot_target.prefill_slot(pool, torch.tensor([first]), (), store)
    for prompt in [*others, others[0]]:  # the last one again: 3 blocks kept, of which 2 leave a long enough tail
        hits = store.hits
        got = slot_target.prefill_slot(pool, torch.tensor([prompt]), (), store)
        want = slot_target.prefill_slot(pool, torch.tensor([prompt]))
        assert torch.equal(got.logits, want.logits)
        a, b = got.cache.rows[0], want.cache.rows[0]
        assert all(torch.equal(x[a, :, :len(prompt)], x[b, :, :len(prompt)]) for x in (*pool.k, *pool.v))
        got.cache.select([])
        want.cache.select([])
        # the shared blocks, as far as they leave a tail of at least the kernels' row count
        assert store.hits - hits == min(2 * BLOCK, (len(prompt) - slot_target.prefix_tail) // BLOCK * BLOCK)


@pytest.mark.parametrize("drafter", [None, "suffix"])
def test_the_batch_engine_with_a_prefix_store_is_unchanged(tiny_target, slot_target, drafter):
    reqs = lambda: [Request(p, 12) for p in _prompts(tiny_target.vocab_size) * 2]
    make = lambda: SuffixDrafter(tiny_target.vocab_size, 8) if drafter else None
    plain = BatchEngine(slot_target, make(), max_batch_size=2).generate(reqs())
    kept = BatchEngine(slot_target, make(), max_batch_size=2, prefix_tokens=16 * BLOCK)
    assert [r.tokens for r in kept.generate(reqs())] == [r.tokens for r in plain]
    assert kept.prefixes is not None and kept.prefixes.hits >= 2 * BLOCK * 6
