"""The train stage's draft vocabulary: counted from the training split's response tokens, given to
the initial drafter, written once and read by every worker building a fresh drafter (the same
drafter the driver evaluated); a stream is refused; simulated rounds step over draft-vocab misses."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from components.config import ConfigError, DrafterConfig, SpeclineConfig, TrainConfig
from components.data.records import RecordMeta, records_to_table
from components.drafters import DraftBatch, build_drafter
from components.training.inputs import (
    TrainInputs,
    choose_draft_vocab,
    response_counts,
    shard_inputs,
    shared_draft_vocab,
)
from components.training.loop import _drafter_and_objective
from components.training.rounds import simulate_rounds
from tests.components.data.test_data_shards import write_shards
from tests.components.training.test_training_steps import _record

DV = 40


def config(tmp_path, size: int | None = DV) -> SpeclineConfig:
    drafter = DrafterConfig(name="dspark", num_layers=1, block_size=4, markov_rank=8, draft_vocab_size=size)
    return SpeclineConfig(drafter=drafter, train=TrainConfig(output_dir=str(tmp_path / "train"), eval_fraction=0.25))


def inputs_with(counts: np.ndarray | None, source: str = "shards") -> TrainInputs:
    return TrainInputs(source, None, 6, [], counts)


def fresh(cfg: SpeclineConfig, target):
    torch.manual_seed(cfg.train.seed)  # as the train stage and every worker do
    return build_drafter(cfg.drafter, target)


def test_response_counts_count_only_loss_masked_tokens(tiny_target):
    records = [_record(tiny_target, [0, 1, 2], n, 3, i, "float16") for i, n in enumerate([9, 12, 7])]
    want = np.zeros(tiny_target.vocab_size, np.int64)
    for r in records:
        np.add.at(want, r.input_ids[r.loss_mask.astype(bool)].astype(np.int64), 1)
    got = response_counts([records_to_table(records[:2]), records_to_table(records[2:])])
    assert got.sum() == sum(int(r.loss_mask.sum()) for r in records) == want.sum()
    assert np.array_equal(np.pad(got, (0, want.shape[0] - got.shape[0])), want)


def test_shard_inputs_carry_the_training_splits_counts(tiny_target, tmp_path, ray_session):
    cfg = config(tmp_path)
    layer_ids = fresh(cfg, tiny_target).layer_ids
    records = [_record(tiny_target, layer_ids, n, 3, i, "float16") for i, n in enumerate([9, 12, 7, 10, 8, 11, 9, 6])]
    data = write_shards(tmp_path / "data", records, RecordMeta.of(tiny_target, layer_ids, "float16"), "parquet", 3)
    inputs = shard_inputs(cfg, data, tiny_target, layer_ids)
    held = {r.sample_id for r in inputs.heldout}
    train = [r for r in records if r.sample_id not in held]
    assert inputs.token_counts.sum() == sum(int(r.loss_mask.sum()) for r in train)  # the held-out split is not counted


def test_workers_build_the_drafter_the_driver_evaluated(tiny_target, tmp_path):
    cfg = config(tmp_path)
    counts = np.arange(tiny_target.vocab_size)[::-1].copy()  # low ids most frequent
    initial = choose_draft_vocab(cfg, tiny_target, fresh(cfg, tiny_target), inputs_with(counts))
    assert initial.vocab.chosen and (tmp_path / "train" / "draft_vocab" / "draft_vocab.safetensors").is_file()
    assert set(range(DV - 8)) <= set(initial.vocab.target_ids().tolist())  # the most frequent, + specials
    stage = {"init_drafter": None, "stage": {"name": "offline", "params": {}}}
    worker, _ = _drafter_and_objective(stage, cfg, tiny_target)
    mine, theirs = initial.state_dict(), worker.state_dict()
    assert set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_without_a_draft_vocab_nothing_is_chosen_or_written(tiny_target, tmp_path):
    cfg = config(tmp_path, size=None)
    d = fresh(cfg, tiny_target)
    assert choose_draft_vocab(cfg, tiny_target, d, inputs_with(None, "stream")) is d and d.vocab is None
    assert shared_draft_vocab(cfg, d) is d and not (tmp_path / "train").exists()


def test_a_stream_or_another_drafters_vocabulary_is_refused(tiny_target, tmp_path):
    cfg = config(tmp_path)
    with pytest.raises(ConfigError, match="stream input does not have .* data.mode=shards"):
        choose_draft_vocab(cfg, tiny_target, fresh(cfg, tiny_target), inputs_with(None, "stream"))
    with pytest.raises(ConfigError, match="no draft vocabulary"):
        shared_draft_vocab(cfg, fresh(cfg, tiny_target))
    choose_draft_vocab(cfg, tiny_target, fresh(cfg, tiny_target), inputs_with(np.ones(tiny_target.vocab_size)))
    other = dataclasses.replace(cfg, drafter=dataclasses.replace(cfg.drafter, draft_vocab_size=DV + 1))
    with pytest.raises(ConfigError, match=f"draft_vocab_size: written {DV}, drafter {DV + 1}"):
        shared_draft_vocab(other, fresh(other, tiny_target))


def test_simulated_rounds_step_over_a_token_outside_the_vocabulary(tiny_target):
    """A round whose first draft would need a token outside the draft vocabulary is still a round
    (0 accepted, the target supplies the token): simulation goes on to the end of the response."""
    cfg = DrafterConfig(name="dspark", num_layers=1, block_size=4, markov_rank=8, draft_vocab_size=DV)
    ids = torch.randint(5, tiny_target.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    counts = torch.ones(tiny_target.vocab_size)
    counts[ids[0, 10]] = -1  # never in the vocabulary
    torch.manual_seed(0)
    d = build_drafter(cfg, tiny_target, counts).eval()
    out = tiny_target.forward(ids, layer_ids=d.layer_ids)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 4:] = True
    rounds = simulate_rounds(d, DraftBatch(ids, out.hidden, out.last_hidden, mask))
    anchors, accepted = rounds.anchors[0], rounds.accepted[0]
    assert anchors[0] == 4 and any(a < 10 <= a + m + 1 for a, m in zip(anchors, accepted))  # a round reaches it
    assert anchors[-1] + accepted[-1] + 1 >= ids.shape[1] - 1  # and the rounds go on to the end
