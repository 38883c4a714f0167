"""Records: layer defaults, compression, arrow/safetensors round trips, meta checks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from components.data.prompts import Prompt
from components.data.records import (
    Record,
    RecordMeta,
    RecordMismatchError,
    batch_to_records,
    check_meta,
    decode,
    encode,
    record_bytes_per_token,
    records_to_table,
    select_layers,
    split_rows,
    table_to_batch,
    table_to_records,
)
from components.data.shards import (
    MANIFEST,
    ShardSpec,
    find_rollouts,
    read_responses,
    read_shard,
    read_table,
    write_manifest,
    write_shard,
)
from components.drafters.base import TargetInfo

META = RecordMeta("t", "abc", (0, 2), 3, 8, "float16")


def _record(i: int, T: int, storage: str = "float16") -> Record:
    rng = np.random.default_rng(i)
    h, hs = encode(rng.standard_normal((T, 2, 8)).astype(np.float32), storage)
    lh, ls = encode(rng.standard_normal((T, 8)).astype(np.float32), storage)
    mask = np.zeros(T, np.uint8)
    mask[T // 2:] = 1
    return Record(f"s{i}", np.arange(T, dtype=np.int32), mask, h, lh, hs, ls, T // 2, i)


def test_int8_storage_is_smaller_and_close():
    x = np.random.default_rng(0).standard_normal((5, 3, 64)).astype(np.float32) * 4
    q, s = encode(x, "int8")
    assert q.dtype == np.int8 and s.shape == (5, 3)
    assert np.abs(decode(q, s) - x).max() <= np.abs(x).max() / 127
    f16 = record_bytes_per_token(META)
    i8 = record_bytes_per_token(RecordMeta("t", "abc", (0, 2), 3, 8, "int8"))
    assert i8 < f16 and f16 == 3 * 8 * 2


@pytest.mark.parametrize("storage", ["float16", "int8"])
def test_arrow_round_trip_is_bit_identical(storage):
    records = [_record(0, 5, storage), _record(1, 9, storage)]
    back = batch_to_records(table_to_batch(records_to_table(records)))
    assert all(a.equals(b) for a, b in zip(records, back))


@pytest.mark.parametrize("fmt", ["parquet", "safetensors"])
def test_shard_formats_round_trip(tmp_path, fmt):
    records = [_record(i, 4 + i, "int8") for i in range(3)]
    meta = RecordMeta("t", "abc", (0, 2), 3, 8, "int8")
    spec = ShardSpec(0, tuple(Prompt(r.sample_id, (), r.seed) for r in records))
    summary = write_shard(tmp_path, spec, records, meta, "plan", fmt)
    assert summary["records"] == 3 and summary["tokens"] == 4 + 5 + 6
    assert not list(tmp_path.glob(".*"))  # nothing temporary left
    back = read_shard(tmp_path / summary["name"], expect=meta)
    assert all(a.equals(b) for a, b in zip(records, back))
    table = read_table(tmp_path / summary["name"], expect=meta)  # the same records as arrow rows
    assert all(a.equals(b) for a, b in zip(records, table_to_records(table)))
    with pytest.raises(RecordMismatchError, match="storage is 'int8', expected 'float16'"):
        read_table(tmp_path / summary["name"], expect=dataclasses.replace(meta, storage="float16"))


def test_split_rows_keeps_order_and_parts():
    table = records_to_table([_record(i, 3) for i in range(5)])
    rest, chosen = split_rows(table, {"s3", "s1", "zz"})
    assert rest["sample_id"].to_pylist() == ["s0", "s2", "s4"] and chosen["sample_id"].to_pylist() == ["s1", "s3"]
    assert [r.sample_id for r in table_to_records(chosen)] == ["s1", "s3"]


def test_meta_of_a_target_is_the_one_constructor():
    target = TargetInfo("t", "abc", hidden_size=8, vocab_size=100, num_layers=4)
    assert RecordMeta.of(target, [0, 2], "float16") == RecordMeta("t", "abc", (0, 2), 3, 8, "float16")


def test_meta_mismatch_names_every_field():
    other = RecordMeta("u", "abc", (1,), 3, 8, "float16")
    with pytest.raises(RecordMismatchError, match=r"where: .*target is 'u', expected 't'; layer_ids is \(1,\)"):
        check_meta(other, META, "where")
    check_meta(META, RecordMeta.from_dict(META.to_dict()), "same")


@pytest.mark.parametrize("storage", ["float16", "int8"])
def test_select_layers_keeps_the_wanted_taps_in_order(storage):
    recs = [_record(i, 6, storage) for i in range(2)]  # taps captured at layers [3, 7]
    picked = select_layers(recs, [3, 7], [7])
    for r, p in zip(recs, picked):
        assert p.hidden.shape == (6, 1, 8)
        np.testing.assert_array_equal(p.hidden_f32()[:, 0], r.hidden_f32()[:, 1])
        np.testing.assert_array_equal(p.last_hidden, r.last_hidden)
    assert select_layers(recs, [3, 7], [3, 7])[0].equals(recs[0])


def test_select_layers_names_a_layer_not_captured():
    with pytest.raises(RecordMismatchError, match=r"layers \[5\] were not captured"):
        select_layers([_record(0, 4)], [3, 7], [3, 5])


@pytest.mark.parametrize("fmt", ["parquet", "safetensors"])
def test_responses_are_the_masked_runs_of_every_record_in_manifest_order(tmp_path, fmt):
    """Suffix decoding's warm start reads only ids and masks: each maximal masked run, in order."""
    records = [_record(i, 6 + i) for i in range(3)]
    records[1].loss_mask[:] = [0, 1, 1, 0, 0, 1, 1]  # two turns' responses in one record
    meta = RecordMeta("t", "abc", (0, 2), 3, 8, "float16")
    halves = [records[:2], records[2:]]
    shards = [write_shard(tmp_path, ShardSpec(k, ()), part, meta, "plan", fmt) for k, part in enumerate(halves)]
    write_manifest(tmp_path, meta, "plan", fmt, shards, {})
    got = list(read_responses(tmp_path, tokenizer_hash="abc"))
    assert got == [[3, 4, 5], [1, 2], [5, 6], [4, 5, 6, 7]]
    with pytest.raises(RecordMismatchError, match="another tokenizer"):
        list(read_responses(tmp_path, tokenizer_hash="other"))


def test_find_rollouts_auto_takes_the_first_directory_with_a_manifest(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / MANIFEST).write_text("{}")
    empty = tmp_path / "empty"
    assert find_rollouts("auto", [None, str(empty), str(data)], "eval.suffix_rollouts") == data
    assert find_rollouts("auto", [str(empty)], "eval.suffix_rollouts") is None
    assert find_rollouts("none", [str(data)], "eval.suffix_rollouts") is None
    assert find_rollouts(str(data), [], "eval.suffix_rollouts") == data
    with pytest.raises(FileNotFoundError, match="eval.suffix_rollouts: .*empty holds no manifest.json"):
        find_rollouts(str(empty), [], "eval.suffix_rollouts")


def rollout_dir(path: Path, tokenizer_hash: str, responses: list[list[int]]) -> Path:
    """A data directory (one parquet shard + manifest) of one record per response: two prompt
    tokens, then the response's ids, loss-masked."""
    meta = RecordMeta("t", tokenizer_hash, (0,), 1, 2, "float32")
    records = [Record(f"s{i}", np.array([1, 2, *r], np.int32), np.array([0, 0] + [1] * len(r), np.uint8),
                      np.zeros((len(r) + 2, 1, 2), np.float32), np.zeros((len(r) + 2, 2), np.float32), prompt_len=2)
               for i, r in enumerate(responses)]
    path.mkdir(parents=True)
    write_manifest(path, meta, "p", "parquet", [write_shard(path, ShardSpec(0, ()), records, meta, "p", "parquet")], {})
    return path
