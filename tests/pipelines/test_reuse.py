"""A second run reuses what the first made, and says so; a changed key or ``force`` reruns a stage
and what follows it. The tiny fixture, data → train with the SMALL settings of test_full (one
Ray Train worker)."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from components import reuse
from components.config import SpeclineConfig
from components.confload import load
from components.reuse import RECORD
from components.tracking import Tracker
from pipelines import full
from pipelines.cli import main
from tests.pipelines.test_full import SMALL


def test_a_stage_run_again_alone_is_reused_with_one_line(tmp_path, capsys):
    calls = []
    out_dir = tmp_path / "somewhere"
    out_dir.mkdir()

    def stage(cfg: SpeclineConfig, tracker: Tracker, upstream: dict[str, Any]) -> dict[str, Any]:
        calls.append(1)
        return {**upstream, "num_records": 12, "num_tokens": 340, "data_dir": str(out_dir)}

    argv = ["conf=dspark.yaml", f"run_dir={tmp_path}", "tracking.enabled=false"]
    assert main(stage, "data", argv) == 0 and main(stage, "data", argv) == 0
    assert len(calls) == 1
    err = capsys.readouterr().err
    assert "data reused: 12 records, 340 tokens → " in err
    assert "(same config and inputs; force=[data] reruns)" in err
    assert main(stage, "data", [*argv, "force=[data]"]) == 0 and len(calls) == 2
    assert "data … (force=[data]: its earlier output is replaced)" in capsys.readouterr().err


def _cfg(clone: Path, tiny_target_cfg, *extra: str) -> SpeclineConfig:
    cfg = load("dspark.yaml", [*SMALL, "train.num_workers=1", f"run_dir={clone / 'runs'}", *extra])
    return dataclasses.replace(cfg, target=tiny_target_cfg)


def _run(clone: Path, tiny_target_cfg, *extra: str) -> tuple[dict[str, Any], float]:
    cfg = _cfg(clone, tiny_target_cfg, *extra)
    tracker = Tracker(cfg)
    t0 = time.perf_counter()
    with tracker.run("pipeline"):
        out = full.run(cfg, tracker, {})
    return out, time.perf_counter() - t0


def _mtimes(path: Path) -> dict[str, int]:
    return {str(p.relative_to(path)): p.stat().st_mtime_ns for p in path.rglob("*") if p.is_file()}


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    lines = [r.getMessage() for r in caplog.records if r.name == "specline"]
    caplog.clear()
    return lines


@pytest.mark.slow
def test_a_second_run_reuses_data_and_train_and_a_changed_key_or_force_reruns(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, tiny_target_cfg, tiny_target_build, ray_session):
    caplog.set_level(logging.INFO, logger="specline")
    first, _ = _run(tmp_path, tiny_target_cfg)
    data_dir, train_dir = Path(first["data_dir"]), tmp_path / "runs" / "train"
    assert (data_dir / RECORD).is_file() and (train_dir / RECORD).is_file()
    before, drafter_before = _mtimes(data_dir), _mtimes(train_dir)
    assert [line for line in _lines(caplog) if "reused" in line] == []

    again, seconds = _run(tmp_path, tiny_target_cfg, "train.log_every=2")  # log_every changes no output
    lines = _lines(caplog)
    assert any(line.startswith("[1/2] data reused: 10 records") and
               line.endswith("(same config and inputs; force=[data] reruns)") for line in lines), lines
    assert any(line.startswith("[2/2] train reused: 2 steps") for line in lines), lines
    assert not any(" … " in line or line.endswith(" …") for line in lines), lines  # no stage started
    assert _mtimes(data_dir) == before and _mtimes(train_dir) == drafter_before  # nothing written
    assert seconds < 10, seconds
    assert again["drafter_path"] == first["drafter_path"] and again["train_run_id"] == first["train_run_id"]
    import mlflow

    reused_runs = mlflow.search_runs(experiment_names=["specline"], filter_string="tags.reused = 'true'")
    assert sorted(reused_runs["tags.specline.stage"]) == ["data", "train"]

    # a changed key reruns its stage (deciding is enough: running it is the first run above, and
    # the resumed and chained runs of tests/pipelines/test_train.py)
    changed = reuse.decide("train", _cfg(tmp_path, tiny_target_cfg, "train.max_steps=3"), first)
    assert changed is not None and not changed.reuse and changed.why == "inputs changed: train.max_steps 2 → 3"
    # "stages=[eval]" now: the recorded data and train outputs of this config are its upstream
    alone = _cfg(tmp_path, tiny_target_cfg, "stages=[eval]")
    upstream, taken = reuse.recorded_upstream("eval", alone, {}, {})
    assert [d.stage for d in taken] == ["data", "train"] and upstream["drafter_path"] == first["drafter_path"]

    # force=[data]: data runs again, and the train stage after it would too (deciding is enough)
    forced, _ = _run(tmp_path, tiny_target_cfg, "force=[data]", "stages=[data]")
    lines = _lines(caplog)
    assert "[1/1] data … (force=[data]: its earlier output is replaced)" in lines, lines
    assert forced["num_records"] == 10 and _mtimes(data_dir) != before
    train = reuse.decide("train", _cfg(tmp_path, tiny_target_cfg), forced)
    assert not train.reuse and train.why == "inputs changed: the data stage's output (manifest.json)"


def test_the_target_stage_is_reused_too_and_its_record_lives_under_run_dir(tmp_path, tiny_target_cfg,
                                                                           tiny_target_build, capsys):
    from tests.pipelines.test_target import _conf

    argv = [f"conf={_conf(tmp_path, tiny_target_cfg, ['target'])}", "tracking.enabled=false"]
    assert main(full.run, "pipeline", argv) == 0
    assert (tmp_path / "runs" / "target" / RECORD).is_file()
    capsys.readouterr()
    assert main(full.run, "pipeline", argv) == 0
    err = capsys.readouterr().err
    assert "[1/1] target reused: " in err and ", cached (same config and inputs; force=[target] reruns)" in err
    assert main(full.run, "pipeline", [*argv, "target.dtype=bfloat16"]) == 0
    assert "[1/1] target … (inputs changed: target.dtype float32 → bfloat16)" in capsys.readouterr().err
