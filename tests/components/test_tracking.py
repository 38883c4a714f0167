from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from components.config import SpeclineConfig, TrackingConfig
from components.tracking import Tracker, is_rank_zero, tracking_uri


def _client(cfg: SpeclineConfig) -> MlflowClient:
    return MlflowClient(tracking_uri(cfg))


def test_parent_and_nested_runs_with_config_logged(tmp_path: Path):
    cfg = SpeclineConfig(run_dir=str(tmp_path / "runs"))
    tracker = Tracker(cfg)
    with tracker.run("pipeline") as parent_id, tracker.run("target") as child_id:
        tracker.log_metrics({"x": 1.5, "skipped": "text"})
    assert tracking_uri(cfg) == f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    client = _client(cfg)
    parent, child = client.get_run(parent_id), client.get_run(child_id)
    assert child.data.tags["mlflow.parentRunId"] == parent_id
    assert child.data.metrics == {"x": 1.5}
    assert parent.data.params["train.lr"] == str(cfg.train.lr)
    assert "config.yaml" in [a.path for a in client.list_artifacts(parent_id)]
    # artifacts live under the run directory, not in the working directory
    assert (tmp_path / "runs" / "mlartifacts").is_dir()
    assert not Path("mlruns").exists()


def test_log_artifacts_excludes_named_entries(tmp_path: Path):
    src = tmp_path / "ckpt"
    (src / "corpus").mkdir(parents=True)
    (src / "corpus" / "big.jsonl").write_text("{}\n")
    (src / "sub").mkdir()
    (src / "sub" / "a.txt").write_text("a")
    (src / "config.json").write_text("{}")
    cfg = SpeclineConfig(run_dir=str(tmp_path / "runs"))
    tracker = Tracker(cfg)
    with tracker.run("t") as run_id:
        tracker.log_artifacts(src, "model", exclude=("corpus",))
    names = {a.path for a in _client(cfg).list_artifacts(run_id, "model")}
    assert names == {"model/config.json", "model/sub"}


def test_disabled_tracking_writes_nothing(tmp_path: Path):
    cfg = SpeclineConfig(run_dir=str(tmp_path / "runs"), tracking=TrackingConfig(enabled=False))
    tracker = Tracker(cfg)
    with tracker.run("x") as run_id:
        tracker.log_metrics({"a": 1})
    assert run_id is None and not (tmp_path / "runs" / "mlflow.db").exists()


def test_only_rank_zero_logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("RANK", "1")
    assert not is_rank_zero()
    cfg = SpeclineConfig(run_dir=str(tmp_path / "runs"))
    assert not Tracker(cfg).enabled


@pytest.fixture(autouse=True)
def _no_leftover_active_run():
    yield
    while mlflow.active_run():
        mlflow.end_run()


def test_secrets_are_not_logged(tmp_path: Path):
    from components.config import ServeConfig

    cfg = SpeclineConfig(run_dir=str(tmp_path / "runs"), serve=ServeConfig(api_key="sk-very-secret"))
    tracker = Tracker(cfg)
    with tracker.run("pipeline") as run_id:
        pass
    client = _client(cfg)
    assert client.get_run(run_id).data.params["serve.api_key"] == "<redacted>"
    local = client.download_artifacts(run_id, "config.yaml", str(tmp_path))
    assert "sk-very-secret" not in Path(local).read_text()
    assert cfg.serve.api_key == "sk-very-secret"  # the running config keeps it
