"""The batch engine's cache on the fast step's static KV slab: each running request owns one row
of a preallocated slab (per layer [rows, h_kv, S, d], ``step.StaticDecoder.new_slab``) and a
count of committed slots.

    pool = SlotPool(*decoder.new_slab(max_rows))
    cache = SlotCache(pool, [pool.acquire()], [prompt_len])     # after a request's prefill
    batch_cache.concat(cache); ...; batch_cache.commit(keep); batch_cache.select(rows_left)

Against ``ragged.RaggedCache`` (an HF cache whose rows share one physical length, rejected and
padding slots kept as masked holes): a request's tokens sit at slots 0..n-1 of its own row, at
their logical positions, so there are no holes and no padding. A rejected draft's slot lies
past the committed count and the next round overwrites it; a request that leaves hands its row
back (no copy); one that joins takes a free row. Nothing is compacted, gathered or copied.

The methods the batch engine calls on a ``RaggedCache`` (``attention_mask``, ``commit``,
``select``, ``concat``, ``holes``, ``reclaimable``, ``compact``) mean the same here. Knows slot
bookkeeping only; the target's forward (``fast.StepTarget``) reads ``rows``/``lengths``.
"""

from __future__ import annotations

from torch import Tensor


class SlotsExhausted(RuntimeError):
    """Every row of the slab is taken; the batch engine admits at most as many requests as rows."""


class SlotPool:
    """The slab (per layer keys/values [rows, h_kv, S, d]) and which of its rows are free."""

    def __init__(self, k: list[Tensor], v: list[Tensor]):
        self.k, self.v = k, v
        self.free = list(range(k[0].shape[0]))[::-1]  # popped from the end: low rows first

    @property
    def rows(self) -> int:
        return self.k[0].shape[0]

    @property
    def slots(self) -> int:
        """S: slots per row (the longest sequence a row holds)."""
        return self.k[0].shape[2]

    def acquire(self) -> int:
        if not self.free:
            raise SlotsExhausted(f"all {self.rows} rows of the static KV slab are in use")
        return self.free.pop()

    def release(self, row: int) -> None:
        self.free.append(row)


class SlotCache:
    """The running batch's sequences: batch row b is slab row ``rows[b]`` with ``lengths[b]``
    committed slots (0..lengths[b]-1)."""

    def __init__(self, pool: SlotPool, rows: list[int], lengths: list[int]):
        self.pool, self.rows, self.lengths = pool, list(rows), list(lengths)
        # this round's real new tokens per row (``attention_mask``): the rest of the pass's width is
        # padding, which the forward leaves out; None: every row's whole width is real
        self.new_tokens: list[int] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def length(self) -> int:
        """The longest row's committed slots."""
        return max(self.lengths, default=0)

    def attention_mask(self, new_tokens: int, real: list[int] | None = None) -> None:
        """No mask: each row reads its own committed slots (the forward knows them). ``real``:
        how many of the ``new_tokens`` of each row are real (kept for the forward as ``new_tokens``)."""
        self.new_tokens = None if real is None else [min(int(n), new_tokens) for n in real]

    def commit(self, keep: Tensor | list[int]) -> None:
        """keep [B, W] bool: which of each row's W new slots hold committed tokens (a prefix); or
        how many of each row's new slots do (``RaggedCache.commit`` takes either too)."""
        counts = keep if isinstance(keep, list) else keep.sum(dim=1).tolist()
        for b, count in enumerate(counts):
            self.lengths[b] += int(count)

    def holes(self) -> float:
        return 0.0

    def reclaimable(self) -> float:
        return 0.0

    def compact(self) -> None:
        """Nothing to compact."""

    def select(self, rows: list[int]) -> None:
        """Keeps the batch rows ``rows`` (in that order); the others' slab rows become free."""
        kept = set(rows)
        for b, row in enumerate(self.rows):
            if b not in kept:
                self.pool.release(row)
        self.rows = [self.rows[b] for b in rows]
        self.lengths = [self.lengths[b] for b in rows]

    def concat(self, other: SlotCache) -> None:
        """Appends ``other``'s rows (which it hands over: ``other`` is empty afterwards)."""
        if other.pool is not self.pool:
            raise ValueError("slot caches of different slabs cannot be joined")
        self.rows += other.rows
        self.lengths += other.lengths
        other.rows, other.lengths = [], []
