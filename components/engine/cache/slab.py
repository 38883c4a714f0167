"""A preallocated KV cache: HF cache layers whose keys/values are views into a buffer with room
to grow, so a decode round writes its new slots in place instead of copying the whole cache.

HF's ``DynamicLayer`` appends with ``torch.cat``: every round copies every layer's keys and
values, [B, h_kv, L, d] each, to add a few slots, a copy that grows with rows × context (for a
target of Qwen3-8B's shape in bf16 at 32 rows × 2k slots, ~10 GB per round). ``SlabLayer``
keeps a buffer [rows, h_kv, capacity, d] and exposes ``keys = buffer[:B, :, off:off + L]``::

    buffer   | dropped | keys/values (L slots) | free (headroom) |
               off ----^                 off+L ^        capacity ^

``update`` (the model's append) writes the new slots at off+L.. and widens the view; a crop
or a slice of the view (``DynamicLayer.crop``, ``ragged.RaggedCache.trim``) only narrows it.
Rows leave (``keep_rows``: only the rows that move are copied) and join (``add_rows``: written
into free rows, right-aligned, the view widened into the left margin if they are longer)
inside the buffer. Anything else that sets ``keys``/``values`` to a tensor that is not such a
view (``RaggedCache.compact``) is taken over at the next update: one copy into a fresh
buffer, which is what ``torch.cat`` would have cost that round anyway. A fresh buffer has
``max(64, L/4)`` slots of headroom, so it is reallocated about once per 64 decode rounds, and
is zeroed, so that slots a widened view takes in are finite (masked, but never NaN).

The values computed are the same; only where they live changes (the engines' parity tests run
with and without it). Layers of other kinds (sliding-window, quantized) are left as they are.
This module knows HF's cache layer objects and nothing about engines, drafters or rules.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import DynamicLayer

MIN_HEADROOM = 64  # slots


class SlabLayer(DynamicLayer):
    """A ``DynamicLayer`` whose ``keys``/``values`` [B, h_kv, L, d] are views
    ``buffer[:B, :, off:off + L]`` into preallocated buffers [rows, h_kv, capacity, d]."""

    def __init__(self) -> None:
        super().__init__()
        self._k: Tensor | None = None  # the buffers; keys/values are views into them
        self._v: Tensor | None = None

    @classmethod
    def adopt(cls, layer: DynamicLayer) -> SlabLayer:
        """A slab layer holding ``layer``'s keys/values (moved into a buffer at the next update)."""
        slab = cls()
        slab.__dict__.update({k: v for k, v in layer.__dict__.items() if k not in ("_k", "_v")})
        return slab

    @property
    def capacity(self) -> int:
        """Slots the current buffer holds per row (0 before the first update)."""
        return 0 if self._k is None else self._k.shape[2]

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Appends key/value states [B, h_kv, T, d]; returns the whole keys/values [B, h_kv, L+T, d]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, t = self.get_seq_length(), key_states.shape[2]
        off = self._offset()
        if off is None or off + n + t > self.capacity:
            off = self._reallocate(key_states.shape[0], n + t, 0, key_states, value_states)
        end = off + n + t
        self._k[:len(key_states), :, off + n:end] = key_states
        self._v[:len(key_states), :, off + n:end] = value_states
        self._view(len(key_states), off, end)
        return self.keys, self.values

    def keep_rows(self, rows: list[int]) -> None:
        """Keeps only ``rows`` (in that order). In the buffer, only the rows that move are copied
        (none when the last rows leave)."""
        off = self._offset()
        if off is None:
            index = torch.tensor(rows, dtype=torch.long, device=self.keys.device)
            self.keys, self.values = self.keys[index], self.values[index]
            return
        end = off + self.keys.shape[2]
        first = next((j for j, r in enumerate(rows) if r != j), len(rows))
        if first < len(rows):
            src = torch.tensor(rows[first:], dtype=torch.long, device=self._k.device)
            self._k[first:len(rows), :, off:end] = self._k[src, :, off:end]
            self._v[first:len(rows), :, off:end] = self._v[src, :, off:end]
        self._view(len(rows), off, end)

    def add_rows(self, keys: Tensor, values: Tensor) -> None:
        """Appends rows [k, h_kv, w, d] below the current ones, right-aligned with them; the
        shorter side's missing slots on the left are left as they are (the caller masks them).
        In the buffer when its rows and left margin have room, else in a fresh buffer."""
        b, n = self.keys.shape[0], self.keys.shape[2]
        k, w = keys.shape[0], keys.shape[2]
        width = max(n, w)
        off = self._offset()
        if off is None or b + k > self._k.shape[0] or off < width - n:
            off = self._reallocate(b + k, width, width - n, keys, values)
        start = off - (width - n)  # the view now begins here, for old rows and new
        self._k[b:b + k, :, start + width - w:start + width] = keys
        self._v[b:b + k, :, start + width - w:start + width] = values
        self._view(b + k, start, start + width)

    def _view(self, rows: int, start: int, end: int) -> None:
        self.keys, self.values = self._k[:rows, :, start:end], self._v[:rows, :, start:end]

    def _offset(self) -> int | None:
        """Where ``keys`` starts in the buffer, if keys and values are still views
        ``buffer[:B, :, a:b]`` of the buffers; else None."""
        if self._k is None or self.keys is None or self.keys.numel() == 0:
            return None
        off = _slot_offset(self.keys, self._k)
        return off if off is not None and off == _slot_offset(self.values, self._v) else None

    def _reallocate(self, rows: int, slots: int, shift: int, like_k: Tensor, like_v: Tensor) -> int:
        """Fresh zeroed buffers for ``rows`` (at least as many as before) × ``slots`` plus
        headroom; the current keys/values copied to rows 0.., slots ``shift``.. (which is their
        offset, returned). Zeroed, so that slots a view takes in on the left are finite."""
        n, cap = self.get_seq_length(), slots + max(MIN_HEADROOM, slots // 4)
        rows = max(rows, self._k.shape[0] if self._k is not None else 0)
        k = like_k.new_zeros(rows, like_k.shape[1], cap, like_k.shape[3])  # like_*: new states, for shapes
        v = like_v.new_zeros(rows, like_v.shape[1], cap, like_v.shape[3])
        if n:
            b = self.keys.shape[0]
            k[:b, :, shift:shift + n], v[:b, :, shift:shift + n] = self.keys, self.values
        self._k, self._v = k, v
        return shift

    def reset(self) -> None:
        self._k = self._v = None
        super().reset()


def _slot_offset(view: Tensor, buffer: Tensor) -> int | None:
    """a, where ``view`` is ``buffer[:B, :, a:b]`` (leading rows, every head, a range of slots);
    else None."""
    if view._base is not buffer or view.shape[1] != buffer.shape[1] or view.shape[3] != buffer.shape[3]:
        return None
    if view.shape[0] > buffer.shape[0] or view.stride() != buffer.stride():
        return None
    diff = view.storage_offset() - buffer.storage_offset()
    if diff < 0 or diff % buffer.stride(2) or diff >= buffer.stride(1):
        return None
    return diff // buffer.stride(2)


def preallocate(cache: Any) -> Any:
    """Turns ``cache``'s plain ``DynamicLayer``s into ``SlabLayer``s, in place; returns ``cache``.
    Caches without ``.layers`` and layers of other kinds are left as they are."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return cache
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer:
            layers[i] = SlabLayer.adopt(layer)
    return cache
