"""What a person sees on the console of a stage run, and the headline of each stage."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from components.config import ConfigError, SpeclineConfig
from components.tracking import Tracker
from pipelines import full
from pipelines.cli import INTERRUPTED, main, split_flags
from pipelines.headlines import duration, headline


def _counting_stage(cfg: SpeclineConfig, tracker: Tracker, upstream: dict[str, Any]) -> dict[str, Any]:
    logging.getLogger("some.library").info("library chatter")
    return {**upstream, "num_records": 1200, "num_tokens": 34567, "data_seconds": 2.0, "data_dir": "/d"}


def _argv(tmp_path: Path, *extra: str) -> list[str]:
    return ["conf=dspark.yaml", f"run_dir={tmp_path}", "tracking.enabled=false", *extra]


def test_a_stage_is_a_start_line_and_an_end_line_with_its_headline(tmp_path, capsys):
    assert main(_counting_stage, "data", _argv(tmp_path)) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["num_records"] == 1200  # stdout stays the JSON result
    lines = err.strip().splitlines()
    assert len(lines) == 3, err
    assert "full log in" in lines[0] and "-v" in lines[0]
    assert lines[1].endswith("data …")
    assert "data done in" in lines[2] and lines[2].endswith("1,200 records, 34,567 tokens, 17,284 tok/s → /d")
    log_file = next((tmp_path / "logs").glob("*-data.log"))
    assert "library chatter" in log_file.read_text() and "result:" in log_file.read_text()
    assert "library chatter" not in err


def test_verbose_flag_brings_library_output_back(tmp_path, capsys):
    assert split_flags(["conf=x", "-v", "a=1"]) == ["conf=x", "a=1", "log_level=verbose"]
    assert main(_counting_stage, "data", _argv(tmp_path, "--verbose")) == 0
    err = capsys.readouterr().err
    assert "library chatter" in err and "-v:" not in err


def test_a_failing_stage_says_so_and_where_the_log_is(tmp_path, capsys):
    def broken(cfg: SpeclineConfig, tracker: Tracker, upstream: dict[str, Any]) -> dict[str, Any]:
        raise RuntimeError("the disk is full\nsecond line")

    with pytest.raises(RuntimeError):
        main(broken, "data", _argv(tmp_path))
    err = capsys.readouterr().err
    log_file = next((tmp_path / "logs").glob("*-data.log"))
    assert "data failed after " in err and f" s: RuntimeError: the disk is full; full log: {log_file}" in err
    assert "Traceback" not in err and "Traceback" in log_file.read_text()


def test_a_ctrl_c_a_library_swallowed_still_ends_the_stage_as_interrupted(tmp_path, capsys):
    def swallows(cfg: SpeclineConfig, tracker: Tracker, upstream: dict[str, Any]) -> dict[str, Any]:
        try:  # as a __del__ or a broad except in a library does
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(2)
        except KeyboardInterrupt:
            pass
        return _counting_stage(cfg, tracker, upstream)

    assert main(swallows, "data", _argv(tmp_path)) == INTERRUPTED
    out, err = capsys.readouterr()
    assert out == "" and "data interrupted after" in err.strip().splitlines()[-1] and "Traceback" not in err
    assert main(_counting_stage, "data", _argv(tmp_path)) == 0  # the next run starts with no Ctrl-C seen


def test_a_user_error_in_a_stage_is_its_one_error_line(tmp_path, capsys):
    def refuses(cfg: SpeclineConfig, tracker: Tracker, upstream: dict[str, Any]) -> dict[str, Any]:
        raise ConfigError("data.storage: 'int4' is not one of [...]")

    assert main(refuses, "data", _argv(tmp_path)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "error: data.storage: 'int4' is not one of [...]"
    assert not any("failed" in line for line in err)


def test_the_pipeline_numbers_its_stages(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(full.STAGES, "data", _counting_stage)
    assert main(full.run, "pipeline", _argv(tmp_path, "stages=[data]")) == 0
    err = capsys.readouterr().err
    assert "pipeline … data" in err and "[1/1] data …" in err and "[1/1] data done in" in err
    assert "pipeline done in" in err


def test_headlines_pick_the_figure_of_each_stage():
    assert headline("target", {"parameters": 134_515_008, "num_layers": 30, "built_now": False,
                               "conversion_seconds": 3.0}) == "135M parameters, 30 layers, cached"
    assert headline("target", {"parameters": 2_000_000, "num_layers": 8, "built_now": True, "build_seconds": 75,
                               "metrics": {"heldout_perplexity": 12.345}}) == \
        "2M parameters, 8 layers, held-out perplexity 12.3, built in 1 min 15 s"
    assert headline("data", {"data_mode": "stream", "num_prompts": 64}).startswith("a stream over 64 prompts")
    assert headline("train", {"train_steps": 5, "train_loss_first": 1.85, "train_loss_last": 1.7,
                              "heldout_tau": 3.26, "heldout_tau_initial": 1.91, "drafter_path": "/t"}) == \
        "5 steps, loss 1.850 → 1.700, held-out τ 1.91 → 3.26, drafter → /t"
    assert headline("eval", {"eval_tau": {"target_only": 1.0, "drafter": 3.2, "prompt_lookup": 1.4},
                             "eval_speedup": {"drafter": 1.8}, "eval_lossless_failures": ["drafter"]}) == \
        "drafter τ 3.20 (1.80× speedup), NOT LOSSLESS: drafter"
    assert headline("serve", {"serve_endpoint": "http://127.0.0.1:8000", "serve_model": "tiny"}) == \
        "http://127.0.0.1:8000/v1 (model tiny)"
    assert headline("serve", {"serve_endpoint": "http://h:1", "serve_model": "tiny", "serve_drafter": "suffix",
                              "serve_drafter_why": "the fastest"}) == \
        "http://h:1/v1 (model tiny, drafter suffix; serve.drafter=auto: the fastest)"
    assert headline("train", {}) == "" and headline("nope", {"a": 1}) == ""
    assert (duration(3.04), duration(125), duration(3725)) == ("3.0 s", "2 min 05 s", "1 h 02 min")
