"""Online training input: the data stage's rollout stream (Ray Data actors generating while 2 Ray
Train workers train on it), and the resource check that replaces the hang when both cannot fit."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from components.config import ConfigError, SpeclineConfig, TrainConfig
from components.drafters import build_drafter, load_drafter
from components.tracking import Tracker
from components.training.inputs import check_stream_resources
from pipelines import train
from tests.pipelines.conftest import TRAIN_DATA, TRAIN_DRAFTER

STREAM = dataclasses.replace(TRAIN_DATA, mode="stream")
# 10 prompts, 2 held out: 8 streamed records = 4 per worker = 2 batches (steps) per epoch; every
# epoch streams (regenerates) them again, so one epoch keeps the test short.
TRAIN = TrainConfig(num_workers=2, cpus_per_worker=0.5, batch_size=2, max_steps=2, lr=5e-3, warmup_steps=1,
                    log_every=1, checkpoint_every=2, eval_fraction=0.2, eval_batch_size=4, max_failures=0)


def _cfg(tmp_path: Path, tiny_target_cfg, **train_keys) -> SpeclineConfig:
    tc = dataclasses.replace(TRAIN, output_dir=str(tmp_path / "runs" / "train"), **train_keys)
    return SpeclineConfig(run_dir=str(tmp_path / "runs"), target=tiny_target_cfg, data=STREAM,
                          drafter=TRAIN_DRAFTER, train=tc)


def test_stream_resources_must_fit_beside_the_train_workers(tmp_path, tiny_target_cfg):
    cfg = _cfg(tmp_path, tiny_target_cfg, cpus_per_worker=1.0)
    with pytest.raises(ConfigError, match=r"train\.num_workers × train\.cpus_per_worker \(2 × 1\.0\) \+ "
                                          r"data\.num_actors × data\.cpus_per_actor \(1 × 0\.5\) = 2\.5 CPUs.*has 2"):
        check_stream_resources(cfg, {"CPU": 2.0})
    check_stream_resources(_cfg(tmp_path, tiny_target_cfg), {"CPU": 2.0})  # 2 × 0.5 + 0.5 fits
    with pytest.raises(ConfigError, match="GPUs"):
        check_stream_resources(_cfg(tmp_path, tiny_target_cfg, use_gpu=True), {"CPU": 8.0, "GPU": 1.0})


@pytest.mark.slow
def test_training_on_the_rollout_stream_end_to_end(tmp_path, tiny_target_cfg, tiny_target, tiny_target_build,
                                                   ray_session):
    cfg = _cfg(tmp_path, tiny_target_cfg)
    tracker = Tracker(cfg)
    with tracker.run("train-stream"):
        out = train.run(cfg, tracker, {})
    (offline,) = out["train_objectives"]
    assert offline["steps"] == 2 and offline["tokens_per_s"] > 0
    assert torch.isfinite(torch.tensor([offline["loss_first"], offline["loss_last"]])).all()
    drafter = load_drafter(out["drafter_path"], tiny_target)
    torch.manual_seed(cfg.train.seed)  # the drafter the stage started from
    fresh = build_drafter(cfg.drafter, tiny_target)
    assert any(not torch.equal(a, b) for a, b in zip(drafter.parameters(), fresh.parameters()))  # trained
    assert out["heldout_tau"] >= 1 and len(out["heldout_alpha"]) == 4  # held-out prompts rolled out too
    assert not (tmp_path / "runs" / "data").exists()  # nothing written by the data stage
    params = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}").get_run(out["train_run_id"]).data.params
    assert params["train.input"] == "stream" and params["train.num_train_records"] == "8"
    assert params["train.num_heldout_records"] == "2"
