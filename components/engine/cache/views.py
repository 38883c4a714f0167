"""In-place views of the target's own KV cache, for a drafter that reads it (``Capability.TARGET_KV``).

``target_kv(cache, layers, row)`` is the keys/values of some target layers over the committed
context as a ``drafters.exchange.TargetKV``: slices of the tensors the cache holds, never
copies, so it costs nothing to build and shows whatever the cache holds until the cache next
changes (the engines build it right before a ``propose``, ``core.attach_target_kv``). Keys are
as the target's attention reads them (k-norm and RoPE at the logical positions applied). Per
kind of cache the engines keep:

* an HF ``DynamicCache`` (batch 1; its layers ``DynamicLayer`` or ``slab.SlabLayer``): the
  engines crop it to the committed positions after each round, so every slot is one, in
  position order: ``layers[l].keys/values`` [B, h_kv, S, d], ``valid`` None;
* ``target.step.StaticCache`` (the fast step's batch-1 slab): ``k[l][:, :, :length]``, ``valid``
  None (the slots past ``length`` hold rejected drafts or nothing);
* ``ragged.RaggedCache`` (the batch engine's HF cache): the rows share one physical width,
  left padding and rejected drafts are holes; ``valid`` [B, L] is the cache's own mask of the
  slots that hold committed tokens (a row's valid slots are its positions 0.. in order);
* ``slots.SlotCache`` (the batch engine's rows of the fast step's slab): batch row b is slab row
  ``rows[b]`` with ``lengths[b]`` committed slots, so ``pool.k[l][r:r+1, :, :lengths[b]]``,
  ``valid`` None.

``row=b`` gives batch row b alone ([1, ...] views, ``valid[b:b+1]``); a slot cache's rows are not
adjacent in its slab, so with more than one row it needs ``row``. Layer types whose keys are not
every committed position (sliding-window, quantized layers) and caches of other types are
refused, naming the type.

Knows the engines' cache types and the ``TargetKV`` record; nothing about drafters (which
layers they read, what they do with them), rules or requests. That the cache holds exactly the
committed context when it is read is the engines' invariant (``core.py``), not checked here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers.cache_utils import DynamicCache, DynamicLayer

from components.drafters.exchange import TargetKV
from components.drafters.layers import KV  # k, v [B, h_kv, S, d]
from components.engine.cache.ragged import RaggedCache
from components.engine.cache.slab import SlabLayer
from components.engine.cache.slots import SlotCache
from components.target.step import StaticCache

READ_IN_PLACE = (DynamicLayer, SlabLayer)  # HF layer types whose keys/values are every committed slot


def target_kv(cache: Any, layers: Sequence[int], row: int | None = None) -> TargetKV:
    """Views of ``cache``'s keys/values of target decoder ``layers`` (0-based) over the committed
    context: of every row, or of batch row ``row`` alone (module docstring)."""
    ids = [int(i) for i in layers]
    if isinstance(cache, RaggedCache):
        kv = _hf_kv(cache.cache, ids, _rows(cache.batch_size, row))
        valid = cache.valid[_rows(cache.batch_size, row)]  # [B, L] bool (a view of the cache's mask)
        for i, (k, _) in zip(ids, kv):
            if k.shape[2] != valid.shape[1]:
                raise RuntimeError(f"target_kv: layer {i} holds {k.shape[2]} slots, the ragged cache's mask "
                                   f"{valid.shape[1]}")
        return TargetKV(ids, kv, valid)
    if isinstance(cache, SlotCache):
        return TargetKV(ids, _slot_kv(cache, ids, row))
    if isinstance(cache, StaticCache):
        _check_layers(ids, len(cache.k), "StaticCache")
        rows, n = _rows(cache.k[0].shape[0], row), cache.length
        return TargetKV(ids, [(cache.k[i][rows, :, :n], cache.v[i][rows, :, :n]) for i in ids])
    if isinstance(cache, DynamicCache):
        batch = _hf_layer(cache, ids[0]).keys.shape[0] if ids else 1
        return TargetKV(ids, _hf_kv(cache, ids, _rows(batch, row)))
    raise TypeError(f"target_kv: no in-place view of a {type(cache).__module__}.{type(cache).__qualname__}; "
                    "the engines' target caches are an HF DynamicCache, target.step.StaticCache, "
                    "engine.cache.RaggedCache and engine.cache.SlotCache")


def _hf_kv(cache: Any, layers: list[int], rows: slice) -> list[KV]:
    """Per layer of an HF cache, its keys/values [B, h_kv, S, d] (rows ``rows``): views."""
    return [(layer.keys[rows], layer.values[rows]) for layer in (_hf_layer(cache, i) for i in layers)]


def _hf_layer(cache: Any, i: int) -> Any:
    """Layer ``i`` of an HF cache, refused unless its keys are every committed slot."""
    _check_layers([i], len(cache.layers), type(cache).__name__)
    layer = cache.layers[i]
    if type(layer) not in READ_IN_PLACE:
        raise TypeError(f"target_kv: layer {i} of the target's cache is a {type(layer).__name__}, whose keys are "
                        f"not every committed position; only {', '.join(t.__name__ for t in READ_IN_PLACE)} "
                        "layers are read in place")
    if layer.keys is None:
        raise ValueError(f"target_kv: layer {i} of the target's cache holds nothing yet (read it after the prefill)")
    return layer


def _slot_kv(cache: SlotCache, layers: list[int], row: int | None) -> list[KV]:
    """Per layer, batch row ``row``'s committed slots of its slab row: [1, h_kv, lengths[row], d]."""
    if row is None:
        if cache.batch_size != 1:
            raise ValueError(f"target_kv: a SlotCache's {cache.batch_size} rows lie in separate rows of its slab "
                             "(no one view holds them); ask for one row at a time (row=b)")
        row = 0
    _rows(cache.batch_size, row)
    pool, r, n = cache.pool, cache.rows[row], cache.lengths[row]
    _check_layers(layers, len(pool.k), "SlotCache")
    return [(pool.k[i][r:r + 1, :, :n], pool.v[i][r:r + 1, :, :n]) for i in layers]


def _rows(batch: int, row: int | None) -> slice:
    """Every row (None), or batch row ``row`` alone, as a slice (so indexing keeps a view)."""
    if row is None:
        return slice(None)
    if not 0 <= row < batch:
        raise IndexError(f"target_kv: row {row} of a cache of {batch} rows")
    return slice(row, row + 1)


def _check_layers(layers: list[int], count: int, kind: str) -> None:
    bad = [i for i in layers if not 0 <= i < count]
    if bad:
        raise ValueError(f"target_kv: layers {bad} are not among the {count} layers of the target's {kind} (0-based)")
