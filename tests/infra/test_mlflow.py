"""A real MLflow tracking server, as a user starts it with one command (``mlflow server``, a
SQLite backend, local artifacts proxied by the server), on a free loopback port; the pipeline's
data and train stages on the tiny fixture tracked to it over HTTP (``tracking.tracking_uri``);
then its runs, their nesting, metrics and artifacts and the registered drafter read back through
``MlflowClient`` against the server. The Kubernetes deployment (infra/mlflow/mlflow.yaml) runs
the same server with PostgreSQL and S3 behind it; tests/infra/test_kuberay.py validates it."""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from components.confload import load
from components.tracking import Tracker

pytestmark = pytest.mark.slow

EXPERIMENT = "specline-infra"
SMALL = ["stages=[data,train]", "data.max_prompts=8", "data.max_new_tokens=8", "data.batch_size=4",
         "data.shard_size=4", "data.num_actors=1", "data.cpus_per_actor=0.5",
         "drafter.block_size=4", "drafter.num_anchors=8", "drafter.markov_rank=8", "drafter.draft_vocab_size=0",
         "train.num_workers=1", "train.cpus_per_worker=0.5", "train.batch_size=2", "train.max_steps=2",
         "train.warmup_steps=1", "train.log_every=1", "train.checkpoint_every=2", "train.eval_fraction=0.25",
         "train.max_failures=0", f"tracking.experiment={EXPERIMENT}"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """An ``mlflow server`` process: started at once, waited for with ``ready()`` (so that its
    start-up overlaps the other fixtures')."""

    def __init__(self, root: Path):
        self.root, self.port = root, _free_port()
        self.uri, self.artifacts = f"http://127.0.0.1:{self.port}", root / "artifacts"
        self.log = (root / "server.log").open("wb")
        mlflow_cli = Path(sys.executable).parent / "mlflow"  # the environment's own entry point
        self.proc = subprocess.Popen(
            [str(mlflow_cli), "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(self.artifacts)],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=root)

    def ready(self, timeout_s: float = 90) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"mlflow server exited ({self.proc.returncode}):\n"
                            f"{(self.root / 'server.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return self.uri
            except OSError:
                pass
            assert time.monotonic() < deadline, f"mlflow server did not answer /health within {timeout_s} s"
            time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """An ``mlflow server`` on a free loopback port (SQLite, local artifacts), stopped afterwards."""
    server = Server(tmp_path_factory.mktemp("mlflow-server"))
    try:
        yield server
    finally:
        server.stop()


def test_a_pipeline_run_is_tracked_on_the_server_and_read_back(
        mlflow_server, tmp_path, monkeypatch, tiny_target_cfg, tiny_target_build, ray_session):
    import mlflow
    from mlflow.tracking import MlflowClient

    from pipelines import full

    uri, artifact_root = mlflow_server.ready(), mlflow_server.artifacts
    monkeypatch.chdir(tmp_path)
    cfg = load("dspark.yaml", [*SMALL, f"tracking.tracking_uri={uri}"])
    assert cfg.tracking.tracking_uri == uri  # a server's address is left as it is (not made a path)
    cfg = dataclasses.replace(cfg, target=tiny_target_cfg)
    tracker = Tracker(cfg)
    try:
        with tracker.run("pipeline") as parent_id:
            out = full.run(cfg, tracker, {})
    finally:
        while mlflow.active_run():
            mlflow.end_run()
    assert not (tmp_path / "runs" / "mlflow.db").exists()  # nothing went to the local store

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(EXPERIMENT)
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id], max_results=50)}
    assert {"pipeline", "data", "train", "train-offline"} <= set(runs), sorted(runs)
    assert runs["pipeline"].info.run_id == parent_id
    assert all(r.info.status == "FINISHED" for r in runs.values())
    for stage in ("data", "train"):  # each stage a nested run of the pipeline run
        assert runs[stage].data.tags["mlflow.parentRunId"] == parent_id
        assert runs[stage].data.tags["specline.stage"] == stage
    assert runs["train-offline"].data.tags["mlflow.parentRunId"] == runs["train"].info.run_id
    assert runs["data"].data.metrics["records"] == out["num_records"] > 0
    assert runs["pipeline"].data.params["tracking.tracking_uri"] == uri
    history = client.get_metric_history(runs["train-offline"].info.run_id, "train/loss")
    assert [m.step for m in history][-1] == 2  # the Ray Train worker (rank 0) logged over HTTP too

    # the drafter: an artifact the server stored (proxied: mlflow-artifacts:), and a registered model version
    train = runs["train"]
    assert train.info.artifact_uri.startswith("mlflow-artifacts:")
    names = {a.path for a in client.list_artifacts(train.info.run_id, "train/drafter")}
    assert "train/drafter/config.json" in names
    local = Path(client.download_artifacts(train.info.run_id, "train/drafter/config.json", str(tmp_path)))
    assert json.loads(local.read_text()) == json.loads((Path(out["drafter_path"]) / "config.json").read_text())
    assert list(artifact_root.rglob("train/drafter/config.json"))  # stored by the server, under its root
    (version,) = client.search_model_versions(f"name='{cfg.train.register_as}'")
    assert version.run_id == train.info.run_id and int(version.version) == out["registered_version"] == 1
