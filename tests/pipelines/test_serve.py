"""The serve stage as the last stage of the full pipeline: it serves the train stage's drafter
(``serve.block=false`` returns once the app is up; its replica answers once warm), prints the
endpoint and a sample curl, and its MLflow run records which drafter run it serves; missing
inputs are clear errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from components.config import ConfigError, DrafterConfig, ServeConfig, SpeclineConfig
from components.tracking import Tracker
from pipelines import full, serve
from tests.components.serving.http_util import free_port, request, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, tiny_target) -> Path:
    from components.drafters import build_drafter, save_drafter

    torch.manual_seed(0)
    drafter = build_drafter(DrafterConfig(name="dspark", num_layers=1, block_size=4, markov_rank=8), tiny_target)
    return save_drafter(drafter, tmp_path_factory.mktemp("serve-stage") / "drafter")


def _cfg(spec_cfg: SpeclineConfig, **serve_fields) -> SpeclineConfig:
    sc = ServeConfig(**{"port": free_port(), "block": False, "adaptive": False, "cpus_per_replica": 0.5,
                        "model_name": "tiny", **serve_fields})
    return dataclasses.replace(spec_cfg, stages=["serve"], serve=sc)


def test_serve_is_the_full_pipelines_last_stage(spec_cfg, tiny_target_build, drafter_dir, ray_session, capsys):
    from ray import serve as ray_serve

    cfg = _cfg(spec_cfg)
    tracker = Tracker(cfg)
    upstream = {"target_path": str(tiny_target_build[0]), "drafter_path": str(drafter_dir),
                "train_run_id": "train-run-1", "registered_version": 3,  # and the eval's figures (serve.drafter=auto)
                "eval_speedup": {"target_only": 1.0, "drafter": 1.25, "suffix": 1.1},  # serve.adaptive=false: fixed γ
                "eval_lossless": {"target_only": True, "drafter": True, "suffix": True}}
    try:
        with tracker.run("pipeline"):
            out = full.run(cfg, tracker, upstream)
        assert out["serve_endpoint"] == f"http://127.0.0.1:{cfg.serve.port}"
        assert out["serve_drafter_run_id"] == "train-run-1" and out["serve_model"] == "tiny"
        # the stage returns once Serve routes to the replica, which may still be warming up
        assert wait_for(lambda: request(cfg.serve.port, "GET", "/health")[0] == 200, timeout=60)
        status, _, body = request(cfg.serve.port, "GET", "/v1/models")
        drafter = json.loads(body)["data"][0]["specline"]["drafter"]
        assert status == 200 and (drafter["run_id"], drafter["version"]) == ("train-run-1", 3)
        printed = capsys.readouterr().err
        assert f"curl http://127.0.0.1:{cfg.serve.port}/v1/chat/completions" in printed and "dashboard" in printed
        assert "serve.drafter=auto serves train-run-1: the fastest in the eval stage: drafter (" in printed
    finally:
        ray_serve.shutdown()
    client = MlflowClient(f"sqlite:///{Path(cfg.run_dir).resolve() / 'mlflow.db'}")
    params = client.get_run(out["serve_run_id"]).data.params
    assert params["serve.drafter_run"] == "train-run-1" and params["serve.drafter_source"] == "train stage"
    assert params["serve.drafter_checkpoint"] == str(drafter_dir.resolve())
    assert params["serve.drafter_served"] == "train-run-1" and "drafter 1.25×" in params["serve.drafter_why"]
    assert "serve.api_key" not in params


def test_serve_stage_says_what_is_missing(spec_cfg, tiny_target_build, monkeypatch):
    tracker = Tracker(dataclasses.replace(spec_cfg, tracking=dataclasses.replace(spec_cfg.tracking, enabled=False)))
    upstream = {"target_path": str(tiny_target_build[0])}
    with pytest.raises(ConfigError, match="serve.drafter_path"):
        serve.run(_cfg(spec_cfg), tracker, upstream)
    with pytest.raises(ConfigError, match="not a drafter checkpoint"):
        serve.run(_cfg(spec_cfg, drafter_path="/nonexistent/drafter"), tracker, upstream)
    monkeypatch.delenv("SPECLINE_TEST_KEY", raising=False)
    with pytest.raises(ConfigError, match="SPECLINE_TEST_KEY"):
        serve.run(_cfg(spec_cfg, drafter="none", api_key_env="SPECLINE_TEST_KEY"), tracker, upstream)
    with pytest.raises(ConfigError, match="overload_status"):
        ServeConfig(overload_status=500)


def test_sigterm_stops_a_serving_process_as_ctrl_c_does(tmp_path, tiny_target_build):
    """What Kubernetes, systemd and ``docker stop`` send: the app, Serve and Ray shut down, one
    line says so, and the process ends with status 0."""
    import os
    import signal
    import subprocess
    import sys

    port = free_port()
    cmd = [sys.executable, "-m", "pipelines.serve", "conf=dspark.yaml", f"target.name_or_path={tiny_target_build[0]}",
           f"run_dir={tmp_path / 'runs'}", "serve.drafter=none", f"serve.port={port}", "serve.adaptive=false",
           "serve.cpus_per_replica=0.5", "serve.model_name=tiny", "tracking.enabled=false"]
    out_file, err_file = tmp_path / "stdout", tmp_path / "stderr"
    with out_file.open("w") as stdout, err_file.open("w") as stderr:
        proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[2], stdout=stdout, stderr=stderr,
                                env=os.environ | {"PYTHONUNBUFFERED": "1"})
        try:
            assert wait_for(lambda: proc.poll() is not None or request(port, "GET", "/health")[0] == 200, timeout=240)
            assert proc.poll() is None, err_file.read_text()[-3000:]
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    out, err = out_file.read_text(), err_file.read_text()
    assert proc.returncode == 0, err[-3000:]
    assert "serve: SIGTERM: shutting down" in err and "SystemExit" not in err
    assert json.loads(out)["serve_endpoint"] == f"http://127.0.0.1:{port}"


def test_suffix_rollouts_auto_is_resolved_before_replicas_start(spec_cfg, tmp_path):
    """auto → the upstream data directory (else data.output_dir) where suffix decoding serves;
    ``none`` when neither holds shards; left alone for a checkpoint alone."""
    from components.serving.provenance import DrafterSource

    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text(json.dumps({"meta": {"target": str(tmp_path / "target")}}))
    suffix, model = DrafterSource(None, "test", method="suffix"), DrafterSource("/ckpt", "test", method="model")
    cfg, target = _cfg(spec_cfg), str(tmp_path / "target")
    assert serve._with_rollouts(cfg, {"data_dir": str(data)}, suffix, target).serve.suffix_rollouts == str(data)
    assert serve._with_rollouts(cfg, {"data_dir": str(tmp_path / "no")}, suffix, target).serve.suffix_rollouts == "none"
    assert serve._with_rollouts(cfg, {"data_dir": str(data)}, model, target).serve.suffix_rollouts == "auto"
    # another target's rollouts: an empty tree, said so
    assert serve._with_rollouts(cfg, {"data_dir": str(data)}, suffix, "/models/other").serve.suffix_rollouts == "none"
