"""The per-worker training function a Ray ``TorchTrainer`` runs (one objective of the chain).

Each worker loads the frozen target (the drafter borrows its embedding and LM head), builds the
drafter (or loads the previous objective's), builds the stage's objective, resumes from
``ray.train.get_checkpoint()`` when the run (same name + storage path) has one (weights before
wrapping), wraps the objective per ``train.strategy`` when there are several workers (DDP, or
FSDP2 sharding the drafter's parameters: components/training/sharding.py; gloo on CPU), and
iterates its shard of the "train" dataset for ``total_steps`` optimizer steps. Every rank stops
at the same batch count per epoch (``steps_per_epoch``), so DDP/FSDP never wait on a rank that
ran dry.

Rank 0 logs metrics to the driver's MLflow run (Ray Train V2 rejects MLflowLoggerCallback) and
saves checkpoints that every rank reports together. Only rank 0's RNG state is checkpointed;
other ranks reseed their anchor generator from (seed, rank, step) on resume.
Knows Ray Train, torch.distributed and the training components; nothing about pipelines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from components.config import SpeclineConfig
from components.drafters import build_drafter, load_drafter
from components.logs import progress_line
from components.training import sharding
from components.training.inputs import shared_draft_vocab
from components.training.objectives import ObjectiveContext, build_objective, objective_class
from components.training.padding import numpy_batch_to_draft
from components.training.resume import (
    load_trainer_state,
    load_weights,
    read_trainer_state,
    save_checkpoint,
)
from components.training.sharding import distributed
from components.training.step import TrainState, build_train_loss, new_train_state, train_step


def all_sum(values: list[float]) -> list[float]:
    """Sums ``values`` over ranks (identity in a single process)."""
    if not distributed():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_agree(ok: bool) -> bool:
    """True only if every rank says True."""
    return all_sum([0.0 if ok else 1.0])[0] == 0.0


class MetricSink:
    """Rank 0 → the driver's MLflow run (by id); a no-op elsewhere or when tracking is off."""

    def __init__(self, mlflow_ref: dict[str, str] | None, rank: int):
        self.client: Any = None
        if rank == 0 and mlflow_ref:
            from mlflow.tracking import MlflowClient

            self.client, self.run_id = MlflowClient(mlflow_ref["uri"]), mlflow_ref["run_id"]

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.client is None:
            return
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = [Metric(k, float(v), ts, step) for k, v in metrics.items() if math.isfinite(float(v))]
        self.client.log_batch(self.run_id, metrics=items)


def _restore(state: TrainState, ckpt_dir: str | None, seed: int, rank: int) -> dict[str, Any]:
    """Optimizer, schedule, RNG and position from the run's checkpoint (weights are already in:
    :func:`_build_state`); returns its extra."""
    if ckpt_dir is None:
        return {}
    meta = load_trainer_state(state, ckpt_dir)
    if rank != 0:
        state.generator.manual_seed(seed * 1_000_003 + rank * 7919 + state.step)
    return meta.get("extra", {})


def _build_state(config: dict[str, Any], cfg: SpeclineConfig, target: Any, rank: int) -> tuple[TrainState, dict[str, Any]]:
    """The worker's train state, resumed from ``ray.train.get_checkpoint()`` when the run (same
    name + storage path) has one: the weights go into the plain drafter *before* it is wrapped
    (DDP, or FSDP which shards it), the optimizer state after. Returns (state, checkpoint extra)."""
    import ray.train

    drafter, objective = _drafter_and_objective(config, cfg, target)
    seed = cfg.train.seed * 1_000_003 + rank * 7919
    strategy = cfg.train.strategy
    ckpt = ray.train.get_checkpoint()
    with ckpt.as_directory() if ckpt is not None else contextlib.nullcontext(None) as ckpt_dir:
        if ckpt_dir is not None:
            read_trainer_state(ckpt_dir)  # refuses a broken checkpoint before touching the weights
            load_weights(drafter, ckpt_dir)
        state = new_train_state(drafter, cfg.train, config["total_steps"], seed,
                                lambda m: sharding.wrap(m, strategy), objective)
        return state, _restore(state, ckpt_dir, cfg.train.seed, rank)


def _report(state: TrainState, metrics: dict[str, float], rank: int, checkpoint: bool) -> None:
    """ray.train.report on every rank; rank 0 attaches a freshly written checkpoint (sharded
    weights and optimizer state are gathered on every rank first: a collective)."""
    import ray.train
    from ray.train import Checkpoint

    if not checkpoint:
        return
    full = sharding.gather_full_state(state.drafter, state.optimizer) if sharding.is_sharded(state.drafter) else None
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = None
        if rank == 0:
            path = save_checkpoint(state, Path(tmp) / "checkpoint", extra={"metrics": metrics}, full=full)
            ckpt = Checkpoint.from_directory(str(path))
        ray.train.report(metrics, checkpoint=ckpt)


def _window_metrics(window: list[dict[str, float]], seconds: float) -> dict[str, float]:
    """Means over the steps since the last log; tokens/s summed over ranks."""
    keys = set().union(*window)
    out = {k: sum(m[k] for m in window if k in m) / sum(1 for m in window if k in m) for k in keys}
    tokens, secs = all_sum([sum(m["train/tokens"] for m in window), seconds])
    out["train/tokens_per_s"] = tokens / max(1e-9, secs / max(1, dist.get_world_size() if distributed() else 1))
    out["train/lr"] = window[-1]["train/lr"]
    return out


def _progress_text(metrics: dict[str, float], total: int) -> str:
    """One console line: step, loss, first-draft acceptance and seconds a step of the last window."""
    parts = [f"train: step {int(metrics['train/step'])}/{total}"]
    for key, label, fmt in (("train/loss", "loss", ".3f"), ("train/alpha/1", "α1", ".2f"),
                            ("train/tau", "τ", ".2f"), ("train/step_seconds", "s/step", ".1f")):
        if key in metrics:
            parts.append(f"{label} {metrics[key]:{fmt}}")
    return ", ".join(parts)


def _run(state: TrainState, shard: Any, cfg: SpeclineConfig, plan: dict[str, int], sink: MetricSink,
         rank: int, extra: dict[str, Any]) -> None:
    tc, spe, total = cfg.train, plan["steps_per_epoch"], plan["total_steps"]
    window: list[dict[str, float]] = []
    first_loss = extra.get("metrics", {}).get("train/first_loss")
    saved_at, t0 = state.step, time.perf_counter()
    for epoch in range(state.epoch, math.ceil(total / spe)):
        state.epoch = epoch
        batches = iter(shard.iter_batches(batch_size=tc.batch_size, batch_format="numpy", prefetch_batches=1))
        i = 0
        while i < spe and state.step < total:
            raw = next(batches, None)
            if not all_agree(raw is not None):  # a rank ran dry: the epoch ends on every rank
                break
            i += 1
            if i <= state.batch_in_epoch:  # resume: already trained on this batch
                continue
            batch = numpy_batch_to_draft(raw, next(state.drafter.parameters()).device)
            window.append(train_step(state, batch, tc.grad_clip, all_agree))
            state.batch_in_epoch = i
            first_loss = window[-1]["train/loss"] if first_loss is None else first_loss
            save = state.step >= total or state.step % tc.checkpoint_every == 0
            if save or state.step % tc.log_every == 0:
                metrics = _window_metrics(window, time.perf_counter() - t0)
                metrics.update({"train/first_loss": first_loss, "train/epoch": epoch, "train/step": state.step})
                sink.log(metrics, state.step)
                if rank == 0:
                    print(progress_line(_progress_text(metrics, total)), file=sys.stderr, flush=True)
                _report(state, metrics, rank, save)
                saved_at = state.step if save else saved_at
                window, t0 = [], time.perf_counter()
        if state.step < total:
            state.epoch, state.batch_in_epoch = epoch + 1, 0
    if state.step != saved_at:  # the data ended before total_steps: keep the last steps too
        metrics = _window_metrics(window, time.perf_counter() - t0) if window else {}
        _report(state, {**metrics, "train/first_loss": first_loss, "train/step": state.step}, rank, True)


def _drafter_and_objective(config: dict[str, Any], cfg: SpeclineConfig, target: Any) -> tuple[Any, Any]:
    """The stage's drafter (fresh, or the previous stage's with the objective's overrides) and objective."""
    stage = config["stage"]
    cls = objective_class(stage["name"])
    torch.manual_seed(cfg.train.seed)  # same initial drafter on every rank (DDP also broadcasts)
    if config.get("init_drafter"):
        drafter = load_drafter(config["init_drafter"], target, dict(cls.drafter_overrides) or None)
    else:
        drafter = build_drafter(dataclasses.replace(cfg.drafter, **cls.drafter_overrides), target)
        drafter = shared_draft_vocab(cfg, drafter)  # the vocabulary the train stage chose (if any)
    objective = build_objective(stage["name"], drafter, build_train_loss(cfg.train), stage["params"],
                                ObjectiveContext(target=target))
    return drafter, objective


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Entry point of every worker; ``config``: cfg (train = this stage's), stage {name, params},
    init_drafter, target_path, total_steps, steps_per_epoch, mlflow."""
    import ray.train

    from components.target import load_target

    cfg: SpeclineConfig = config["cfg"]
    torch.set_num_threads(max(1, cfg.train.torch_threads))
    rank = ray.train.get_context().get_world_rank()
    target = load_target(dataclasses.replace(cfg.target, name_or_path=config["target_path"]), progress=False)
    state, extra = _build_state(config, cfg, target, rank)
    plan = {"steps_per_epoch": config["steps_per_epoch"], "total_steps": config["total_steps"]}
    sink = MetricSink(config.get("mlflow"), rank)
    if state.step >= plan["total_steps"]:  # a finished run rerun: report its final checkpoint again
        _report(state, dict(extra.get("metrics", {})), rank, checkpoint=True)
        return
    _run(state, ray.train.get_dataset_shard("train"), cfg, plan, sink, rank, extra)
