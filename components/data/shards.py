"""Shards on disk: deterministic shard plan, atomic shard writes, the manifest, reading back
(either format, as records or as arrow tables of record rows: one reader for both).

Layout of ``data.output_dir``::

    shard-00000.parquet     records 0..S-1 (format=parquet: tensor columns, one row per record)
    shard-00001/            (format=safetensors: one <n>.safetensors per record + _shard.json)
    manifest.json           written last: meta, plan, schema, per-shard counts/bytes/sha256, totals

The plan (which prompt goes to which shard) is a pure function of the prompts and
``shard_size``; a shard is written to a temporary name and renamed, so after a crash a rerun
finds every finished shard, skips it, and writes only the missing ones: nothing is duplicated
and nothing is half-written. Every shard carries its :class:`RecordMeta` and plan id; reading
or resuming with another target, tokenizer, layer set or plan is refused.

Knows files, parquet and safetensors; knows nothing about models or MLflow.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from components.data.prompts import Prompt
from components.data.records import (
    COLUMNS,
    Record,
    RecordMeta,
    RecordMismatchError,
    check_meta,
    record_bytes_per_token,
    records_to_table,
    table_to_batch,
    table_to_records,
)

MANIFEST = "manifest.json"
SHARD_META = b"specline.shard"


@dataclass(frozen=True)
class ShardSpec:
    index: int
    prompts: tuple[Prompt, ...]

    @property
    def name(self) -> str:
        return f"shard-{self.index:05d}"


def plan_shards(prompts: Sequence[Prompt], shard_size: int) -> list[ShardSpec]:
    return [ShardSpec(k // shard_size, tuple(prompts[k:k + shard_size])) for k in range(0, len(prompts), shard_size)]


def plan_id(prompts: Sequence[Prompt], generation: dict[str, Any], shard_size: int, fmt: str) -> str:
    """Fingerprint of everything that decides shard contents besides :class:`RecordMeta`."""
    h = hashlib.sha256(json.dumps({"gen": generation, "shard_size": shard_size, "format": fmt},
                                  sort_keys=True).encode())
    for p in prompts:
        h.update(f"{p.prompt_id}\0{p.seed}\0{','.join(map(str, p.input_ids))}\n".encode())
    return h.hexdigest()[:16]


def shard_path(out_dir: Path, spec: ShardSpec, fmt: str) -> Path:
    return out_dir / (f"{spec.name}.parquet" if fmt == "parquet" else spec.name)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        h.update(f.name.encode())
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ----------------------------------------------------------------------------- write
def write_shard(out_dir: Path, spec: ShardSpec, records: list[Record], meta: RecordMeta,
                plan: str, fmt: str) -> dict[str, Any]:
    """Writes one shard under a temporary name, then renames it; returns its summary."""
    header = {"meta": meta.to_dict(), "plan_id": plan, "shard": spec.index, "records": len(records),
              "tokens": sum(r.num_tokens for r in records),
              "response_tokens": int(sum(int(r.loss_mask.sum()) for r in records))}
    final = shard_path(out_dir, spec, fmt)
    tmp = out_dir / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    if fmt == "parquet":
        table = records_to_table(records)
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), SHARD_META: json.dumps(header).encode()})
        pq.write_table(table, tmp, compression="zstd")
    else:
        _write_safetensors_dir(tmp, records, header)
    os.replace(tmp, final)
    return shard_summary(final, header)


def _write_safetensors_dir(tmp: Path, records: list[Record], header: dict[str, Any]) -> None:
    from safetensors.numpy import save_file

    tmp.mkdir(parents=True)
    for i, r in enumerate(records):
        tensors = {c: getattr(r, c) for c in COLUMNS if isinstance(getattr(r, c), np.ndarray)}
        save_file(tensors, str(tmp / f"{i:06d}.safetensors"),
                  metadata={"sample_id": r.sample_id, "prompt_len": str(r.prompt_len), "seed": str(r.seed)})
    (tmp / "_shard.json").write_text(json.dumps(header))


def shard_summary(path: Path, header: dict[str, Any]) -> dict[str, Any]:
    return {"name": path.name, "index": header["shard"], "records": header["records"],
            "tokens": header["tokens"], "response_tokens": header["response_tokens"],
            "bytes": _size(path), "sha256": _sha256(path)}


def read_header(path: Path) -> dict[str, Any]:
    """The header a shard was written with (meta, plan id, counts)."""
    if path.is_dir():
        return json.loads((path / "_shard.json").read_text())
    raw = (pq.read_schema(path).metadata or {}).get(SHARD_META)
    if raw is None:
        raise RecordMismatchError(f"{path}: not a specline shard (no '{SHARD_META.decode()}' metadata)")
    return json.loads(raw)


def clean_partial(out_dir: Path) -> int:
    """Removes temporary files of shards a crashed run left behind; returns how many."""
    import shutil

    partial = list(out_dir.glob(".shard-*.tmp-*"))
    for p in partial:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    return len(partial)


def existing_shards(out_dir: Path, specs: Sequence[ShardSpec], meta: RecordMeta, plan: str,
                    fmt: str) -> dict[int, dict[str, Any]]:
    """Summaries of finished shards of this plan; refuses shards of another target or plan."""
    found: dict[int, dict[str, Any]] = {}
    for spec in specs:
        path = shard_path(out_dir, spec, fmt)
        if not path.exists():
            continue
        header = read_header(path)
        check_meta(RecordMeta.from_dict(header["meta"]), meta, str(path))
        if header["plan_id"] != plan:
            raise RecordMismatchError(
                f"{path}: written for another prompt set or generation settings (plan {header['plan_id']}, "
                f"expected {plan}); use a new data.output_dir or delete {out_dir}")
        found[spec.index] = shard_summary(path, header)
    return found


def write_manifest(out_dir: Path, meta: RecordMeta, plan: str, fmt: str, shards: list[dict[str, Any]],
                   extra: dict[str, Any]) -> dict[str, Any]:
    shards = sorted(shards, key=lambda s: s["index"])
    tokens = sum(s["tokens"] for s in shards)
    nbytes = sum(s["bytes"] for s in shards)
    manifest = {
        "meta": meta.to_dict(), "plan_id": plan, "format": fmt, "schema": schema(meta),
        "shards": shards,
        "totals": {"records": sum(s["records"] for s in shards), "tokens": tokens,
                   "response_tokens": sum(s["response_tokens"] for s in shards), "bytes": nbytes,
                   "bytes_per_token": nbytes / max(1, tokens),
                   "hidden_bytes_per_token": record_bytes_per_token(meta)},
        **extra,
    }
    tmp = out_dir / f".{MANIFEST}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, out_dir / MANIFEST)
    return manifest


def schema(meta: RecordMeta) -> dict[str, str]:
    n, H, dt = len(meta.layer_ids), meta.hidden_size, meta.storage
    out = {"sample_id": "string", "input_ids": "int32 [T]", "loss_mask": "uint8 [T] (1 = response token)",
           "hidden": f"{dt} [T, {n}, {H}] (layers {list(meta.layer_ids)})",
           "last_hidden": f"{dt} [T, {H}] (layer {meta.last_layer}, before the final norm)",
           "prompt_len": "int32", "seed": "int64"}
    if dt == "int8":
        out.update(hidden_scale=f"float32 [T, {n}]", last_hidden_scale="float32 [T]")
    return out


# ----------------------------------------------------------------------------- read
def load_manifest(data_dir: Path, expect: RecordMeta | None = None) -> dict[str, Any]:
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no manifest (run the data stage in shards mode first)")
    manifest = json.loads(path.read_text())
    if expect is not None:
        check_meta(RecordMeta.from_dict(manifest["meta"]), expect, str(path))
    return manifest


def _check_header(path: Path, expect: RecordMeta | None) -> None:
    if expect is not None:
        check_meta(RecordMeta.from_dict(read_header(path)["meta"]), expect, str(path))


def _read_parquet(path: Path) -> pa.Table:
    # Tensors are stored as Ray Data's arrow tensor extension types, which must be registered
    # before the table is read, or pyarrow returns plain structs.
    import ray.air.util.tensor_extensions.arrow  # noqa: F401

    return pq.read_table(path)


def _read_safetensors_dir(path: Path) -> list[Record]:
    from safetensors import safe_open

    records = []
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="numpy") as st:
            md = st.metadata()
            tensors = {k: st.get_tensor(k) for k in st.keys()}  # noqa: SIM118 -- safe_open is not iterable
        records.append(Record(md["sample_id"], prompt_len=int(md["prompt_len"]), seed=int(md["seed"]),
                              **{c: tensors.get(c) for c in COLUMNS if c not in ("sample_id", "prompt_len", "seed")}))
    return records


def read_shard(path: Path, expect: RecordMeta | None = None) -> list[Record]:
    """Records of one shard (either format), in order; refuses a shard written for another meta."""
    _check_header(path, expect)
    return table_to_records(_read_parquet(path)) if path.is_file() else _read_safetensors_dir(path)


def read_table(path: Path, expect: RecordMeta | None = None) -> pa.Table:
    """One shard (either format) as an arrow table of record rows, the layout of
    :func:`records_to_table` (what ``ray.data.from_arrow`` takes); refuses another meta."""
    _check_header(path, expect)
    return _read_parquet(path) if path.is_file() else records_to_table(_read_safetensors_dir(path))


def read_tables(data_dir: Path, expect: RecordMeta | None = None) -> list[pa.Table]:
    """Every shard the manifest lists, one table each, in manifest order (each shard read once)."""
    data_dir = Path(data_dir)
    return [read_table(data_dir / s["name"], expect) for s in load_manifest(data_dir, expect)["shards"]]


def read_records(data_dir: Path, expect: RecordMeta | None = None, verify: bool = False) -> Iterator[Record]:
    """All records listed in the manifest, shard by shard; ``verify`` checks the sha256 first."""
    data_dir = Path(data_dir)
    manifest = load_manifest(data_dir, expect)
    for shard in manifest["shards"]:
        path = data_dir / shard["name"]
        if verify and _sha256(path) != shard["sha256"]:
            raise RecordMismatchError(f"{path}: checksum differs from {data_dir / MANIFEST} (corrupt or replaced)")
        yield from read_shard(path, expect)


def read_responses(data_dir: Path, tokenizer_hash: str | None = None) -> Iterator[list[int]]:
    """The response token ids of every record the manifest lists (each maximal run of
    loss-masked tokens, in record order), reading only the id and mask columns, not the hidden
    states. ``tokenizer_hash``: refuse shards tokenized by another tokenizer (their ids would be
    another vocabulary's)."""
    data_dir = Path(data_dir)
    manifest = load_manifest(data_dir)
    found = manifest["meta"].get("tokenizer_hash")
    if tokenizer_hash is not None and found != tokenizer_hash:
        raise RecordMismatchError(f"{data_dir / MANIFEST}: written with another tokenizer (hash {found!r}, this "
                                  f"target's is {tokenizer_hash!r}); point at rollouts of this target")
    for shard in manifest["shards"]:
        path = data_dir / shard["name"]
        for ids, mask in _ids_and_masks(path):
            yield from _masked_runs(ids, mask)


def _ids_and_masks(path: Path) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(input_ids [T], loss_mask [T]) of each record of one shard, either format."""
    if path.is_file():
        import ray.air.util.tensor_extensions.arrow  # noqa: F401  (as _read_parquet: the tensor types)

        batch = table_to_batch(pq.read_table(path, columns=["input_ids", "loss_mask"]))
        yield from zip(batch["input_ids"], batch["loss_mask"])
        return
    from safetensors import safe_open

    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="numpy") as st:
            yield st.get_tensor("input_ids"), st.get_tensor("loss_mask")


def _masked_runs(ids: np.ndarray, mask: np.ndarray) -> Iterator[list[int]]:
    """Each maximal run of ids where mask is set, as a list."""
    on = np.flatnonzero(np.diff(np.concatenate([[0], (mask != 0).astype(np.int8), [0]])))
    for start, end in zip(on[::2], on[1::2]):
        yield ids[start:end].tolist()


def find_rollouts(setting: str | None, candidates: Sequence[str | None], key: str) -> Path | None:
    """The data directory a ``suffix_rollouts``-style ``key`` names: None for ``none`` (or null);
    for ``auto`` the first of ``candidates`` that holds a manifest (None when none does); else
    ``setting`` itself, which must hold one (a FileNotFoundError naming ``key`` otherwise)."""
    if setting in (None, "none"):
        return None
    if setting == "auto":
        return next((Path(c) for c in candidates if c and (Path(c) / MANIFEST).is_file()), None)
    if not (Path(setting) / MANIFEST).is_file():
        raise FileNotFoundError(f"{key}: {setting} holds no {MANIFEST} (point it at a data stage's output "
                                "directory in shards mode, or set it to auto or none)")
    return Path(setting)
