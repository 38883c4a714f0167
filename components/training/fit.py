"""One objective of the chain as one Ray Train run: plan, launch the TorchTrainer, keep its drafter.

``train.num_workers`` workers run :func:`components.training.loop.train_loop_per_worker` (DDP or
FSDP; nccl on GPUs, gloo on CPU). The run is named after the objective and, after the first
objective, after a digest of the drafter it starts from: rerunning the same command resumes
only a run that started from the same drafter (Ray Train finds its checkpoints under the same
name and storage path), and a changed earlier objective starts its successors afresh. A run
that Ray Train gives up on (e.g. a non-finite loss after ``train.max_failures`` restarts) is a
:class:`TrainingFailed` naming the cause; the last good checkpoint stays on disk.

Knows Ray Train and the worker loop's config; nothing about MLflow runs, evaluation or plots.
"""

from __future__ import annotations

import hashlib
import math
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from components.config import ConfigError, SpeclineConfig
from components.io import replace_dir
from components.training.chain import ObjectiveStage
from components.training.loop import train_loop_per_worker


class TrainingFailed(RuntimeError):
    """Ray Train gave up (e.g. a non-finite loss); the last good checkpoint is kept."""


@dataclass
class Fitted:
    """What one objective's Ray Train run left behind."""

    drafter_path: Path  # <output_dir>/drafters/<objective>: the trained drafter
    checkpoint: str  # Ray Train's last checkpoint directory
    seconds: float  # wall time of the run
    metrics: dict[str, Any]  # the last metrics rank 0 reported (train/step, train/loss, ...)


def plan_steps(num_train: int, cfg: SpeclineConfig) -> dict[str, int]:
    """Batches per epoch per worker and total optimizer steps for ``num_train`` records."""
    tc = cfg.train
    per_worker = num_train // tc.num_workers
    if per_worker < 1:
        raise ConfigError(f"train: {num_train} training records cannot feed {tc.num_workers} workers")
    spe = math.ceil(per_worker / tc.batch_size)
    return {"steps_per_epoch": spe, "total_steps": tc.max_steps if tc.max_steps > 0 else tc.epochs * spe}


def run_name(stage: ObjectiveStage, init: str | None) -> str:
    """The Ray Train run of an objective: its name, plus a digest of the drafter it starts from."""
    if not init:
        return stage.run_name
    digest = hashlib.sha256((Path(init) / "model.safetensors").read_bytes()).hexdigest()[:10]
    return f"{stage.run_name}-from-{digest}"


def worker_config(cfg: SpeclineConfig, stage: ObjectiveStage, plan: dict[str, int], target_path: str,
                  init: str | None, mlflow_ref: dict[str, str] | None) -> dict[str, Any]:
    """The ``train_loop_config`` every worker receives (``cfg.train`` is the stage's own)."""
    return {"cfg": cfg, "target_path": target_path, **plan, "init_drafter": init,
            "stage": {"name": stage.name, "params": stage.params}, "mlflow": mlflow_ref}


def launch(cfg: SpeclineConfig, dataset: Any, loop_config: dict[str, Any], storage: Path, name: str) -> Any:
    """``TorchTrainer.fit()`` of the worker loop on ``dataset``; its ``ray.train.Result``."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    tc = cfg.train
    trainer = TorchTrainer(
        train_loop_per_worker, train_loop_config=loop_config, datasets={"train": dataset},
        torch_config=TorchConfig(backend="nccl" if tc.use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=tc.num_workers, use_gpu=tc.use_gpu,
                                     resources_per_worker={"CPU": tc.cpus_per_worker}),
        run_config=RunConfig(name=name, storage_path=str(storage),
                             failure_config=FailureConfig(max_failures=tc.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=tc.keep_checkpoints)))
    ctrl_c = signal.getsignal(signal.SIGINT)
    try:
        return trainer.fit()
    except SystemExit as stop:  # Ray Train's Ctrl-C handler aborts the run, then exits the driver
        raise KeyboardInterrupt("train: interrupted; running it again resumes from the last checkpoint") from stop
    except Exception as err:
        text = str(err).strip()
        raise TrainingFailed(f"train: Ray Train failed after {tc.max_failures} restart(s): "
                             f"{text.splitlines()[-1] if text else type(err).__name__}") from err
    finally:  # Ray Train leaves its own Ctrl-C handler behind, which would swallow a later stage's Ctrl-C
        if threading.current_thread() is threading.main_thread() and ctrl_c is not None:
            signal.signal(signal.SIGINT, ctrl_c)


def fit_objective(cfg: SpeclineConfig, stage: ObjectiveStage, dataset: Any, loop_config: dict[str, Any],
                  out: Path, init: str | None) -> Fitted:
    """Runs (or resumes) ``stage`` under ``out`` and copies its drafter to ``out/drafters/<name>``."""
    t0 = time.perf_counter()
    result = launch(cfg, dataset, loop_config, out, run_name(stage, init))
    seconds = time.perf_counter() - t0
    if result.checkpoint is None:
        raise TrainingFailed(f"train: objective '{stage.name}' finished without a checkpoint")
    with result.checkpoint.as_directory() as d:
        drafter_path = copy_drafter(Path(d) / "drafter", out / "drafters" / stage.name)
    return Fitted(drafter_path, str(result.checkpoint.path), seconds, dict(result.metrics or {}))


def copy_drafter(source: Path, final: Path) -> Path:
    """A drafter directory → ``final`` (temp copy, then rename)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    shutil.copytree(source, tmp, dirs_exist_ok=True)
    replace_dir(tmp, final)
    return final
