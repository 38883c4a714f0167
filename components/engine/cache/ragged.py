"""A ragged KV cache for many sequences in one target forward: one HF ``DynamicCache`` whose
rows share a physical length, plus a mask of which slots hold committed tokens.

Requests of different lengths, accepting different numbers of drafts per round, keep their
committed keys/values where they were computed: a rejected draft's slot becomes a *hole*
(masked out), a shorter request is left-padded (masked out), and each row carries its own
position ids, so RoPE sees the logical positions while attention sees only valid slots::

    physical slot  0  1  2  3  4  5  6  7
    row 0 (valid)  1  1  1  1  0  0  1  1     <- slots 4-5: drafts rejected in a round
    row 1 (valid)  0  0  1  1  1  1  1  1     <- shorter prompt, left-padded

Nothing is recomputed. Holes cost memory and attention work until ``compact`` gathers each
row's valid slots to the right (a copy, no model call); ``trim`` drops columns that no row uses.
Compaction narrows the cache only to the longest row's count of valid slots, so a batch whose
holes are mostly left padding gains nothing from it (``reclaimable``).

Requests join (``concat``, after their prefill) and leave (``select``) between
rounds; leaving frees the row. The layers may be ``slab.SlabLayer``s (the engines'
default): a forward then appends in place, ``trim`` only narrows their views, and rows leave
and join inside their buffers. This module knows HF's ``DynamicCache`` layer tensors
(``layers[i].keys/values``, [B, h_kv, L, d]) and nothing about drafters, rules or requests.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from components.engine.cache.slab import SlabLayer


def _layers(cache: Any) -> list[Any]:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"{type(cache).__name__}: a ragged batch needs an HF DynamicCache (with .layers)")
    return list(layers)


class RaggedCache:
    """The target's KV cache of a batch of sequences and the validity of each slot."""

    def __init__(self, cache: Any, valid: Tensor):
        self.cache = cache  # HF DynamicCache, every layer [B, h_kv, L, d]
        self.valid = valid  # [B, L] bool: slot holds a committed token of that row

    @classmethod
    def single(cls, cache: Any) -> RaggedCache:
        """A batch-1 prefill's cache, every slot valid."""
        length = cache.get_seq_length()
        dev = _layers(cache)[0].keys.device
        return cls(cache, torch.ones(1, length, dtype=torch.bool, device=dev))

    @property
    def batch_size(self) -> int:
        return self.valid.shape[0]

    @property
    def length(self) -> int:
        return self.valid.shape[1]

    def attention_mask(self, new_tokens: int, real: list[int] | None = None) -> Tensor:  # [B, L + new_tokens] long
        """The 2-D mask of a forward that appends ``new_tokens`` slots (all attendable; ``real``,
        each row's tokens before its padding, is not needed here: padding is computed and never
        committed)."""
        new = torch.ones(self.batch_size, new_tokens, dtype=torch.long, device=self.valid.device)
        return torch.cat([self.valid.long(), new], dim=1)

    def commit(self, keep: Tensor | list[int]) -> None:
        """After a forward appended keep.shape[1] slots: keep [B, T] bool marks the committed ones
        (or, per row, how many of the T: the first ones)."""
        if isinstance(keep, list):
            width = self.cache.get_seq_length() - self.length
            keep = torch.arange(width)[None, :] < torch.tensor(keep)[:, None]  # [B, T]
        if self.cache.get_seq_length() != self.length + keep.shape[1]:
            raise RuntimeError(f"cache has {self.cache.get_seq_length()} slots, mask {self.length}+{keep.shape[1]}")
        self.valid = torch.cat([self.valid, keep.to(self.valid.device)], dim=1)
        self.trim()

    def trim(self) -> None:
        """Drops leading and trailing columns that hold no row's token."""
        used = self.valid.any(dim=0)  # [L]
        if bool(used.all()):
            return
        idx = torch.nonzero(used).flatten()
        lo, hi = (int(idx[0]), int(idx[-1]) + 1) if idx.numel() else (0, 0)
        if lo == 0 and hi == self.length:
            return
        for layer in _layers(self.cache):
            layer.keys, layer.values = layer.keys[:, :, lo:hi], layer.values[:, :, lo:hi]
        self.valid = self.valid[:, lo:hi]

    def holes(self) -> float:
        """Fraction of slots that are masked out."""
        return 1.0 - float(self.valid.float().mean()) if self.valid.numel() else 0.0

    def reclaimable(self) -> float:
        """Fraction of the width that ``compact`` would free: 1 - (longest row's valid slots) / width.
        Left padding of shorter rows is a hole that compaction cannot remove, so this, not
        ``holes``, says whether compacting pays."""
        if not self.valid.numel():
            return 0.0
        return 1.0 - int(self.valid.sum(dim=1).max()) / self.length

    def compact(self) -> None:
        """Moves each row's valid slots to the right end (order kept); the width becomes the
        longest row's count of valid slots. A gather of keys/values, no model call."""
        counts = self.valid.sum(dim=1)  # [B]
        width = int(counts.max()) if counts.numel() else 0
        # stable sort key: invalid slots first, then valid ones in their order
        order = torch.argsort(self.valid.long(), dim=1, stable=True)[:, self.length - width:]  # [B, width]
        for layer in _layers(self.cache):
            idx = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys, layer.values = layer.keys.gather(2, idx), layer.values.gather(2, idx)
        cols = torch.arange(width, device=self.valid.device)
        self.valid = cols[None, :] >= (width - counts)[:, None]

    def select(self, rows: list[int]) -> None:
        """Keeps only ``rows`` (in that order): the others' slots are freed."""
        index = torch.tensor(rows, dtype=torch.long, device=self.valid.device)
        for layer in _layers(self.cache):
            if isinstance(layer, SlabLayer):
                layer.keep_rows(rows)
            else:
                layer.keys, layer.values = layer.keys[index], layer.values[index]
        self.valid = self.valid[index]
        self.trim()

    def concat(self, other: RaggedCache) -> None:
        """Appends ``other``'s rows after this batch's, left-padding the shorter side (with zeros;
        in a preallocated layer's buffer, whatever finite values it held: masked either way)."""
        width = max(self.length, other.length)
        for mine, theirs in zip(_layers(self.cache), _layers(other.cache), strict=True):
            if isinstance(mine, SlabLayer):
                mine.add_rows(theirs.keys, theirs.values)
                continue
            mine.keys = torch.cat([_left_pad(mine.keys, width), _left_pad(theirs.keys, width)], dim=0)
            mine.values = torch.cat([_left_pad(mine.values, width), _left_pad(theirs.values, width)], dim=0)
        self.valid = torch.cat([_left_pad_mask(self.valid, width), _left_pad_mask(other.valid, width)], dim=0)


def _left_pad(x: Tensor, width: int) -> Tensor:  # [B, h, L, d] -> [B, h, width, d]
    missing = width - x.shape[2]
    if missing == 0:
        return x
    pad = x.new_zeros(x.shape[0], x.shape[1], missing, x.shape[3])
    return torch.cat([pad, x], dim=2)


def _left_pad_mask(valid: Tensor, width: int) -> Tensor:  # [B, L] -> [B, width]
    missing = width - valid.shape[1]
    if missing == 0:
        return valid
    return torch.cat([valid.new_zeros(valid.shape[0], missing), valid], dim=1)


def keep_slots(cache: Any, start: int, kept: Tensor) -> None:
    """Batch-1 token-tree accept: of the slots from ``start`` on, keep only ``kept`` [k] long
    (offsets from ``start``, increasing), moved to start..start+k-1; the rest are dropped.
    Written in place, then cut (a preallocated layer keeps its buffer)."""
    for layer in _layers(cache):
        idx = start + kept.to(layer.keys.device)
        end = start + idx.numel()
        layer.keys[:, :, start:end] = layer.keys[:, :, idx]
        layer.values[:, :, start:end] = layer.values[:, :, idx]
        layer.keys, layer.values = layer.keys[:, :, :end], layer.values[:, :, :end]
