"""Stage reuse without running a stage: keys, records, the decision and a part of the pipeline."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from components import reuse
from components.config import ConfigError, SpeclineConfig
from components.confload import load


def _cfg(tmp_path: Path, *overrides: str) -> SpeclineConfig:
    return load(None, [f"run_dir={tmp_path / 'runs'}", *overrides])


def _finish(cfg: SpeclineConfig, stage: str, upstream: dict, out: dict) -> reuse.Decision:
    """What a stage run leaves: the unfinished record, then the complete one."""
    decision = reuse.decide(stage, cfg, upstream)
    reuse.begin(decision, cfg)
    reuse.complete(decision, upstream, {**upstream, **out}, "run-1", 1.0)
    return decision


def _manifest(cfg: SpeclineConfig, text: str = '{"shards": []}') -> Path:
    out = Path(cfg.data.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").write_text(text)
    return out


def _drafter(cfg: SpeclineConfig) -> Path:
    path = Path(cfg.train.output_dir) / "drafter"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"weights")
    return path


def test_the_key_holds_what_changes_a_stage_output_and_nothing_else(tmp_path):
    base = _cfg(tmp_path)
    key = {s: reuse.key_of(reuse.stage_inputs(s, base, {})) for s in reuse.REUSABLE}
    quiet = _cfg(tmp_path, "train.log_every=99", "data.log_samples=1", "log_level=verbose",
                 "tracking.enabled=false", "ray.address=auto", "serve.port=9", "stages=[data]", "force=[data]")
    assert {s: reuse.key_of(reuse.stage_inputs(s, quiet, {})) for s in reuse.REUSABLE} == key
    steps = _cfg(tmp_path, "train.max_steps=7")
    assert reuse.key_of(reuse.stage_inputs("train", steps, {})) != key["train"]
    assert reuse.key_of(reuse.stage_inputs("data", steps, {})) == key["data"]
    # data captures the drafter's layers: their choice is in its key, the drafter's size is not
    assert reuse.key_of(reuse.stage_inputs("data", _cfg(tmp_path, "drafter.num_layers=3"), {})) == key["data"]
    assert reuse.key_of(reuse.stage_inputs("data", _cfg(tmp_path, "drafter.num_taps=3"), {})) != key["data"]
    assert reuse.key_of(reuse.stage_inputs("target", _cfg(tmp_path, "target.dtype=bfloat16"), {})) != key["target"]


def test_train_and_eval_keys_follow_the_content_of_what_they_read(tmp_path):
    cfg = _cfg(tmp_path)
    data_dir = _manifest(cfg)
    up = {"data_dir": str(data_dir)}
    first = reuse.key_of(reuse.stage_inputs("train", cfg, up))
    assert reuse.key_of(reuse.stage_inputs("train", cfg, up)) == first
    # the same directory named by train.data_dir instead of the data stage: the same inputs
    named = _cfg(tmp_path, f"train.data_dir={data_dir}")
    assert reuse.key_of(reuse.stage_inputs("train", named, {})) == first
    _manifest(cfg, '{"shards": [1]}')
    assert reuse.key_of(reuse.stage_inputs("train", cfg, up)) != first
    drafter = _drafter(cfg)
    ev = reuse.key_of(reuse.stage_inputs("eval", cfg, {"drafter_path": str(drafter)}))
    (drafter / "model.safetensors").write_bytes(b"other weights")
    assert reuse.key_of(reuse.stage_inputs("eval", cfg, {"drafter_path": str(drafter)})) != ev


def test_a_prompt_file_is_known_by_size_and_mtime(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a"}\n')
    cfg = _cfg(tmp_path, f"data.prompt_source={prompts}")
    key = reuse.key_of(reuse.stage_inputs("data", cfg, {}))
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    assert reuse.key_of(reuse.stage_inputs("data", cfg, {})) != key


def test_a_finished_stage_is_reused_and_an_unfinished_one_never_claims_completion(tmp_path):
    cfg = _cfg(tmp_path)
    first = reuse.decide("data", cfg, {})
    assert not first.reuse and not first.stale and first.why == ""
    reuse.begin(first, cfg)  # the stage starts ... and crashes
    record = json.loads(first.record_path.read_text())
    assert record["complete"] is False and "artifacts" not in record
    again = reuse.decide("data", cfg, {})
    assert not again.reuse and not again.stale and "resuming" in again.why
    out = Path(cfg.data.output_dir)
    reuse.complete(again, {"target_path": "/t"}, {"target_path": "/t", "data_dir": str(out), "num_records": 3},
                   "run-7", 2.0)
    record = json.loads(first.record_path.read_text())
    assert record["complete"] and record["artifacts"] == {"data_dir": str(out), "num_records": 3}
    assert record["run_id"] == "run-7" and record["key"] == first.key
    assert [p.name for p in out.iterdir()] == [reuse.RECORD]  # no temporary file left
    done = reuse.decide("data", cfg, {})
    assert done.reuse and done.why == "same config and inputs"
    assert reuse.reused(done, {"x": 1}) == {"x": 1, "data_dir": str(out), "num_records": 3, "data_run_id": "run-7"}


def test_changed_inputs_and_force_replace_only_what_the_stage_made(tmp_path):
    cfg = _cfg(tmp_path)
    out = Path(cfg.train.output_dir)
    out.mkdir(parents=True)
    (out / "mine.txt").write_text("was here before any run")
    decision = reuse.decide("train", cfg, {})
    reuse.begin(decision, cfg)
    drafter = _drafter(cfg)
    reuse.complete(decision, {}, {"drafter_path": str(drafter)}, None, 1.0)
    changed = _cfg(tmp_path, "train.max_steps=3", "train.lr=0.5")
    stale = reuse.decide("train", changed, {})
    assert stale.stale and not stale.reuse
    assert stale.why == "inputs changed: train.lr 0.001 → 0.5, train.max_steps 0 → 3"
    assert reuse.begin(stale, changed) == ["drafter"]
    assert sorted(p.name for p in out.iterdir()) == [reuse.RECORD, "mine.txt"]
    forced = reuse.decide("train", _cfg(tmp_path, "train.max_steps=3", "train.lr=0.5", "force=[all]"), {})
    assert forced.stale and forced.why.startswith("force=[train]")


def test_clean_up_never_removes_another_stage_output_the_logs_or_the_tracking_store(tmp_path):
    cfg = _cfg(tmp_path, f"eval.output_dir={tmp_path / 'runs'}")  # eval writing into the run directory itself
    root = Path(cfg.run_dir)
    decision = reuse.decide("eval", cfg, {})
    reuse.begin(decision, cfg)
    for name in ("results.md", "mlflow.db"):
        (root / name).write_text("x")
    for name in ("logs", "data", "plots"):
        (root / name).mkdir()
    reuse.complete(decision, {}, {"eval_dir": str(root)}, None, 1.0)
    stale = reuse.decide("eval", _cfg(tmp_path, f"eval.output_dir={root}", "eval.num_prompts=2"), {})
    assert sorted(reuse.begin(stale, cfg)) == ["plots", "results.md"]
    assert sorted(p.name for p in root.iterdir()) == [reuse.RECORD, "data", "logs", "mlflow.db"]


def test_a_recorded_path_that_is_gone_means_running_again(tmp_path):
    cfg = _cfg(tmp_path)
    drafter = _drafter(cfg)
    _finish(cfg, "train", {}, {"drafter_path": str(drafter)})
    assert reuse.decide("train", cfg, {}).reuse
    (drafter / "model.safetensors").unlink()
    (drafter / "config.json").unlink()
    drafter.rmdir()
    gone = reuse.decide("train", cfg, {})
    assert gone.stale and "is gone" in gone.why


def test_force_names_stages_that_run(tmp_path):
    assert reuse.check_force(_cfg(tmp_path, "force=[all]")) == set(reuse.REUSABLE)
    assert reuse.check_force(_cfg(tmp_path, "force=[data,train]"), ["data", "train"]) == {"data", "train"}
    with pytest.raises(ConfigError, match=r"force: unknown \['dat'\]"):
        reuse.check_force(_cfg(tmp_path, "force=[dat]"))
    with pytest.raises(ConfigError, match="serve is never reused"):
        reuse.check_force(_cfg(tmp_path, "force=[serve]"))
    with pytest.raises(ConfigError, match=r"not among stages=\['eval'\]"):
        reuse.check_force(_cfg(tmp_path, "force=[train]"), ["eval"])
    assert reuse.decide("serve", _cfg(tmp_path), {}) is None
    assert reuse.decide("data", _cfg(tmp_path, "data.mode=stream"), {}) is None


def test_a_stage_run_alone_takes_matching_recorded_upstream_or_says_what_to_run(tmp_path):
    cfg = _cfg(tmp_path, "stages=[eval]")
    with pytest.raises(ConfigError, match=r'run "stages=\[data,train,eval\]" or set eval.drafter_path'):
        reuse.recorded_upstream("eval", cfg, {}, {})
    data_dir = _manifest(cfg)
    up = {"data_dir": str(data_dir)}
    _finish(cfg, "data", {}, up)
    _finish(cfg, "train", up, {"drafter_path": str(_drafter(cfg)), "heldout_tau": 1.5})
    artifacts, taken = reuse.recorded_upstream("eval", cfg, {}, {})
    assert [d.stage for d in taken] == ["data", "train"]
    assert artifacts["drafter_path"].endswith("drafter") and artifacts["heldout_tau"] == 1.5
    assert artifacts["train_run_id"] == "run-1"
    changed = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=9))
    with pytest.raises(ConfigError, match=r'inputs changed: train.max_steps 0 → 9\); run "stages=\[train,eval\]"'):
        reuse.recorded_upstream("eval", changed, {}, {})
    # eval without a drafter method needs nothing upstream
    plain = _cfg(tmp_path / "other", "stages=[eval]", "eval.methods=[target_only,prompt_lookup]")
    assert reuse.recorded_upstream("eval", plain, {}, {}) == ({}, [])
