import json
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from pipelines import full, target


def _conf(tmp_path: Path, tiny_target_cfg, stages: list[str]) -> Path:
    """A conf file pointing at the session's fixture target (already built and cached)."""
    from dataclasses import asdict

    conf = {"run_dir": str(tmp_path / "runs"), "stages": stages, "target": asdict(tiny_target_cfg)}
    path = tmp_path / "test.yaml"
    path.write_text(yaml.safe_dump(conf))
    return path


def _runs(tmp_path: Path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("specline")
    return client, client.search_runs([exp.experiment_id])


def test_target_stage_logs_the_tiny_target(tmp_path, tiny_target_cfg, tiny_target_build, capsys):
    from pipelines.cli import main

    assert main(target.run, "target", [f"conf={_conf(tmp_path, tiny_target_cfg, ['target'])}"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["target_path"] == str(tiny_target_build[0]) and result["num_layers"] == 4
    client, runs = _runs(tmp_path)
    (run,) = runs
    assert run.info.run_name == "target"
    assert run.data.metrics["heldout_perplexity"] > 1.0 and run.data.metrics["unigram_perplexity"] > 1.0
    assert run.data.metrics["built_now"] == 0  # built by the session fixture, reused from cache
    logged = {a.path for a in client.list_artifacts(run.info.run_id, "target")}
    assert "target/model.safetensors" in logged and "target/corpus" not in logged


def test_target_stage_logs_the_converted_smollm2(tmp_path, smollm2_cfg, smollm2_build, capsys):
    from pipelines.cli import main

    path, info, _ = smollm2_build
    assert main(target.run, "target", [f"conf={_conf(tmp_path, smollm2_cfg, ['target'])}"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["target_path"] == str(path) and result["num_layers"] == 30 and result["vocab_size"] == 49152
    client, (run,) = _runs(tmp_path)
    assert run.data.params["smollm2.gguf_sha256"] == info["source"]["gguf_sha256"]
    assert run.data.metrics["conversion_exact"] == 1 and run.data.metrics["built_now"] == 0
    assert "target/specline_target.json" in {a.path for a in client.list_artifacts(run.info.run_id, "target")}


def test_full_pipeline_nests_stage_runs_under_the_pipeline_run(tmp_path, tiny_target_cfg, capsys):
    from pipelines.cli import main

    assert main(full.run, "pipeline", [f"conf={_conf(tmp_path, tiny_target_cfg, ['target'])}"]) == 0
    result = json.loads(capsys.readouterr().out)
    _, runs = _runs(tmp_path)
    by_name = {r.info.run_name: r for r in runs}
    assert set(by_name) == {"pipeline", "target"}
    assert by_name["target"].data.tags["mlflow.parentRunId"] == by_name["pipeline"].info.run_id
    assert result["target_run_id"] == by_name["target"].info.run_id


@pytest.mark.parametrize("argv, message", [
    (["conf=dspark.yaml", "train.lrr=1"], "error: command line: unknown key 'train.lrr'"),
    (["conf=missing.yaml"], "error: conf file 'missing.yaml' not found"),
    (["conf=dspark.yaml", "stages=[nope]", "tracking.enabled=false"], "error: stages: unknown ['nope']"),
])
def test_bad_input_is_one_clear_line(argv, message, tmp_path, capsys):
    from pipelines.cli import main

    assert main(full.run, "pipeline", [*argv, f"run_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(message)  # after the stage lines, the error: one line, no traceback
    assert not any("Traceback" in line for line in err)
