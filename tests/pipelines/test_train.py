"""The train stage on real Ray Train (2 CPU workers, gloo DDP): loss, checkpoint, MLflow, resume."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from components.config import DataConfig, DrafterConfig, SpeclineConfig, TrainConfig
from components.data.build import build_shards
from components.data.prompts import collect_prompts
from components.data.source import describe_target, output_dir
from components.drafters import load_drafter
from components.tracking import Tracker
from pipelines import train

pytestmark = pytest.mark.slow

DATA = DataConfig(max_prompts=10, max_new_tokens=12, batch_size=5, shard_size=5, storage="float16",
                  temperature=0.8, num_actors=1, cpus_per_actor=0.5)
DRAFTER = DrafterConfig(name="dspark", block_size=4, num_anchors=16, markov_rank=8)
TRAIN = TrainConfig(num_workers=2, cpus_per_worker=0.5, batch_size=2, max_steps=8, lr=5e-3, warmup_steps=1,
                    log_every=2, checkpoint_every=4, eval_fraction=0.2, eval_batch_size=4, max_failures=0)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, tiny_target_cfg, tiny_target_build, ray_session) -> Path:
    cfg = SpeclineConfig(run_dir=str(tmp_path_factory.mktemp("train-data")), target=tiny_target_cfg,
                         data=DATA, drafter=DRAFTER)
    info = describe_target(cfg)
    prompts, stats = collect_prompts(cfg.data, info.tokenizer, info.corpus_dir)
    build_shards(cfg, info, prompts, stats, output_dir(cfg))
    return output_dir(cfg)


def _cfg(tmp_path: Path, tiny_target_cfg, data_dir: Path, **train) -> SpeclineConfig:
    tc = dataclasses.replace(TRAIN, data_dir=str(data_dir), output_dir=str(tmp_path / "runs" / "train"), **train)
    return SpeclineConfig(run_dir=str(tmp_path / "runs"), target=tiny_target_cfg, data=DATA, drafter=DRAFTER, train=tc)


def test_two_workers_lower_the_loss_and_write_a_loadable_drafter(tmp_path, tiny_target_cfg, tiny_target,
                                                                   data_dir, ray_session):
    cfg = _cfg(tmp_path, tiny_target_cfg, data_dir)
    tracker = Tracker(cfg)
    with tracker.run("train"):
        out = train.run(cfg, tracker, {})
    assert out["train_steps"] == 8 and out["train_loss_last"] < out["train_loss_first"], out
    assert out["train_tokens_per_s"] > 0 and len(out["heldout_alpha"]) == 4 and out["heldout_tau"] >= 1
    drafter = load_drafter(out["drafter_path"], tiny_target)
    assert drafter.num_parameters() > 0 and Path(out["plot"]).is_file()

    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    stage = client.get_run(out["train_run_id"])
    for key in ("heldout/tau", "heldout/sim_tau", "heldout/alpha/1", "heldout/sim_alpha/1", "heldout_init/tau",
                "train_seconds"):
        assert key in stage.data.metrics, key
    offline = out["train_objectives"][0]
    run = client.get_run(offline["run_id"])  # the objective's nested run
    assert run.data.tags["mlflow.parentRunId"] == out["train_run_id"]
    for key in ("train/loss", "train/lr", "train/tokens_per_s", "train/alpha/1", "train/tau", "heldout/tau"):
        assert key in run.data.metrics, key
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [2, 4, 6, 8]
    logged = {a.path for a in client.list_artifacts(out["train_run_id"], "train")}
    assert {"train/drafter", "train/plots", "train/summary.json"} <= logged
    version = client.get_model_version("specline-drafter", str(out["registered_version"]))
    assert version.run_id == out["train_run_id"] and version.tags["drafter"] == "dspark"

    assert sorted(p.name for p in (tmp_path / "runs" / "train" / "offline").glob("checkpoint_*"))  # Ray storage

    # The same run again with more steps resumes at step 8 (same name + storage path): only
    # steps 9..10 are trained, so the only loss logged is step 10's; the first loss is the old one.
    again = _cfg(tmp_path, tiny_target_cfg, data_dir, max_steps=10)
    tracker = Tracker(again)
    with tracker.run("train-resumed"):
        resumed = train.run(again, tracker, {})
    assert resumed["train_steps"] == 10 and resumed["train_loss_first"] == out["train_loss_first"]
    resumed_run = resumed["train_objectives"][0]["run_id"]
    assert [m.step for m in client.get_metric_history(resumed_run, "train/loss")] == [10]
    assert json.loads((Path(resumed["drafter_path"]) / "config.json").read_text())["name"] == "dspark"
    assert resumed["registered_version"] == out["registered_version"] + 1


def test_objectives_chain_offline_then_opd(tmp_path, tiny_target_cfg, tiny_target, data_dir, ray_session):
    cfg = _cfg(tmp_path, tiny_target_cfg, data_dir, max_steps=4, checkpoint_every=4, objectives=["offline", "opd"],
               per_objective={"opd": {"lr": 1e-3, "max_anchors": 4}})
    tracker = Tracker(cfg)
    with tracker.run("train"):
        out = train.run(cfg, tracker, {})
    offline, opd = out["train_objectives"]
    assert (offline["objective"], opd["objective"]) == ("offline", "opd") and opd["steps"] == 4
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    params = client.get_run(opd["run_id"]).data.params
    assert params["init_drafter"] == offline["drafter_path"] and params["train.loss"] == "opd"
    assert params["objective.max_anchors"] == "4" and params["train.lr"] == "0.001"
    assert "train/rev_kl" in client.get_run(opd["run_id"]).data.metrics
    first, second = load_drafter(offline["drafter_path"], tiny_target), load_drafter(out["drafter_path"], tiny_target)
    assert any(not torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters()))
    summary = json.loads((tmp_path / "runs" / "train" / "drafters" / "opd" / "config.json").read_text())
    assert summary["name"] == "dspark" and out["heldout_sim_tau"] >= 1.0
