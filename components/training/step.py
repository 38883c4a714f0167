"""One optimizer step of drafter training, and the state it advances.

The objective is a module (components/training/objectives: drafter + a registry loss + what the
objective needs) so that a DDP wrapper sees the whole forward; ``train_step`` runs forward →
finite check → backward → clip → finite check → optimizer + scheduler step and returns float metrics. A non-finite loss
or gradient norm raises :class:`NonFiniteLossError` *before* the optimizer touches a weight,
so the last good weights (and checkpoints) survive. In distributed runs ``agree`` turns a
local "finite" flag into the verdict of all ranks, so every rank stops at the same step.

Knows torch, the drafter interface and the loss registry; nothing about Ray, files or MLflow.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from components.config import TrainConfig
from components.drafters.base import DraftBatch, Drafter
from components.losses import DrafterLoss, build_loss
from components.target.kernels import cpuinfo
from components.training.padding import supervised_tokens
from components.training.sharding import check_strategy, full_tensor

Agree = Callable[[bool], bool]  # local flag → all ranks' verdict
MIXED_PRECISION = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16, "auto": None}


def autocast_dtype(setting: str, device: torch.device | str = "cpu") -> torch.dtype | None:
    """``train.mixed_precision`` → the autocast dtype of the forward (None: float32). ``auto``:
    bfloat16 where the device declares bfloat16 products faster than float32's (a CUDA GPU that
    supports them; a CPU whose oneDNN has bfloat16 kernels, unless it is an Intel CPU without the
    AMX tiles, where they measured slower: docs/results.md), else float32."""
    if setting not in MIXED_PRECISION:
        raise ValueError(f"train.mixed_precision: '{setting}' is not one of {sorted(MIXED_PRECISION)}")
    if setting != "auto":
        return MIXED_PRECISION[setting]
    if torch.device(device).type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return None
    intel_without_tiles = cpuinfo("vendor_id") == "GenuineIntel" and "amx_bf16" not in (cpuinfo("flags") or "").split()
    return None if intel_without_tiles else torch.bfloat16


class NonFiniteLossError(FloatingPointError):
    """The loss or gradient norm is NaN/inf; no weight was updated."""


@dataclass
class TrainState:
    """Everything a resumed run needs besides the data: weights, optimizer, schedule, RNG, position."""

    drafter: Drafter
    objective: nn.Module  # an Objective (components/training/objectives), or DDP/FSDP around it
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    generator: torch.Generator  # anchor sampling
    step: int = 0  # optimizer steps done
    epoch: int = 0  # epoch in progress
    batch_in_epoch: int = 0  # batches of ``epoch`` already consumed
    autocast: torch.dtype | None = None  # mixed precision of the forward (None: off)
    total_steps: int = 0  # optimizer steps planned (a curriculum's schedule)
    inner: nn.Module | None = None  # the objective inside any DDP/FSDP wrapper (None: ``objective``)


def build_train_loss(cfg: TrainConfig) -> DrafterLoss:
    """The configured registry loss with its parameters and position weighting."""
    return build_loss(cfg.loss, weighting=dict(cfg.weighting) or None, **dict(cfg.loss_params))


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine down to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / max(1, warmup)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def new_train_state(drafter: Drafter, cfg: TrainConfig, total_steps: int, seed: int,
                    wrap: Callable[[nn.Module], nn.Module] | None = None, objective: nn.Module | None = None) -> TrainState:
    """Fresh AdamW + warmup/cosine schedule over ``total_steps``; ``wrap`` e.g. adds DDP or FSDP
    (:func:`components.training.sharding.wrap`; the optimizer sees the wrapped, maybe sharded, parameters).

    ``objective`` defaults to the offline objective with ``cfg``'s loss."""
    if objective is None:
        from components.training.objectives import build_objective

        objective = build_objective("offline", drafter, build_train_loss(cfg))
    inner = objective
    if wrap is not None:
        objective = wrap(objective)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = lambda s: lr_factor(s, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    generator = torch.Generator().manual_seed(seed)
    check_strategy(cfg.strategy)
    device = next(drafter.parameters()).device
    return TrainState(drafter, objective, optimizer, scheduler, generator,
                      autocast=autocast_dtype(cfg.mixed_precision, device), total_steps=total_steps, inner=inner)


def _check(ok: bool, agree: Agree | None, what: str, step: int) -> None:
    if agree is not None:
        ok = agree(ok)
    if not ok:
        raise NonFiniteLossError(f"step {step + 1}: non-finite {what}; stopped before the optimizer step "
                                 "(weights and checkpoints are the last good ones)")


def train_step(state: TrainState, batch: DraftBatch, grad_clip: float = 1.0,
               agree: Agree | None = None) -> dict[str, float]:
    """One optimizer step on ``batch``; advances ``state.step``; returns float metrics."""
    t0 = time.perf_counter()
    state.objective.train()
    (state.inner or state.objective).at_step(state.step, state.total_steps)
    state.optimizer.zero_grad(set_to_none=True)
    device = batch.input_ids.device
    with torch.autocast(device.type, dtype=state.autocast or torch.bfloat16, enabled=state.autocast is not None):
        loss, out = state.objective(batch, state.generator)
    _check(bool(torch.isfinite(loss.detach())), agree, f"loss ({float(loss.detach())})", state.step)
    loss.backward()
    params = [p for p in state.drafter.parameters() if p.grad is not None]
    limit = grad_clip if grad_clip > 0 else float("inf")
    norm = full_tensor(torch.nn.utils.clip_grad_norm_(params, limit))  # FSDP: a DTensor of partial norms
    _check(bool(torch.isfinite(norm)), agree, f"gradient norm ({float(norm)})", state.step)
    lr = state.optimizer.param_groups[0]["lr"]
    state.optimizer.step()
    state.scheduler.step()
    state.step += 1
    metrics: dict[str, Any] = out.metrics("train/")
    metrics.update({"train/grad_norm": float(norm), "train/lr": lr, "train/tokens": supervised_tokens(batch),
                    "train/step_seconds": time.perf_counter() - t0})
    return metrics
