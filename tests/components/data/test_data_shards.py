"""End to end on the fixture target under Ray: shards, crash + rerun, stream, either shard
format as Ray Data rows, mismatch refusal."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import pytest

from components.config import DataConfig, SpeclineConfig
from components.data.actors import Tally
from components.data.build import build_shards
from components.data.prompts import collect_prompts
from components.data.records import Record, RecordMeta, RecordMismatchError, batch_to_records
from components.data.rollout import Roller
from components.data.shards import (
    MANIFEST,
    ShardSpec,
    load_manifest,
    read_records,
    read_shard,
    read_tables,
    write_manifest,
    write_shard,
)
from components.data.source import describe_target, record_meta
from components.data.stream import rollout_stream

pytestmark = pytest.mark.slow

SMALL = DataConfig(max_prompts=6, max_new_tokens=8, batch_size=2, shard_size=2, storage="float32",
                   num_actors=1, cpus_per_actor=0.5)


def write_shards(out: Path, records: list[Record], meta: RecordMeta, fmt: str, shard_size: int,
                 plan: str = "test") -> Path:
    """``records`` as the data stage lays them out in format ``fmt``: shards + manifest."""
    out.mkdir(parents=True, exist_ok=True)
    chunks = [records[i:i + shard_size] for i in range(0, len(records), shard_size)]
    summaries = [write_shard(out, ShardSpec(k, ()), part, meta, plan, fmt) for k, part in enumerate(chunks)]
    write_manifest(out, meta, plan, fmt, summaries, {})
    return out


def copy_as_safetensors(src: Path, dst: Path) -> Path:
    """The data stage's shards under ``src`` rewritten with ``data.format=safetensors`` under ``dst``."""
    manifest = load_manifest(src)
    records = [r for s in manifest["shards"] for r in read_shard(src / s["name"])]
    size = max(s["records"] for s in manifest["shards"])
    return write_shards(dst, records, RecordMeta.from_dict(manifest["meta"]), "safetensors", size, manifest["plan_id"])


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_target_cfg, tiny_target_build, ray_session):
    """(cfg, desc, prompts, manifest) of one shards-mode run, shared by this module's tests."""
    cfg = SpeclineConfig(run_dir=str(tmp_path_factory.mktemp("data") / "runs"), target=tiny_target_cfg, data=SMALL)
    desc = describe_target(cfg)
    prompts, stats = collect_prompts(cfg.data, desc.tokenizer, desc.corpus_dir)
    lines: list[str] = []
    manifest = build_shards(cfg, desc, prompts, stats, Path(cfg.data.output_dir), lines=lines.append)
    manifest["progress_lines"] = lines  # (for the test below; not written anywhere)
    return cfg, desc, prompts, manifest


def test_progress_lines_count_every_record_and_token_over_the_actors(built):
    *_, manifest = built
    totals, lines = manifest["totals"], manifest["progress_lines"]
    assert lines and lines[-1].startswith(f"data: {totals['records']}/{totals['records']} records, "
                                          f"{totals['tokens']:,} tokens, ")
    done = [int(line.split()[1].split("/")[0]) for line in lines]
    assert done == sorted(set(done))  # shown when more records are done, never twice or backwards


def test_tally_sums_batches_into_one_line():
    tally = Tally(10, started=time.time() - 2.0)
    assert tally.progress()[0] == 0
    tally.add(4, 400)
    tally.add(2, 150)
    done, line = tally.progress()
    assert done == 6 and line.startswith("data: 6/10 records, 550 tokens, ") and line.endswith(" tok/s")
    assert 200 <= int(line.split()[-2]) <= 275  # 550 tokens over about 2 s


def _by_id(records):
    out = {r.sample_id: r for r in records}
    assert len(out) == len(records), "duplicate sample ids"
    return out


def test_shards_read_back_bit_identical_to_the_rollouts(built):
    cfg, desc, prompts, manifest = built
    assert manifest["totals"]["records"] == len(prompts) == 6 and len(manifest["shards"]) == 3
    assert manifest["totals"]["bytes_per_token"] > 0 and manifest["schema"]["hidden"].startswith("float32")
    read = list(read_records(Path(cfg.data.output_dir), expect=record_meta(cfg, desc), verify=True))
    direct = Roller(desc.target_cfg, cfg.data, record_meta(cfg, desc))(prompts)  # same batches, in process
    assert [r.sample_id for r in read] == [p.prompt_id for p in prompts]
    for got, want in zip(read, direct):
        assert got.equals(want), got.sample_id
        assert got.loss_mask.sum() == got.num_tokens - got.prompt_len > 0
        assert got.hidden.shape == (got.num_tokens, len(record_meta(cfg, desc).layer_ids), desc.info.hidden_size)


def test_crash_mid_write_then_rerun_completes_without_duplicates(built):
    cfg, desc, prompts, manifest = built
    out = Path(cfg.data.output_dir)
    before = {r.sample_id: r for r in read_records(out)}
    kept = out / manifest["shards"][0]["name"]
    kept_stat = kept.stat()
    # The crash: shard 1 never finished (only a temporary file), the manifest was never written.
    victim = out / manifest["shards"][1]["name"]
    victim.rename(out / f".{victim.name}.tmp-deadbeef")
    (out / MANIFEST).unlink()
    again = build_shards(cfg, desc, prompts, collect_prompts(cfg.data, desc.tokenizer, desc.corpus_dir)[1], out)
    assert again["run"] == {**again["run"], "shards_reused": 2, "shards_written": 1, "partial_removed": 1}
    assert kept.stat().st_mtime_ns == kept_stat.st_mtime_ns  # finished shards are not rewritten
    assert not list(out.glob(".*tmp*")) and len(list(out.glob("shard-*"))) == 3
    after = _by_id(list(read_records(out, verify=True)))
    assert set(after) == set(before) and all(after[k].equals(before[k]) for k in before)
    assert [s["sha256"] for s in again["shards"]] == [s["sha256"] for s in manifest["shards"]]


def test_stream_yields_the_same_records_as_shards(built):
    cfg, desc, prompts, _ = built
    stream = rollout_stream(cfg, desc, prompts)
    assert stream.meta == record_meta(cfg, desc)
    rows = stream.dataset.take_all()
    batch = {k: [row[k] for row in rows] for k in rows[0]}
    streamed = _by_id(batch_to_records(batch))
    shards = _by_id(list(read_records(Path(cfg.data.output_dir))))
    assert set(streamed) == set(shards)
    for sid, rec in shards.items():
        assert rec.equals(streamed[sid]), sid


def test_either_format_reads_back_as_the_same_ray_dataset(built, tmp_path):
    """What the train stage does with shards (components/training/inputs.py), for both formats."""
    import ray.data

    cfg, desc, prompts, _ = built
    meta = record_meta(cfg, desc)
    dirs = {"parquet": Path(cfg.data.output_dir), "safetensors": copy_as_safetensors(Path(cfg.data.output_dir), tmp_path / "st")}
    rows = {fmt: {r["sample_id"]: r for r in ray.data.from_arrow(read_tables(d, expect=meta)).take_all()}
            for fmt, d in dirs.items()}
    assert sorted(rows["parquet"]) == sorted(rows["safetensors"]) == sorted(p.prompt_id for p in prompts)
    for sid, row in rows["parquet"].items():
        assert row["hidden"].dtype == np.float32 and row["hidden"].ndim == 3
        assert all(np.array_equal(row[c], rows["safetensors"][sid][c]) for c in ("input_ids", "hidden", "last_hidden"))


@pytest.mark.parametrize("change, field", [
    ({"layer_ids": (0, 1)}, "layer_ids"),
    ({"tokenizer_hash": "0" * 16}, "tokenizer_hash"),
    ({"target": "/models/other"}, "target"),
    ({"storage": "int8"}, "storage"),
])
def test_reading_shards_for_another_target_is_refused(built, change, field):
    cfg, desc, _, _ = built
    other = dataclasses.replace(record_meta(cfg, desc), **change)
    with pytest.raises(RecordMismatchError, match=f"{field} is"):
        list(read_records(Path(cfg.data.output_dir), expect=other))
    with pytest.raises(RecordMismatchError, match=f"shard-00000.parquet: .*{field} is"):
        read_shard(Path(cfg.data.output_dir) / "shard-00000.parquet", expect=other)


def test_resuming_into_a_directory_of_another_layer_set_is_refused(built):
    cfg, desc, prompts, _ = built
    other = dataclasses.replace(cfg, drafter=dataclasses.replace(cfg.drafter, layer_ids=[0, 2]))
    with pytest.raises(RecordMismatchError, match="layer_ids is"):
        build_shards(other, desc, prompts, collect_prompts(cfg.data, desc.tokenizer, desc.corpus_dir)[1],
                     Path(cfg.data.output_dir))
    manifest = json.loads((Path(cfg.data.output_dir) / MANIFEST).read_text())
    assert manifest["meta"]["layer_ids"] == list(record_meta(cfg, desc).layer_ids)
