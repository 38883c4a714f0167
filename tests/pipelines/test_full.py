"""The pipeline as a new user starts it: from a fresh working directory with the default relative
``run_dir``, data → train through Ray Train with 2 workers and a reduced draft vocabulary (the
default conf's shape). Ray Train's workers run in directories of Ray's own; every path they read
must be the driver's."""

from __future__ import annotations

import dataclasses
import json
import signal
from pathlib import Path

import pytest

from components.confload import load
from components.tracking import Tracker
from pipelines import full

pytestmark = pytest.mark.slow

SMALL = ["stages=[data,train]", "data.max_prompts=10", "data.max_new_tokens=12", "data.batch_size=5",
         "data.shard_size=5", "data.num_actors=1", "data.cpus_per_actor=0.5",
         "drafter.block_size=4", "drafter.num_anchors=16", "drafter.markov_rank=8", "drafter.draft_vocab_size=128",
         "train.num_workers=2", "train.cpus_per_worker=0.5", "train.batch_size=2", "train.max_steps=2",
         "train.warmup_steps=1", "train.log_every=1", "train.checkpoint_every=2", "train.eval_fraction=0.2",
         "train.max_failures=0", "eval.num_prompts=1"]


def test_data_then_train_from_a_fresh_directory_with_the_default_relative_run_dir(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_target_cfg, tiny_target_build, ray_session):
    clone = tmp_path / "clone"
    clone.mkdir()
    monkeypatch.chdir(clone)
    cfg = load("dspark.yaml", SMALL)
    assert cfg.run_dir == str(clone / "runs")  # the default run_dir: relative, made absolute here
    cfg = dataclasses.replace(cfg, target=tiny_target_cfg)
    tracker = Tracker(cfg)
    ctrl_c = signal.getsignal(signal.SIGINT)
    with tracker.run("pipeline"):
        out = full.run(cfg, tracker, {})
    assert signal.getsignal(signal.SIGINT) is ctrl_c  # Ray Train's handler would swallow the serve stage's Ctrl-C
    assert out["num_records"] == 10 and Path(out["data_dir"]) == clone / "runs" / "data"
    assert Path(out["drafter_path"]) == clone / "runs" / "train" / "drafter"
    vocab = json.loads((clone / "runs" / "train" / "draft_vocab" / "config.json").read_text())
    assert vocab["draft_vocab_size"] == 128
    drafter = json.loads((Path(out["drafter_path"]) / "config.json").read_text())
    assert drafter.get("draft_vocab_size") == 128 and out["train_steps"] == 2
