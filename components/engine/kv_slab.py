"""A preallocated KV cache: HF cache layers whose keys/values are views into a buffer with room
to grow, so a decode round writes its new slots in place instead of copying the whole cache.

HF's ``DynamicLayer`` appends with ``torch.cat``: every round copies every layer's keys and
values, [B, h_kv, L, d] each, to add a few slots. On this CPU that is 1-2 ms of a 35-90 ms
round at 16 rows; on a GPU target of Qwen3-8B's shape at 32 rows × 2k tokens it would be
gigabytes per round. ``SlabLayer`` keeps a buffer [B, h_kv, capacity, d] and exposes
``keys = buffer[:, :, off:off + L]``::

    buffer   | dropped | keys/values (L slots) | free (headroom) |
               off ----^                 off+L ^        capacity ^

``update`` (the model's append) writes the new slots at off+L.. and widens the view; a crop
or a slice of the view (``DynamicLayer.crop``, the ragged cache's ``trim``) only narrows it.
Anything else that sets ``keys``/``values`` to a tensor that is not such a view (a row
``select``, ``concat``, ``compact``, a tree's ``keep_slots``) is taken over at the next update:
one copy into a fresh buffer, which is what ``torch.cat`` would have cost that round anyway.
A fresh buffer has ``max(64, L/4)`` slots of headroom, so it is reallocated about once per
64 decode rounds.

The values computed are the same; only where they live changes (the engines' parity tests run
with and without it). Layers of other kinds (sliding-window, quantized) are left as they are.
This module knows HF's cache layer objects and nothing about engines, drafters or rules.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from transformers.cache_utils import DynamicLayer

MIN_HEADROOM = 64  # slots


class SlabLayer(DynamicLayer):
    """A ``DynamicLayer`` whose ``keys``/``values`` [B, h_kv, L, d] are views into a preallocated
    buffer [B, h_kv, capacity, d]."""

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
        """Slots the current buffer holds (0 before the first update)."""
        return 0 if self._k is None else self._k.shape[2]

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Appends key/value states [B, h_kv, T, d]; returns the whole keys/values [B, h_kv, L+T, d]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, t = self.get_seq_length(), key_states.shape[2]
        off = self._offset(t)
        if off is None:
            off = self._reallocate(n + t, key_states, value_states)
        end = off + n + t
        self._k[:, :, off + n:end] = key_states
        self._v[:, :, off + n:end] = value_states
        self.keys, self.values = self._k[:, :, off:end], self._v[:, :, off:end]
        return self.keys, self.values

    def _offset(self, new_slots: int) -> int | None:
        """Where ``keys`` starts in the buffer, if keys and values are still whole-row views of
        the buffers with room for ``new_slots`` more; else None."""
        if self._k is None or self.keys is None or self.keys.numel() == 0:
            return None
        if not (_is_slot_view(self.keys, self._k) and _is_slot_view(self.values, self._v)):
            return None
        off = (self.keys.storage_offset() - self._k.storage_offset()) // self._k.stride(2)
        voff = (self.values.storage_offset() - self._v.storage_offset()) // self._v.stride(2)
        if voff != off or off + self.keys.shape[2] + new_slots > self._k.shape[2]:
            return None
        return off

    def _reallocate(self, needed: int, key_states: Tensor, value_states: Tensor) -> int:
        """A fresh buffer for ``needed`` slots plus headroom; the current keys/values copied to its
        start. Returns the offset of keys in it (0)."""
        n, cap = self.get_seq_length(), needed + max(MIN_HEADROOM, needed // 4)
        k = key_states.new_empty(*key_states.shape[:2], cap, key_states.shape[3])
        v = value_states.new_empty(*value_states.shape[:2], cap, value_states.shape[3])
        if n:
            k[:, :, :n], v[:, :, :n] = self.keys, self.values
        self._k, self._v = k, v
        return 0

    def reset(self) -> None:
        self._k = self._v = None
        super().reset()


def _is_slot_view(view: Tensor, buffer: Tensor) -> bool:
    """``view`` is ``buffer[:, :, a:b]`` for some a ≤ b (every row and head, a range of slots)."""
    return (view._base is buffer and view.shape[:2] == buffer.shape[:2] and view.shape[3] == buffer.shape[3]
            and view.stride() == buffer.stride())


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
