"""The data stage as a pipeline: MLflow logging, nesting under the pipeline run, CLI errors."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from pipelines import data, full
from pipelines.cli import main

DATA = {"max_prompts": 4, "max_new_tokens": 6, "batch_size": 2, "shard_size": 2, "storage": "int8",
        "cpus_per_actor": 0.5, "log_samples": 2}


def _conf(tmp_path: Path, tiny_target_cfg, stages: list[str], **data_overrides) -> Path:
    conf = {"run_dir": str(tmp_path / "runs"), "stages": stages, "target": asdict(tiny_target_cfg),
            "data": {**DATA, **data_overrides}}
    path = tmp_path / "test.yaml"
    path.write_text(yaml.safe_dump(conf))
    return path


@pytest.mark.slow
def test_full_pipeline_runs_data_as_a_nested_logged_stage(tmp_path, tiny_target_cfg, tiny_target_build,
                                                          ray_session, capfd):
    conf = _conf(tmp_path, tiny_target_cfg, ["target", "data"])
    assert main(full.run, "pipeline", [f"conf={conf}"]) == 0
    printed = capfd.readouterr()  # file descriptors: Ray's C++ core worker writes to fd 2 itself
    assert "core_worker" not in printed.err  # e.g. its warning about restartable actors (ray#53727)
    result = json.loads(printed.out[printed.out.index("{"):])
    assert result["num_records"] == 4 and result["data_meta"]["storage"] == "int8"
    manifest = json.loads(Path(result["manifest"]).read_text())
    assert manifest["totals"]["records"] == 4 and len(manifest["shards"]) == 2
    assert manifest["totals"]["bytes_per_token"] == result["bytes_per_token"] > 0

    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("specline").experiment_id])
    by_name = {r.info.run_name: r for r in runs}
    run = by_name["data"]
    assert run.data.tags["mlflow.parentRunId"] == by_name["pipeline"].info.run_id
    for key in ("records", "tokens", "bytes_per_token", "tokens_per_s", "shards_done", "prompts_used"):
        assert key in run.data.metrics, key
    assert run.data.params["data.storage"] == "int8"
    history = client.get_metric_history(run.info.run_id, "shards_done")
    assert [m.value for m in history] == [1, 2]  # progress logged shard by shard
    logged = {a.path for a in client.list_artifacts(run.info.run_id, "data")}
    assert {"data/manifest.json", "data/rollouts_sample.md"} <= logged

    # Same directory, another layer set: the stage's inputs changed, so it runs again (its earlier
    # output removed first) and says why (components/reuse.py)
    argv = [f"conf={conf}", "drafter.layer_ids=[0,1]", "tracking.enabled=false"]
    assert main(data.run, "data", argv) == 0
    printed = capfd.readouterr()
    assert "inputs changed" in printed.err and not any("Traceback" in line for line in printed.err.splitlines())
    again = json.loads(printed.out[printed.out.index("{"):])
    assert tuple(json.loads(Path(again["manifest"]).read_text())["meta"]["layer_ids"]) == (0, 1)


def test_stream_mode_describes_the_stream_without_writing(tmp_path, tiny_target_cfg, tiny_target_build, capsys):
    conf = _conf(tmp_path, tiny_target_cfg, ["data"], mode="stream")
    assert main(data.run, "data", [f"conf={conf}", "tracking.enabled=false"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["data_mode"] == "stream" and result["num_prompts"] == 4 and "data_dir" not in result
    assert not (tmp_path / "runs" / "data").exists()


def test_bad_data_settings_are_one_clear_line(tmp_path, tiny_target_cfg, tiny_target_build, capsys):
    conf = _conf(tmp_path, tiny_target_cfg, ["data"])
    assert main(data.run, "data", [f"conf={conf}", "data.storage=int4", "tracking.enabled=false"]) == 2
    assert "error: data.storage: 'int4' is not one of" in capsys.readouterr().err
    assert main(data.run, "data", [f"conf={conf}", f"data.prompt_source={tmp_path}/x.jsonl",
                                   "tracking.enabled=false"]) == 2
    assert "x.jsonl' is not a file" in capsys.readouterr().err
    # a drafter setting the target cannot serve (a layer it does not have): one line, no traceback
    assert main(data.run, "data", [f"conf={conf}", "drafter.layer_ids=[0,99]", "tracking.enabled=false"]) == 2
    err = capsys.readouterr().err
    assert "error: drafter.layer_ids [0, 99]: [99] out of range" in err and "Traceback" not in err
