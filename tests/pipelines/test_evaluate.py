"""The eval stage end to end on the fixture target: every method on the same held-out prompts,
results and plots in MLflow, the offline τ beside the measured one, clear errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from components.config import ConfigError, DrafterConfig, EvalConfig, SpeclineConfig
from components.tracking import Tracker
from pipelines import evaluate, full
from tests.components.data.test_data_records import rollout_dir

# one prompt per set of the default prompt sets (humaneval, chat, summarise; the fixture target
# has no conversations, so chat is left out and the report says so)
EVAL = EvalConfig(num_prompts=1, max_new_tokens=10, lookup_num_speculative_tokens=4, threads=1)


@pytest.fixture(scope="module")
def saved_drafter(tmp_path_factory, tiny_target) -> Path:
    from components.drafters import build_drafter, save_drafter

    torch.manual_seed(0)
    drafter = build_drafter(DrafterConfig(name="dspark", num_layers=1, block_size=4, markov_rank=8), tiny_target)
    return save_drafter(drafter, tmp_path_factory.mktemp("eval-stage") / "drafter")


def _cfg(spec_cfg: SpeclineConfig, tiny_target_build, **ev) -> SpeclineConfig:
    # The fixture target, loaded again, serves as hf_assisted's assistant (same tokenizer).
    ev = {"assistant": str(tiny_target_build[0]), "output_dir": str(Path(spec_cfg.run_dir) / "eval"),
          "profile_dir": str(Path(spec_cfg.run_dir) / "round-profiles"), **ev}
    return dataclasses.replace(spec_cfg, eval=dataclasses.replace(EVAL, **ev))


@pytest.mark.slow
def test_eval_stage_logs_tables_plots_and_offline_vs_engine(spec_cfg, tiny_target_build, saved_drafter):
    cfg = _cfg(spec_cfg, tiny_target_build)
    tracker = Tracker(cfg)
    client = MlflowClient(f"sqlite:///{Path(cfg.run_dir) / 'mlflow.db'}")
    client.create_registered_model(cfg.train.register_as)  # as the train stage registers its drafter
    version = client.create_model_version(cfg.train.register_as, str(saved_drafter)).version
    upstream = {"drafter_path": str(saved_drafter), "heldout_tau": 1.4, "heldout_alpha": [0.3, 0.1, 0.05, 0.01],
                "registered_version": version}
    with tracker.run("eval") as run_id:
        out = evaluate.run(cfg, tracker, upstream)
    tags = client.get_model_version(cfg.train.register_as, version).tags  # the registered drafter carries its eval
    assert tags["eval.run_id"] == run_id and float(tags["eval.drafter.tau"]) == pytest.approx(out["eval_tau"]["drafter"],
                                                                                             abs=1e-4)
    assert out["eval_lossless_failures"] == []
    sets = list(out["eval_sets"])
    assert {"humaneval", "summarise"} <= set(sets) and out["eval_prompts"] == len(sets)
    assert all(set(out["eval_sets"][n]) == set(EVAL.methods) for n in sets)
    assert set(out["eval_speedup"]) == set(EVAL.methods) and out["eval_speedup"]["target_only"] == 1.0
    assert out["eval_decode_speedup"]["target_only"] == 1.0 and out["eval_ttft_s"]["target_only"] > 0  # our engines'
    assert out["eval_offline_tau"] == 1.4 and out["eval_engine_tau"] >= 1.0
    assert all(out["eval_lossless"][m] for m in EVAL.methods if m != "target_only")

    metrics = client.get_run(run_id).data.metrics
    for m in EVAL.methods:
        assert {f"eval/{m}/tau", f"eval/{m}/tokens_per_s", f"eval/{m}/speedup"} <= set(metrics), m
        for n in sets:  # the same per prompt set
            assert {f"eval/{n}/{m}/tau", f"eval/{n}/{m}/tokens_per_s", f"eval/{n}/{m}/speedup"} <= set(metrics)
    assert metrics["eval/humaneval/target_only/speedup"] == 1.0 and metrics["eval/humaneval/prompts"] == 1
    assert {"eval/offline_tau", "eval/engine_tau", "eval/drafter/acceptance/1"} <= set(metrics)
    logged = {a.path for a in client.list_artifacts(run_id, "eval")}
    assert {"eval/results.md", "eval/results.json", "eval/plots"} <= logged
    plots = {a.path for a in client.list_artifacts(run_id, "eval/plots")}
    assert plots == {"eval/plots/acceptance_by_position.png", "eval/plots/speedups.png"}
    results = json.loads((Path(out["eval_dir"]) / "results.json").read_text())
    assert results["offline_vs_engine"]["offline_tau"] == 1.4 and list(results["sets"]) == sets
    text = (Path(out["eval_dir"]) / "results.md").read_text()
    assert "| drafter |" in text and "## Per prompt set" in text
    assert "| method | " + " | ".join(sets) + " | overall |" in text
    assert all(f"| {n} | drafter | 1 |" in text for n in sets) and "| **overall** | drafter |" in text


def test_eval_is_a_pipeline_stage():
    assert full.STAGES["eval"] is evaluate.run


@pytest.mark.parametrize("ev, upstream, key", [
    ({"methods": ["target_only", "medusa_magic"]}, {}, "eval.methods"),
    ({"methods": ["target_only", "drafter"]}, {}, "eval.drafter_path"),
    ({"methods": ["drafter"], "drafter_path": "/nonexistent/drafter"}, {}, "eval.drafter_path"),
    ({"methods": ["hf_assisted"], "assistant": None}, {}, "eval.assistant"),
    ({"methods": ["target_only", "suffix"], "suffix_rollouts": "/nonexistent/data"}, {}, "eval.suffix_rollouts"),
])
def test_bad_settings_stop_with_the_key_named(spec_cfg, tiny_target_build, ev, upstream, key):
    cfg = _cfg(dataclasses.replace(spec_cfg, tracking=dataclasses.replace(spec_cfg.tracking, enabled=False)),
               tiny_target_build, **ev)
    with pytest.raises(ConfigError, match=key):
        evaluate.run(cfg, Tracker(cfg), upstream)


def test_unknown_method_on_the_command_line_is_one_line(capsys):
    from pipelines.cli import main

    argv = ["conf=dspark.yaml", "eval.methods=[target_only,nope]", "tracking.enabled=false"]
    assert main(evaluate.run, "eval", argv) == 2
    assert "error: eval.methods: unknown ['nope']" in capsys.readouterr().err


def test_suffix_rollouts_auto_reads_this_runs_rollouts_of_this_target_only(spec_cfg, tiny_target, tmp_path, capsys):
    """auto: the upstream data directory's responses; another tokenizer's under auto: an empty
    tree and one line saying why (named explicitly: an error); no suffix method: nothing read."""
    cfg = dataclasses.replace(spec_cfg, eval=EVAL)
    data = rollout_dir(tmp_path / "data", tiny_target.tokenizer_hash, [[5, 6, 7], [8, 9]])
    responses, found = evaluate._rollouts(cfg, {"data_dir": str(data)}, tiny_target, ["target_only", "suffix"])
    assert responses == [[5, 6, 7], [8, 9]] and found == str(data)
    assert "starts with 2 rollout responses (5 tokens)" in capsys.readouterr().out
    assert evaluate._rollouts(cfg, {"data_dir": str(data)}, tiny_target, ["target_only"]) == ([], None)
    other = rollout_dir(tmp_path / "other", "0" * 16, [[5, 6, 7]])
    assert evaluate._rollouts(cfg, {"data_dir": str(other)}, tiny_target, ["suffix"]) == ([], None)
    assert "empty tree" in capsys.readouterr().out
    named = dataclasses.replace(cfg, eval=dataclasses.replace(EVAL, suffix_rollouts=str(other)))
    with pytest.raises(ConfigError, match="eval.suffix_rollouts: .*another tokenizer"):
        evaluate._rollouts(named, {}, tiny_target, ["suffix"])
