"""Ctrl-C in the middle of the data stage and of the train stage: one "interrupted" line, exit
status 130, no traceback, nothing half-written. Running data again keeps the shards already
written, writes the rest, and gives the record set an uninterrupted run gives (greedy rollouts:
the same tokens); running train again resumes from its last checkpoint and ends at the step an
uninterrupted run ends at."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from components.data.shards import read_table
from pipelines import data, train
from pipelines.cli import INTERRUPTED, main

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


# More than run before the signal lands: a step of the fixture takes milliseconds, a checkpoint
# (every 10 steps) about 2 s, and the interrupted run has stopped by step 30 at the latest so far.
# Every step after the resume costs the test time (a checkpoint every 10).
TRAIN_STEPS = 80
TRAIN = [f"train.max_steps={TRAIN_STEPS}", "train.checkpoint_every=10", "train.num_workers=1", "train.cpus_per_worker=0.5",
         "train.batch_size=2", "train.log_every=2", "train.warmup_steps=1", "drafter.block_size=4",
         "drafter.num_anchors=16", "drafter.markov_rank=8", "drafter.draft_vocab_size=128"]


def _argv(target: Path, run_dir: Path) -> list[str]:
    return ["conf=dspark.yaml", f"target.name_or_path={target}", f"run_dir={run_dir}", "tracking.enabled=false",
            "data.max_prompts=16", "data.max_new_tokens=64", "data.batch_size=2", "data.shard_size=2",
            "data.num_actors=1", "data.cpus_per_actor=0.5", "data.temperature=0"]


def _interrupted(module: str, argv: list[str], ready: Callable[[str], bool], tmp_path: Path) -> str:
    """Runs ``python -m module argv``, sends SIGINT once ``ready(stderr so far)``; its stderr."""
    err_file = tmp_path / f"{module}.stderr"
    with err_file.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", module, *argv], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=err, env=os.environ | {"PYTHONUNBUFFERED": "1"})
        try:
            deadline = time.monotonic() + 240
            while not ready(err_file.read_text()) and proc.poll() is None:
                assert time.monotonic() < deadline, f"{module}: not ready to interrupt in time"
                time.sleep(0.2)
            assert proc.poll() is None, f"{module} ended before it could be interrupted"
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    printed = err_file.read_text()
    assert proc.returncode == INTERRUPTED and "Traceback" not in printed, printed[-3000:]
    return printed


def _after(started: list[float], seconds: float) -> bool:
    """True once ``seconds`` have passed since its first call (which records the time)."""
    started[:] = started or [time.monotonic()]
    return time.monotonic() - started[0] >= seconds


def _records(data_dir: Path) -> list[tuple[str, tuple[int, ...]]]:
    rows = [r for p in sorted(data_dir.glob("shard-*.parquet")) for r in read_table(p).to_pylist()]
    return sorted((r["sample_id"], tuple(r["input_ids"])) for r in rows)


def test_ctrl_c_mid_data_and_mid_train_then_reruns_give_what_uninterrupted_runs_give(tmp_path, tiny_target_build,
                                                                                     ray_session):
    target, run = tiny_target_build[0], tmp_path / "run"
    shards = run / "data"
    # mid-generation: the actor may write its shards as they finish or all at the end, so the
    # signal goes a few seconds into the generation, not after a shard
    started: list[float] = []
    printed = _interrupted("pipelines.data", _argv(target, run),
                           lambda text: "Ray dashboard" in text and _after(started, 3.0), tmp_path)
    assert "data interrupted after" in printed
    kept = sorted(p.name for p in shards.iterdir() if not p.name.startswith(".")) if shards.is_dir() else []
    kept = [n for n in kept if n != "manifest.json"]
    assert all(n.startswith("shard-") and n.endswith(".parquet") for n in kept), kept  # no half shard
    # a Ctrl-C that Ray swallowed stops the stage after a whole shard; only a stage that had
    # written everything, its manifest included, can have ended that way after its last one
    assert not (shards / "manifest.json").exists() or len(kept) == 8, kept

    assert main(data.run, "data", _argv(target, run)) == 0  # again: resumes
    manifest = json.loads((shards / "manifest.json").read_text())
    if len(kept) < 8:
        assert manifest["run"]["shards_reused"] == len(kept) and manifest["run"]["shards_written"] == 8 - len(kept)
    assert main(data.run, "data", _argv(target, tmp_path / "whole")) == 0  # uninterrupted
    resumed, whole = _records(shards), _records(tmp_path / "whole" / "data")
    assert len(whole) == 16 and resumed == whole

    argv = [*_argv(target, run), f"train.data_dir={run / 'data'}", *TRAIN]
    # interrupted after the checkpoint of step 10
    printed = _interrupted("pipelines.train", argv, lambda text: "train: step 12/" in text, tmp_path)
    assert "train interrupted after" in printed
    out = json.loads(_stdout_of(main, train.run, "train", argv))  # again: resumes from its last checkpoint
    assert out["train_steps"] == TRAIN_STEPS


def _stdout_of(fn: Callable[..., int], *args: Any) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert fn(*args) == 0
    return buf.getvalue()[buf.getvalue().index("{"):]
