"""Ctrl-C in the middle of the data stage: one "interrupted" line, exit status 130, no traceback,
nothing half-written; running it again keeps the shards already written, writes the rest, and
gives the record set an uninterrupted run gives (greedy rollouts: the same tokens)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from components.data.shards import read_table
from pipelines import data
from pipelines.cli import INTERRUPTED, main

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _argv(target: Path, run_dir: Path) -> list[str]:
    return ["conf=dspark.yaml", f"target.name_or_path={target}", f"run_dir={run_dir}", "tracking.enabled=false",
            "data.max_prompts=12", "data.max_new_tokens=24", "data.batch_size=2", "data.shard_size=2",
            "data.num_actors=1", "data.cpus_per_actor=0.5", "data.temperature=0"]


def _records(data_dir: Path) -> list[tuple[str, tuple[int, ...]]]:
    rows = [r for p in sorted(data_dir.glob("shard-*.parquet")) for r in read_table(p).to_pylist()]
    return sorted((r["sample_id"], tuple(r["input_ids"])) for r in rows)


def test_ctrl_c_mid_data_then_a_rerun_gives_the_uninterrupted_record_set(tmp_path, tiny_target_build, ray_session):
    target, interrupted = tiny_target_build[0], tmp_path / "interrupted"
    err_file = tmp_path / "stderr"
    with err_file.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "pipelines.data", *_argv(target, interrupted)], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=err, env=os.environ | {"PYTHONUNBUFFERED": "1"})
        try:
            deadline = time.monotonic() + 240
            while len(list((interrupted / "data").glob("shard-*.parquet"))) < 2 and proc.poll() is None:
                assert time.monotonic() < deadline, "no shard written in time"
                time.sleep(0.2)
            assert proc.poll() is None, "the stage ended before it could be interrupted"
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    printed = err_file.read_text()
    assert proc.returncode == INTERRUPTED and "data interrupted after" in printed and "Traceback" not in printed
    kept = sorted(p.name for p in (interrupted / "data").iterdir() if not p.name.startswith("."))
    assert kept and all(n.startswith("shard-") and n.endswith(".parquet") for n in kept), kept  # no half shard
    assert not (interrupted / "data" / "manifest.json").exists()

    assert main(data.run, "data", _argv(target, interrupted)) == 0  # again: resumes
    manifest = json.loads((interrupted / "data" / "manifest.json").read_text())
    assert manifest["run"]["shards_reused"] == len(kept) and manifest["run"]["shards_written"] == 6 - len(kept)
    assert main(data.run, "data", _argv(target, tmp_path / "whole")) == 0  # uninterrupted
    resumed, whole = _records(interrupted / "data"), _records(tmp_path / "whole" / "data")
    assert len(whole) == 12 and resumed == whole
