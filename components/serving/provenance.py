"""Which drafter the serve stage serves, and where its checkpoint is.

``serve.drafter=suffix`` is suffix decoding, with no checkpoint; ``serve.drafter=hybrid`` is
suffix decoding beside the trained drafter found as for ``auto``. For ``auto``, in order:
``serve.drafter=none`` (the target alone); ``serve.drafter_path`` (a checkpoint
directory); ``serve.drafter_run_id`` (the ``train/drafter`` artifact of that MLflow run,
downloaded once into ``<run_dir>/serve/drafters/<run id>``); the train stage's drafter
(``upstream["drafter_path"]`` and its run id). Nothing set is a ``ConfigError`` that says which
key to set. The checkpoint itself is loaded (safetensors only, target and tokenizer checked) by
``components.drafters.load_drafter`` inside each replica.

Knows the config, the upstream keys of the train stage and MLflow's artifact download; nothing
about models or HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from components.config import ConfigError, SpeclineConfig, run_dir

DRAFTER_ARTIFACT = "train/drafter"  # where the train stage logs its final drafter


@dataclass(frozen=True)
class DrafterSource:
    """The served drafter: its checkpoint directory (None: no drafter) and where it came from."""

    path: str | None
    origin: str  # "none" | "serve.drafter_path" | "serve.drafter_run_id" | "train stage" | "serve.drafter"
    run_id: str | None = None  # the MLflow run that wrote it, when known
    version: int | None = None  # its registered model version, when known
    method: str = "model"  # "model" (the checkpoint) | "suffix" (no checkpoint) | "hybrid" (both)

    @property
    def speculates(self) -> bool:
        """Whether a drafter is served at all."""
        return self.path is not None or self.method == "suffix"

    @property
    def label(self) -> str:
        """A short public name: the run id, else the checkpoint directory's name (``suffix``,
        ``hybrid+<name>`` for suffix decoding alone and beside it)."""
        if self.method == "suffix":
            return "suffix"
        if self.path is None:
            return "none"
        name = self.run_id or Path(self.path).name
        return f"hybrid+{name}" if self.method == "hybrid" else name


def resolve_drafter(cfg: SpeclineConfig, upstream: dict[str, Any], tracking_uri: str | None) -> DrafterSource:
    sc = cfg.serve
    if sc.drafter == "none":
        return DrafterSource(None, "none")
    if sc.drafter == "suffix":
        return DrafterSource(None, "serve.drafter", method="suffix")
    trained = _trained(cfg, upstream, tracking_uri)
    return replace(trained, method="hybrid") if sc.drafter == "hybrid" else trained


def _trained(cfg: SpeclineConfig, upstream: dict[str, Any], tracking_uri: str | None) -> DrafterSource:
    """The trained drafter's checkpoint: drafter_path, drafter_run_id, the train stage's."""
    sc = cfg.serve
    if sc.drafter_path:
        return DrafterSource(_checked(sc.drafter_path, "serve.drafter_path"), "serve.drafter_path")
    if sc.drafter_run_id:
        return DrafterSource(_download(cfg, sc.drafter_run_id, tracking_uri), "serve.drafter_run_id",
                             sc.drafter_run_id)
    if upstream.get("drafter_path"):
        return DrafterSource(_checked(upstream["drafter_path"], "the train stage's drafter_path"), "train stage",
                             upstream.get("train_run_id"), upstream.get("registered_version"))
    raise ConfigError("serve.drafter: no drafter to serve; set serve.drafter_path=<checkpoint dir>, "
                      "serve.drafter_run_id=<MLflow run of a train stage>, run the train stage first, "
                      "serve.drafter=suffix for suffix decoding, or serve.drafter=none to serve the target alone")


def _checked(path: str, key: str) -> str:
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"{key}: '{path}' is not a drafter checkpoint directory (no config.json)")
    return path


def _download(cfg: SpeclineConfig, run_id: str, tracking_uri: str | None) -> str:
    import mlflow
    from mlflow.exceptions import MlflowException

    dest = run_dir(cfg) / "serve" / "drafters" / run_id
    if (dest / DRAFTER_ARTIFACT / "config.json").is_file():  # fetched before
        return str(dest / DRAFTER_ARTIFACT)
    dest.mkdir(parents=True, exist_ok=True)
    try:
        got = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=DRAFTER_ARTIFACT,
                                                  dst_path=str(dest), tracking_uri=tracking_uri)
    except (MlflowException, OSError) as err:
        raise ConfigError(f"serve.drafter_run_id: cannot fetch '{DRAFTER_ARTIFACT}' of MLflow run {run_id}: "
                          f"{str(err).splitlines()[0]}") from None
    return _checked(got, "serve.drafter_run_id")
