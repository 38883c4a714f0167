"""The train stage on real Ray Train (2 CPU workers, gloo DDP or FSDP): loss, checkpoint, MLflow,
resume, and training from either shard format."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from components.config import SpeclineConfig, TrainConfig
from components.drafters import build_drafter, load_drafter
from components.tracking import Tracker
from components.training.resume import read_trainer_state
from pipelines import train
from tests.components.data.test_data_shards import copy_as_safetensors
from tests.pipelines.conftest import TRAIN_DATA, TRAIN_DRAFTER

pytestmark = pytest.mark.slow

DATA = TRAIN_DATA
DRAFTER = TRAIN_DRAFTER
TRAIN = TrainConfig(num_workers=2, cpus_per_worker=0.5, batch_size=2, max_steps=8, lr=5e-3, warmup_steps=1,
                    log_every=2, checkpoint_every=4, eval_fraction=0.2, eval_batch_size=4, max_failures=0)


@pytest.fixture
def data_dir(train_data_dir) -> Path:
    return train_data_dir


def _initial(cfg: SpeclineConfig, target):
    """The drafter the stage starts from (the same seed as the stage and its workers)."""
    torch.manual_seed(cfg.train.seed)
    return build_drafter(cfg.drafter, target)


def _trained(drafter, before) -> bool:
    """Some weight moved (whether the loss fell after a few steps depends on the fixture target,
    which comes out differently on another CPU; the step's own descent is tested in-process)."""
    return any(not torch.equal(a, b) for a, b in zip(drafter.parameters(), before.parameters()))


def _cfg(tmp_path: Path, tiny_target_cfg, data_dir: Path, **train) -> SpeclineConfig:
    tc = dataclasses.replace(TRAIN, data_dir=str(data_dir), output_dir=str(tmp_path / "runs" / "train"), **train)
    return SpeclineConfig(run_dir=str(tmp_path / "runs"), target=tiny_target_cfg, data=DATA, drafter=DRAFTER, train=tc)


def test_chain_offline_then_opd_on_two_workers_resumes_and_registers(tmp_path, tiny_target_cfg, tiny_target,
                                                                     data_dir, ray_session):
    chain = {"objectives": ["offline", "opd"], "per_objective": {"opd": {"max_steps": 4, "lr": 1e-3, "max_anchors": 4}}}
    cfg = _cfg(tmp_path, tiny_target_cfg, data_dir, **chain)
    tracker = Tracker(cfg)
    with tracker.run("train"):
        out = train.run(cfg, tracker, {})
    offline, opd = out["train_objectives"]
    assert offline["steps"] == 8 and math.isfinite(offline["loss_first"]) and math.isfinite(offline["loss_last"])
    assert opd["steps"] == out["train_steps"] == 4 and offline["tokens_per_s"] > 0
    assert len(out["heldout_alpha"]) == 4 and out["heldout_tau"] >= 1 and out["heldout_sim_tau"] >= 1
    first, final = load_drafter(offline["drafter_path"], tiny_target), load_drafter(out["drafter_path"], tiny_target)
    assert _trained(first, _initial(cfg, tiny_target))  # offline trained the fresh drafter
    assert _trained(final, first)  # opd trained offline's
    assert Path(out["plot"]).is_file()

    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    stage = client.get_run(out["train_run_id"])
    for key in ("heldout/tau", "heldout/sim_tau", "heldout/alpha/1", "heldout/sim_alpha/1", "heldout_init/tau",
                "train_seconds"):
        assert key in stage.data.metrics, key
    run = client.get_run(offline["run_id"])  # each objective has its own nested run
    assert run.data.tags["mlflow.parentRunId"] == out["train_run_id"]
    for key in ("train/loss", "train/lr", "train/tokens_per_s", "train/alpha/1", "train/tau", "heldout/tau"):
        assert key in run.data.metrics, key
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [2, 4, 6, 8]
    params = client.get_run(opd["run_id"]).data.params
    assert params["init_drafter"] == offline["drafter_path"] and params["train.loss"] == "opd"
    assert params["objective.max_anchors"] == "4" and params["train.lr"] == "0.001"
    assert "train/rev_kl" in client.get_run(opd["run_id"]).data.metrics
    logged = {a.path for a in client.list_artifacts(out["train_run_id"], "train")}
    assert {"train/drafter", "train/plots", "train/summary.json"} <= logged
    version = client.get_model_version("specline-drafter", str(out["registered_version"]))
    assert version.run_id == out["train_run_id"] and version.tags["objectives"] == "offline,opd"

    storage = tmp_path / "runs" / "train"
    assert sorted(p.name for p in (storage / "offline").glob("checkpoint_*"))  # Ray storage
    assert len(list(storage.glob("opd-from-*"))) == 1

    # Again with more offline steps: offline resumes at step 8 (same name + storage path), so only
    # step 10's loss is logged and the first loss is the old one; opd starts from a different
    # drafter now, so it trains afresh in a new run instead of resuming the stale one.
    again = _cfg(tmp_path, tiny_target_cfg, data_dir, max_steps=10, **chain)
    tracker = Tracker(again)
    with tracker.run("train-resumed"):
        resumed = train.run(again, tracker, {})
    offline2, opd2 = resumed["train_objectives"]
    assert offline2["steps"] == 10 and offline2["loss_first"] == offline["loss_first"]
    assert [m.step for m in client.get_metric_history(offline2["run_id"], "train/loss")] == [10]
    assert [m.step for m in client.get_metric_history(opd2["run_id"], "train/loss")] == [2, 4]
    assert len(list(storage.glob("opd-from-*"))) == 2
    assert json.loads((Path(resumed["drafter_path"]) / "config.json").read_text())["name"] == "dspark"
    assert resumed["registered_version"] == out["registered_version"] + 1


def test_fsdp_on_two_workers_trains_and_writes_a_loadable_drafter(tmp_path, tiny_target_cfg, tiny_target,
                                                                          data_dir, ray_session):
    """One short FSDP run (the sharded resume itself: tests/components/training/test_sharding.py;
    the Ray resume path is the one the DDP test above takes)."""
    cfg = _cfg(tmp_path, tiny_target_cfg, data_dir, strategy="fsdp", max_steps=6, log_every=3, checkpoint_every=3)
    tracker = Tracker(cfg)
    with tracker.run("train-fsdp"):
        out = train.run(cfg, tracker, {})
    (offline,) = out["train_objectives"]
    assert offline["steps"] == 6 and math.isfinite(offline["loss_first"]) and math.isfinite(offline["loss_last"])
    drafter = load_drafter(out["drafter_path"], tiny_target)  # the ordinary drafter format, full tensors
    fresh = _initial(cfg, tiny_target)
    assert drafter.state_dict().keys() == fresh.state_dict().keys()
    assert all(a.shape == b.shape for a, b in zip(drafter.state_dict().values(), fresh.state_dict().values()))
    assert _trained(drafter, fresh)
    ckpt = Path(offline["checkpoint"])
    assert read_trainer_state(ckpt)["step"] == 6 and (ckpt / "optimizer.safetensors").is_file()
    assert out["heldout_tau"] >= 1


def test_training_from_safetensors_shards(tmp_path, tiny_target_cfg, tiny_target, data_dir, ray_session):
    """``data.format=safetensors`` shards are directories of per-record files: the stage reads them
    with the same reader as parquet and trains on the same split."""
    st_dir = copy_as_safetensors(data_dir, tmp_path / "data-safetensors")
    cfg = _cfg(tmp_path, tiny_target_cfg, st_dir, max_steps=2, log_every=1, checkpoint_every=2, register_as="")
    tracker = Tracker(cfg)
    with tracker.run("train-safetensors"):
        out = train.run(cfg, tracker, {})
    assert out["train_steps"] == 2 and out["registered_version"] is None
    assert _trained(load_drafter(out["drafter_path"], tiny_target), _initial(cfg, tiny_target))
    assert len(out["heldout_alpha"]) == 4 and out["heldout_tau"] >= 1
    params = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}").get_run(out["train_run_id"]).data.params
    assert (params["train.input"], params["train.num_train_records"], params["train.num_heldout_records"]) == \
        ("shards", "8", "2")
