"""Trainer checkpoints: the drafter in its own format plus optimizer, schedule, RNG and position.

Layout of a checkpoint directory (no pickle anywhere)::

    drafter/                 save_drafter format (config.json + model.safetensors)
    optimizer.safetensors    every tensor of the optimizer state, keyed "state.<param>.<name>"
    rng.safetensors          anchor generator state + torch CPU RNG state (uint8)
    trainer_state.json       step, epoch, batch_in_epoch, optimizer param groups and scalar state,
                             scheduler state, format version

FSDP-sharded training writes the same files (full tensors gathered on every rank, written by
rank 0) and loads them unsharded: weights before sharding, the optimizer state split after
(components/training/sharding.py).

Writes go to a temporary sibling renamed into place, so a crash never leaves a half-written
checkpoint under the final name, and an existing checkpoint is replaced only by a complete one.
Knows torch optimizers/schedulers and the drafter checkpoint format; nothing about Ray.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from components.drafters.base import Drafter
from components.drafters.checkpoint import SHARED_KEYS, WEIGHTS, check_weights, save_drafter
from components.io import replace_dir
from components.training.sharding import FullState, shard_optimizer_state
from components.training.step import TrainState

FORMAT_VERSION = 1
STATE_JSON = "trainer_state.json"
OPTIMIZER = "optimizer.safetensors"
RNG = "rng.safetensors"


def optimizer_to_files(optimizer: torch.optim.Optimizer | dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, JSON-able rest) of ``optimizer.state_dict()`` (or of such a state dict)."""
    sd = optimizer if isinstance(optimizer, dict) else optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, per_param in sd["state"].items():
        for name, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{idx}.{name}"] = value.detach().contiguous().cpu()
            else:
                scalars.setdefault(str(idx), {})[name] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def optimizer_from_files(tensors: dict[str, torch.Tensor], rest: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`optimizer_to_files`: a state dict ``load_state_dict`` accepts."""
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = value
    for idx, values in rest["scalars"].items():
        state.setdefault(int(idx), {}).update(values)
    groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in rest["param_groups"]]
    return {"state": state, "param_groups": groups}


def save_checkpoint(state: TrainState, path: str | Path, extra: dict[str, Any] | None = None,
                    full: FullState | None = None) -> Path:
    """Writes a complete checkpoint of ``state`` at ``path`` (atomically). Sharded (FSDP) training
    passes ``full``, the gathered weights and optimizer state, so the files are the same as DDP's."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        save_drafter(state.drafter, tmp / "drafter", full.weights if full is not None else None)
        tensors, rest = optimizer_to_files(full.optimizer if full is not None else state.optimizer)
        save_file(tensors, str(tmp / OPTIMIZER))
        save_file({"generator": state.generator.get_state(), "torch_cpu": torch.get_rng_state()}, str(tmp / RNG))
        meta = {"format_version": FORMAT_VERSION, "step": state.step, "epoch": state.epoch,
                "batch_in_epoch": state.batch_in_epoch, "optimizer": rest,
                "scheduler": state.scheduler.state_dict(), "extra": extra or {}}
        (tmp / STATE_JSON).write_text(json.dumps(meta, indent=2) + "\n")
        replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def read_trainer_state(path: str | Path) -> dict[str, Any]:
    """The JSON part of a checkpoint (step, epoch, position, optimizer scalars, extra)."""
    file = Path(path) / STATE_JSON
    if not file.is_file():
        raise FileNotFoundError(f"{path}: not a trainer checkpoint (no {STATE_JSON})")
    meta = json.loads(file.read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{file}: format version {meta.get('format_version')}, expected {FORMAT_VERSION}")
    return meta


def load_weights(drafter: Drafter, path: str | Path) -> None:
    """The checkpoint's drafter weights into ``drafter`` (unsharded: before any FSDP wrapping)."""
    path = Path(path)
    weights = {k: v for k, v in load_file(str(path / "drafter" / WEIGHTS)).items() if k not in SHARED_KEYS}
    check_weights(drafter, weights, str(path / "drafter"))
    drafter.load_state_dict(weights, strict=True)


def load_trainer_state(state: TrainState, path: str | Path) -> dict[str, Any]:
    """Restores optimizer (split like sharded parameters), scheduler, RNG and position into
    ``state``; returns the JSON. The weights are :func:`load_weights`'s job."""
    path = Path(path)
    meta = read_trainer_state(path)
    opt = optimizer_from_files(load_file(str(path / OPTIMIZER)), meta["optimizer"])
    state.optimizer.load_state_dict(shard_optimizer_state(state.optimizer, opt))
    state.scheduler.load_state_dict(meta["scheduler"])
    rng = load_file(str(path / RNG))
    state.generator.set_state(rng["generator"])
    torch.set_rng_state(rng["torch_cpu"])
    state.step, state.epoch, state.batch_in_epoch = meta["step"], meta["epoch"], meta["batch_in_epoch"]
    return meta


def load_checkpoint(state: TrainState, path: str | Path) -> dict[str, Any]:
    """Restores weights, optimizer, scheduler, RNG and position into an unsharded ``state``; returns the JSON."""
    read_trainer_state(path)  # refuses a non-checkpoint before touching the weights
    load_weights(state.drafter, path)
    return load_trainer_state(state, path)
