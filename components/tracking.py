"""MLflow tracking for specline runs.

A pipeline run is the parent MLflow run; each stage is a nested child run. A stage started on
its own (``python -m pipelines.<stage>``) is a top-level run. By default runs go to a local
sqlite store at ``<run_dir>/mlflow.db`` (absolute URI) with artifacts under
``<run_dir>/mlartifacts``; in production ``tracking.tracking_uri`` names a tracking server.
Only rank 0 logs in distributed code: on other ranks every call here is a no-op.

This module knows MLflow and the config schema; it knows nothing about what a stage does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from components.config import SpeclineConfig, run_dir
from components.confload import flatten, to_dict, to_yaml

MAX_PARAM_LEN = 500  # MLflow rejects longer parameter values


def is_rank_zero() -> bool:
    """True outside distributed code and on global rank 0 inside it (Ray Train or torchrun)."""
    try:
        import ray.train

        return ray.train.get_context().get_world_rank() == 0
    except Exception:  # noqa: BLE001 -- not inside a Ray Train worker (error type varies by version)
        return int(os.environ.get("RANK", "0")) == 0


def tracking_uri(cfg: SpeclineConfig) -> str:
    if cfg.tracking.tracking_uri:
        return cfg.tracking.tracking_uri
    return f"sqlite:///{run_dir(cfg) / 'mlflow.db'}"


def artifact_location(cfg: SpeclineConfig) -> str | None:
    """Explicit local artifact root for the default sqlite store; the server decides otherwise."""
    if cfg.tracking.tracking_uri:
        return None
    return (run_dir(cfg) / "mlartifacts").as_uri()


SECRET_KEYS = (("serve", "api_key"),)  # config fields never written to a tracking server


def redacted(cfg: SpeclineConfig) -> SpeclineConfig:
    """A copy of ``cfg`` with every set secret replaced by ``"<redacted>"``."""
    for section, key in SECRET_KEYS:
        part = getattr(cfg, section)
        if getattr(part, key) is not None:
            cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(part, **{key: "<redacted>"})})
    return cfg


class Tracker:
    """Thin wrapper over MLflow that a pipeline and its stages share."""

    def __init__(self, cfg: SpeclineConfig):
        self.cfg = cfg
        self.enabled = cfg.tracking.enabled and is_rank_zero()
        self._mlflow: Any = None
        if self.enabled:
            import mlflow

            mlflow.set_tracking_uri(tracking_uri(cfg))
            self._ensure_experiment(mlflow)
            self._mlflow = mlflow

    def _ensure_experiment(self, mlflow: Any) -> None:
        name = self.cfg.tracking.experiment
        if mlflow.get_experiment_by_name(name) is None:
            mlflow.create_experiment(name, artifact_location=artifact_location(self.cfg))
        mlflow.set_experiment(name)

    @contextlib.contextmanager
    def run(self, name: str, log_config: bool = True) -> Iterator[str | None]:
        """A run nested under the active one if there is one; yields its run id (None if off)."""
        if not self.enabled:
            yield None
            return
        nested = self._mlflow.active_run() is not None
        with self._mlflow.start_run(run_name=name, nested=nested) as active:
            self._mlflow.set_tag("specline.stage", name)
            if log_config and not nested:
                self.log_config()
            yield active.info.run_id

    def log_config(self) -> None:
        """The resolved config as params and ``config.yaml``, secrets (``SECRET_KEYS``) redacted."""
        cfg = redacted(self.cfg)
        params = {k: str(v)[:MAX_PARAM_LEN] for k, v in flatten(to_dict(cfg)).items()}
        self._mlflow.log_params(params)
        self.log_text(to_yaml(cfg), "config.yaml")

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        if self.enabled:
            numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
            self._mlflow.log_metrics(numeric, step=step)

    def set_tags(self, tags: dict[str, Any]) -> None:
        if self.enabled:
            self._mlflow.set_tags({k: str(v)[:MAX_PARAM_LEN] for k, v in tags.items()})

    def active_run_id(self) -> str | None:
        """The id of the MLflow run in progress (the stage's), None when tracking is off."""
        if not self.enabled:
            return None
        active = self._mlflow.active_run()
        return active.info.run_id if active else None

    def tag_model_version(self, name: str, version: int, tags: dict[str, Any]) -> None:
        """Tags version ``version`` of registered model ``name`` (e.g. with the eval stage's figures)."""
        if self.enabled:
            from mlflow.tracking import MlflowClient

            client = MlflowClient(tracking_uri(self.cfg))
            for key, value in tags.items():
                client.set_model_version_tag(name, str(version), key, str(value)[:MAX_PARAM_LEN])

    def log_params(self, params: dict[str, Any]) -> None:
        if self.enabled:
            self._mlflow.log_params({k: str(v)[:MAX_PARAM_LEN] for k, v in params.items()})

    def log_text(self, text: str, artifact_file: str) -> None:
        if self.enabled:
            self._mlflow.log_text(text, artifact_file)

    def log_dict(self, data: dict[str, Any], artifact_file: str) -> None:
        if self.enabled:
            self._mlflow.log_dict(data, artifact_file)

    def log_artifacts(self, local_dir: Path, artifact_path: str | None = None,
                      exclude: tuple[str, ...] = ()) -> None:
        """Logs a directory; top-level entries named in ``exclude`` are left out."""
        if not self.enabled:
            return
        for entry in sorted(local_dir.iterdir()):
            if entry.name in exclude:
                continue
            if entry.is_dir():
                sub = f"{artifact_path}/{entry.name}" if artifact_path else entry.name
                self._mlflow.log_artifacts(str(entry), sub)
            else:
                self._mlflow.log_artifact(str(entry), artifact_path)
