"""Rollout records: what one training sample holds, how it is encoded, and who it belongs to.

A record is one prompt + the target's own response:

- ``input_ids`` [T] int32: prompt then response tokens (the response ends with a stop token
  unless it hit ``max_new_tokens``);
- ``loss_mask`` [T] uint8: 1 on response tokens (the positions a drafter learns to predict);
- ``hidden`` [T, n, H]: outputs of the drafter's ``layer_ids`` (layer i = HF hidden_states[i+1]);
- ``last_hidden`` [T, H]: output of the last decoder layer *before* the final norm, from which
  the frozen head recomputes the target's logits (logits are never stored);
- with ``storage=int8`` also ``hidden_scale`` [T, n] and ``last_hidden_scale`` [T] float32
  (per-row absmax / 127).

:class:`RecordMeta` says which target, tokenizer, layers and storage dtype a set of records was
made for; reading records for another one is refused with a message naming the mismatch.
This module knows numpy/arrow encodings; it knows nothing about models, Ray tasks or files.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from components.config import ConfigError

SCHEMA_VERSION = 1
STORAGE_DTYPES = {"float32": np.float32, "float16": np.float16, "int8": np.int8}


class RecordMismatchError(ConfigError):
    """Records were written for another target, tokenizer, layer set or storage dtype."""


class TargetIdentity(Protocol):
    """What a record's meta takes from its target (``drafters.base.TargetInfo`` or a loaded target)."""

    name_or_path: str
    tokenizer_hash: str
    num_layers: int
    hidden_size: int


@dataclass(frozen=True)
class RecordMeta:
    target: str  # the target's name_or_path
    tokenizer_hash: str
    layer_ids: tuple[int, ...]  # captured into ``hidden``, in order
    last_layer: int  # captured into ``last_hidden`` (num_layers - 1)
    hidden_size: int
    storage: str  # float32 | float16 | int8
    schema_version: int = SCHEMA_VERSION

    @classmethod
    def of(cls, target: TargetIdentity, layer_ids: Sequence[int], storage: str) -> RecordMeta:
        """The meta of records captured from ``target`` at ``layer_ids``, stored as ``storage``."""
        return cls(target=str(target.name_or_path), tokenizer_hash=str(target.tokenizer_hash),
                   layer_ids=tuple(int(i) for i in layer_ids), last_layer=int(target.num_layers) - 1,
                   hidden_size=int(target.hidden_size), storage=storage)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "layer_ids": list(self.layer_ids)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RecordMeta:
        return cls(**{**d, "layer_ids": tuple(d["layer_ids"])})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def check_meta(found: RecordMeta, expected: RecordMeta, where: str) -> None:
    """Raises :class:`RecordMismatchError` naming every field that differs."""
    diffs = [f"{f.name} is {getattr(found, f.name)!r}, expected {getattr(expected, f.name)!r}"
             for f in dataclasses.fields(RecordMeta) if getattr(found, f.name) != getattr(expected, f.name)]
    if diffs:
        raise RecordMismatchError(f"{where}: written for another target/tokenizer/layer set: " + "; ".join(diffs))


@dataclass
class Record:
    sample_id: str
    input_ids: np.ndarray  # [T] int32
    loss_mask: np.ndarray  # [T] uint8, 1 on response tokens
    hidden: np.ndarray  # [T, n, H] storage dtype
    last_hidden: np.ndarray  # [T, H] storage dtype
    hidden_scale: np.ndarray | None = None  # [T, n] float32 (int8 storage only)
    last_hidden_scale: np.ndarray | None = None  # [T] float32 (int8 storage only)
    prompt_len: int = 0
    seed: int = 0

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def hidden_f32(self) -> np.ndarray:  # [T, n, H] decoded
        return decode(self.hidden, self.hidden_scale)

    def last_hidden_f32(self) -> np.ndarray:  # [T, H] decoded
        return decode(self.last_hidden, self.last_hidden_scale)

    def equals(self, other: Record) -> bool:
        """Bit-for-bit equality of every field."""
        return all(_same(getattr(self, f.name), getattr(other, f.name)) for f in dataclasses.fields(self))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and a.tobytes() == b.tobytes())
    return a == b


def select_layers(records: Sequence[Record], stored: Sequence[int], wanted: Sequence[int]) -> list[Record]:
    """``records`` captured at ``stored`` keeping only the taps ``wanted``, in that order (rollouts
    captured once for one drafter, read by another whose taps they hold). Raises naming the layers
    that were not captured."""
    missing = [i for i in wanted if i not in stored]
    if missing:
        raise RecordMismatchError(f"layers {missing} were not captured (the records hold {list(stored)}): "
                                  "set drafter.layer_ids to captured layers or capture them in the data stage")
    if list(wanted) == list(stored):
        return list(records)
    idx = [list(stored).index(i) for i in wanted]
    return [dataclasses.replace(r, hidden=r.hidden[:, idx],
                                hidden_scale=None if r.hidden_scale is None else r.hidden_scale[:, idx])
            for r in records]


# ----------------------------------------------------------------------------- compression
def encode(x: np.ndarray, storage: str) -> tuple[np.ndarray, np.ndarray | None]:
    """float32 [..., H] → (stored [..., H], per-row scale [...] or None)."""
    if storage not in STORAGE_DTYPES:
        raise ValueError(f"data.storage: '{storage}' is not one of {sorted(STORAGE_DTYPES)}")
    if storage != "int8":
        return x.astype(STORAGE_DTYPES[storage]), None
    scale = np.abs(x).max(axis=-1) / 127.0  # [...]
    safe = np.where(scale > 0, scale, 1.0)[..., None]
    q = np.clip(np.rint(x / safe), -127, 127).astype(np.int8)
    return q, scale.astype(np.float32)


def decode(stored: np.ndarray, scale: np.ndarray | None) -> np.ndarray:
    """Inverse of :func:`encode` (lossy for float16/int8): float32 [..., H]."""
    x = stored.astype(np.float32)
    return x * scale[..., None] if scale is not None else x


# ----------------------------------------------------------------------------- arrow
COLUMNS = ("sample_id", "input_ids", "loss_mask", "hidden", "last_hidden",
           "hidden_scale", "last_hidden_scale", "prompt_len", "seed")
TENSOR_COLUMNS = ("input_ids", "loss_mask", "hidden", "last_hidden", "hidden_scale", "last_hidden_scale")


def _tensor_array(arrays: list[np.ndarray]) -> pa.Array:
    from ray.data.extensions import ArrowVariableShapedTensorArray  # registers the arrow type

    return ArrowVariableShapedTensorArray.from_numpy(arrays)


def records_to_table(records: list[Record]) -> pa.Table:
    """Records → an arrow table with variable-shaped tensor columns (Ray Data reads them)."""
    cols: dict[str, pa.Array] = {
        "sample_id": pa.array([r.sample_id for r in records], pa.string()),
        "prompt_len": pa.array([r.prompt_len for r in records], pa.int32()),
        "seed": pa.array([r.seed for r in records], pa.int64()),
    }
    for name in TENSOR_COLUMNS:
        values = [getattr(r, name) for r in records]
        if all(v is None for v in values):
            continue
        cols[name] = _tensor_array(values)
    return pa.table({c: cols[c] for c in COLUMNS if c in cols})


def batch_to_records(batch: dict[str, Any]) -> list[Record]:
    """A numpy batch (as Ray Data yields it, or from :func:`table_to_batch`) → records."""
    n = len(batch["sample_id"])
    return [Record(**{c: _row(batch[c][i]) if c in batch else None for c in COLUMNS}) for i in range(n)]


def _row(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return np.ascontiguousarray(v)
    if isinstance(v, np.generic):
        return v.item()
    return v


def table_to_records(table: pa.Table) -> list[Record]:
    """An arrow table of record rows (:func:`records_to_table`'s layout) → records, in row order."""
    return batch_to_records(table_to_batch(table))


def split_rows(table: pa.Table, sample_ids: set[str]) -> tuple[pa.Table, pa.Table]:
    """(rows whose ``sample_id`` is not in ``sample_ids``, rows whose it is), each in table order."""
    import pyarrow.compute as pc

    chosen = pc.is_in(table["sample_id"], value_set=pa.array(sorted(sample_ids), pa.string()))
    return table.filter(pc.invert(chosen)), table.filter(chosen)


def table_to_batch(table: pa.Table) -> dict[str, Any]:
    """An arrow table of records → a dict of numpy columns (tensor columns as arrays of rows)."""
    out: dict[str, Any] = {}
    for name in table.column_names:
        col = table.column(name).combine_chunks()
        if name in TENSOR_COLUMNS:
            out[name] = list(col.to_numpy(zero_copy_only=False))
        else:
            out[name] = col.to_pylist()
    return out


def record_bytes_per_token(meta: RecordMeta) -> int:
    """Analytic bytes of hidden states per token (no container overhead)."""
    rows = len(meta.layer_ids) + 1
    per = rows * meta.hidden_size * np.dtype(STORAGE_DTYPES[meta.storage]).itemsize
    return per + (rows * 4 if meta.storage == "int8" else 0)
