"""The pipeline as a new user starts it: from a fresh working directory with the default relative
``run_dir``, data → train through Ray Train with 2 workers and a reduced draft vocabulary (the
default conf's shape) → eval → serve, one request through the official ``openai`` client; then
the same run again reuses every stage but serve, and says so. Ray Train's workers run in
directories of Ray's own; every path they read must be the driver's."""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
from pathlib import Path

import pytest

from components.confload import load
from components.tracking import Tracker
from pipelines import full
from tests.components.serving.http_util import free_port, request, wait_for

pytestmark = pytest.mark.slow

SMALL = ["stages=[data,train]", "data.max_prompts=10", "data.max_new_tokens=12", "data.batch_size=5",
         "data.shard_size=5", "data.num_actors=1", "data.cpus_per_actor=0.5",
         "drafter.block_size=4", "drafter.num_anchors=16", "drafter.markov_rank=8", "drafter.draft_vocab_size=128",
         "train.num_workers=2", "train.cpus_per_worker=0.5", "train.batch_size=2", "train.max_steps=2",
         "train.warmup_steps=1", "train.log_every=1", "train.checkpoint_every=2", "train.eval_fraction=0.2",
         "train.max_failures=0", "eval.num_prompts=1"]


def test_the_whole_pipeline_from_a_fresh_directory_then_again_reused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tiny_target_cfg,
        tiny_target_build, ray_session):
    from openai import OpenAI
    from ray import serve as ray_serve

    clone = tmp_path / "clone"
    clone.mkdir()
    monkeypatch.chdir(clone)
    port = free_port()
    cfg = load("dspark.yaml", [*SMALL, "stages=[data,train,eval,serve]", "eval.methods=[target_only,drafter]",
                               "eval.max_new_tokens=8", "serve.block=false", f"serve.port={port}",
                               "serve.adaptive=false", "serve.cpus_per_replica=0.5", "serve.model_name=tiny",
                               "serve.drafter=model"])  # auto: what the tiny eval timed fastest
    assert cfg.run_dir == str(clone / "runs")  # the default run_dir: relative, made absolute here
    cfg = dataclasses.replace(cfg, target=tiny_target_cfg)
    tracker = Tracker(cfg)
    ctrl_c = signal.getsignal(signal.SIGINT)
    caplog.set_level(logging.INFO, logger="specline")
    try:
        with tracker.run("pipeline"):
            out = full.run(cfg, tracker, {})
        assert out["eval_lossless"]["drafter"] and wait_for(lambda: request(port, "GET", "/health")[0] == 200, 120)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        done = client.completions.create(model="tiny", prompt="def read(", max_tokens=6, temperature=0)
        assert 1 <= done.usage.completion_tokens <= 6 and done.model_extra["specline"]["spec_decode"]["num_drafts"] >= 1
        caplog.clear()
        with tracker.run("pipeline"):
            again = full.run(cfg, tracker, {})
        reused = [r.getMessage().split(" reused")[0] for r in caplog.records if " reused: " in r.getMessage()]
        assert reused == ["[1/4] data", "[2/4] train", "[3/4] eval"]  # serve, a live service, starts again
        assert again["drafter_path"] == out["drafter_path"] and again["serve_endpoint"] == out["serve_endpoint"]
    finally:
        ray_serve.shutdown()
    assert signal.getsignal(signal.SIGINT) is ctrl_c  # Ray Train's handler would swallow the serve stage's Ctrl-C
    assert out["num_records"] == 10 and Path(out["data_dir"]) == clone / "runs" / "data"
    assert Path(out["drafter_path"]) == clone / "runs" / "train" / "drafter"
    vocab = json.loads((clone / "runs" / "train" / "draft_vocab" / "config.json").read_text())
    assert vocab["draft_vocab_size"] == 128
    drafter = json.loads((Path(out["drafter_path"]) / "config.json").read_text())
    assert drafter.get("draft_vocab_size") == 128 and out["train_steps"] == 2
