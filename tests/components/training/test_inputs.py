"""The train stage's shard input: either shard format gives the same training rows and held-out
records, every record is in exactly one of them, and shards of another layer set are refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from components.config import ConfigError, DataConfig, DrafterConfig, SpeclineConfig, TrainConfig
from components.data.records import RecordMeta, RecordMismatchError
from components.drafters import build_drafter
from components.training import heldout_ids
from components.training.inputs import shard_inputs, train_inputs
from tests.components.data.test_data_shards import write_shards
from tests.components.training.test_training_steps import _record

DRAFTER = DrafterConfig(name="dspark", block_size=4, num_anchors=8, markov_rank=8)
CFG = SpeclineConfig(drafter=DRAFTER, train=TrainConfig(eval_fraction=0.25))


@pytest.fixture(scope="module")
def shards(tiny_target, tmp_path_factory):
    """(layer ids, records, {format: data dir}) of 8 records in 3 shards per format."""
    torch.manual_seed(0)
    layer_ids = build_drafter(DRAFTER, tiny_target).layer_ids
    records = [_record(tiny_target, layer_ids, n, 3, i, "float16") for i, n in enumerate([9, 12, 7, 10, 8, 11, 9, 6])]
    meta = RecordMeta.of(tiny_target, layer_ids, "float16")
    root = tmp_path_factory.mktemp("inputs")
    dirs = {fmt: write_shards(root / fmt, records, meta, fmt, shard_size=3) for fmt in ("parquet", "safetensors")}
    return layer_ids, records, dirs


def _rows(dataset) -> dict[str, dict[str, np.ndarray]]:
    return {row["sample_id"]: row for row in dataset.take_all()}


def test_either_shard_format_gives_the_same_split(tiny_target, shards, ray_session):
    layer_ids, records, dirs = shards
    held = heldout_ids([r.sample_id for r in records], CFG.train.eval_fraction, CFG.train.seed)
    by_id = {r.sample_id: r for r in records}
    parquet, safetensors = (shard_inputs(CFG, dirs[fmt], tiny_target, layer_ids) for fmt in ("parquet", "safetensors"))
    for inputs in (parquet, safetensors):
        assert inputs.source == "shards" and inputs.num_train == len(records) - len(held) == 6
        assert [r.sample_id for r in inputs.heldout] == [r.sample_id for r in records if r.sample_id in held]
        assert all(r.equals(by_id[r.sample_id]) for r in inputs.heldout)
    rows, other = _rows(parquet.dataset), _rows(safetensors.dataset)
    assert set(rows) == set(other) == set(by_id) - held
    for sid, row in rows.items():
        for col in ("input_ids", "loss_mask", "hidden", "last_hidden"):
            want = getattr(by_id[sid], col)
            assert np.array_equal(row[col], want) and np.array_equal(other[sid][col], want), (sid, col)


def test_a_drafter_reading_some_of_the_captured_taps_gets_just_those(tiny_target, shards, ray_session):
    """Rollouts captured for a drafter of three taps train one that reads two of them (in its own
    order): the same split, each row's hidden states those taps' and nothing else changed."""
    layer_ids, records, dirs = shards
    wanted = [layer_ids[2], layer_ids[0]]
    inputs = shard_inputs(CFG, dirs["parquet"], tiny_target, wanted)
    by_id = {r.sample_id: r for r in records}
    for r in inputs.heldout:
        assert np.array_equal(r.hidden, by_id[r.sample_id].hidden[:, [2, 0]])
    rows = _rows(inputs.dataset)
    assert len(rows) == inputs.num_train == 6
    for sid, row in rows.items():
        assert np.array_equal(row["hidden"], by_id[sid].hidden[:, [2, 0]])
        assert np.array_equal(row["last_hidden"], by_id[sid].last_hidden)


def test_shards_of_another_layer_set_or_no_data_are_refused(tiny_target, shards):
    layer_ids, _, dirs = shards
    for path in dirs.values():
        with pytest.raises(RecordMismatchError, match=r"layer_ids is .*, expected \(0, 9\)"):
            shard_inputs(CFG, path, tiny_target, [0, 9])  # layer 9 was not captured
    no_data = dataclasses.replace(CFG, data=DataConfig(mode="shards"))
    with pytest.raises(ConfigError, match="train: no data; set train.data_dir"):
        train_inputs(no_data, {}, tiny_target, layer_ids)
