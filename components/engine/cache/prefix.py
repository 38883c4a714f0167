"""Prompt prefixes' keys and values kept after their prefill (``PrefixStore``), so that a later
prompt that starts with the same tokens (a chat's system prompt, an earlier turn of the same
conversation, a shared instruction) copies them into its slab row instead of computing them.

    store = PrefixStore(max_tokens=2048)
    start = store.load(ids, k, v, row, limit)    # tokens 0..start-1 of ids now in slab row ``row``
    ...prefill ids[start:] at positions start.. into that row...
    store.keep(ids, k, v, row)                   # its full blocks kept for the prompts after it

The unit is a block of ``BLOCK`` tokens: block j of a prompt is kept under (the id of block j-1's
entry, its own tokens), so an entry stands for exactly one token prefix (no hash to collide), as
vLLM's prefix caching keys its blocks by their parent's hash. The store holds at most
``max_tokens`` tokens: the least recently used blocks leave first, a prefix's deeper blocks
before the ones it starts with. A hit is at most ``limit`` tokens (the caller's: it leaves a tail
for the prefill, whose last token's logits it needs, and which must be long enough to take the
same kernel path as a full prefill would, for the same bits: ``StepTarget.prefix_tail``).

Keys and values live in one buffer per layer of ``max_tokens // BLOCK`` blocks ([blocks, h_kv,
BLOCK, d], allocated at the first ``keep``), so a prompt's blocks go in and out in one copy per
layer. Knows the slab's layout (per layer [rows, h_kv, S, d]); nothing about the target's passes,
requests or drafters.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor

BLOCK = 16  # tokens per kept block


class PrefixStore:
    """Blocks of prompt prefixes' keys and values, least recently used out first (module docstring)."""

    def __init__(self, max_tokens: int):
        if max_tokens < BLOCK:
            raise ValueError(f"a prefix store holds at least one block of {BLOCK} tokens, got max_tokens={max_tokens}")
        self.max_blocks = max_tokens // BLOCK
        # (the parent block's id or -1, the block's tokens) -> (this block's id, its place in the buffers)
        self.entries: OrderedDict[tuple[int, tuple[int, ...]], tuple[int, int]] = OrderedDict()  # least recent first
        self.k: list[Tensor] = []  # per layer [max_blocks, h_kv, BLOCK, d]
        self.v: list[Tensor] = []
        self._free: list[int] = []
        self._next = 0
        self.hits = 0  # tokens copied instead of computed, since the store was made

    @property
    def tokens(self) -> int:
        return len(self.entries) * BLOCK

    def _chain(self, ids: list[int], blocks: int) -> list[tuple[tuple[int, tuple[int, ...]], int, int]]:
        """(key, id, place) of ``ids``' first blocks (at most ``blocks``) that are kept, as far as they go."""
        found, parent = [], -1
        for j in range(blocks):
            key = (parent, tuple(ids[j * BLOCK:(j + 1) * BLOCK]))
            kept = self.entries.get(key)
            if kept is None:
                break
            found.append((key, *kept))
            parent = kept[0]
        return found

    def _touch(self, chain: list[tuple[tuple[int, tuple[int, ...]], int, int]]) -> None:
        for key, _, _ in reversed(chain):  # deepest first: the prefix's first block is the most recent
            self.entries.move_to_end(key)

    def load(self, ids: list[int], k: list[Tensor], v: list[Tensor], row: int, limit: int) -> int:
        """Copies the kept blocks of ``ids``' longest kept prefix of at most ``limit`` tokens into
        slots 0.. of slab row ``row`` (k/v per layer [rows, h_kv, S, d]); returns its tokens."""
        chain = self._chain(ids, max(0, min(limit, len(ids))) // BLOCK)
        if not chain:
            return 0
        self._touch(chain)
        count, places = len(chain) * BLOCK, torch.tensor([place for _, _, place in chain])
        for slab, kept in ((k, self.k), (v, self.v)):
            for x, buf in zip(slab, kept):  # [n, h_kv, BLOCK, d] -> [h_kv, n * BLOCK, d]
                x[row, :, :count] = buf[places].transpose(0, 1).reshape(x.shape[1], count, x.shape[3])
        self.hits += count
        return count

    def keep(self, ids: list[int], k: list[Tensor], v: list[Tensor], row: int) -> None:
        """Keeps the full blocks of ``ids`` (prefilled into slots 0.. of slab row ``row``) that are
        not kept yet, as many as the store holds beside the ones it starts with; the least
        recently used leave to make room."""
        chain = self._chain(ids, len(ids) // BLOCK)
        first, last = len(chain), min(len(ids) // BLOCK, self.max_blocks)
        if last <= first:
            self._touch(chain)
            return
        if not self.k:
            shape = (self.max_blocks, k[0].shape[1], BLOCK, k[0].shape[3])
            self.k, self.v = [x.new_empty(shape) for x in k], [x.new_empty(shape) for x in v]
            self._free = list(range(self.max_blocks))[::-1]
        self._touch(chain)  # the blocks it starts with are not the ones to leave
        places = []
        for _ in range(first, last):
            if not self._free:
                self._free.append(self.entries.popitem(last=False)[1][1])
            places.append(self._free.pop())
        parent = chain[-1][1] if chain else -1
        for j, place in zip(range(first, last), places):
            key = (parent, tuple(ids[j * BLOCK:(j + 1) * BLOCK]))
            self.entries[key] = (self._next, place)
            chain.append((key, self._next, place))
            parent, self._next = self._next, self._next + 1
        lo, hi, at = first * BLOCK, last * BLOCK, torch.tensor(places)
        for slab, kept in ((k, self.k), (v, self.v)):
            for x, buf in zip(slab, kept):  # [h_kv, n * BLOCK, d] -> [n, h_kv, BLOCK, d]
                buf.index_copy_(0, at, x[row, :, lo:hi].reshape(x.shape[1], last - first, BLOCK, x.shape[3]).transpose(0, 1))
        self._touch(chain)

    def clear(self) -> None:
        """Forgets every kept block (e.g. between the two sides of an A/B measurement)."""
        self.entries.clear()
        self._free = list(range(self.max_blocks))[::-1] if self.k else []
