"""Data-parallel strategies of the training workers (``train.strategy``): DDP or FSDP.

* ``ddp`` (default): ``DistributedDataParallel`` around the objective module; every rank holds
  the whole drafter, its gradients and its optimizer state.
* ``fsdp``: PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``) on the objective module, one
  FSDP unit. Its parameters are exactly the drafter's own: the target's embedding table and LM
  head are kept outside the drafter's registered modules (``Drafter.shared``) and the objective's
  frozen target is not a submodule either, so the shared parts are never sharded. Between steps
  every rank holds one shard (``Shard(0)``) of each drafter parameter, of its gradient and of
  AdamW's moments; the objective's forward all-gathers the parameters and the backward
  reduce-scatters the gradients. One unit because the drafters call their layers' pieces
  (e.g. ``Attention.project_kv``) outside those layers' ``forward``, where a per-layer unit
  would still be sharded.

Checkpoints keep the unsharded format: :func:`gather_full_state` (a collective: every rank calls
it) assembles full tensors of the weights and the optimizer state, rank 0 writes them with the
ordinary writers; on resume the weights are loaded into the plain drafter *before* sharding and
the optimizer state is split with :func:`shard_optimizer_state` after. FSDP reduce-scatters the
gradients of the parameters that have one, so every rank must produce gradients for the same
set: the wrapper adds ``0 × Σ parameters`` to the loss (no effect on values or gradients beyond
turning "no gradient" into a zero gradient), which DDP's ``find_unused_parameters`` handles on
its own. Knows torch.distributed; nothing about Ray, files or drafter families.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from components.config import ConfigError

STRATEGIES = ("ddp", "fsdp")


def check_strategy(strategy: str, key: str = "train.strategy") -> str:
    """``strategy`` if known, else a ConfigError naming ``key``."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"{key}: '{strategy}' is not a training strategy; use one of {', '.join(STRATEGIES)} "
                          "(ddp: replicated drafter, fsdp: drafter parameters sharded over the workers)")
    return strategy


def distributed() -> bool:
    """A process group with more than one rank is up."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class EveryParameterUsed(nn.Module):
    """The objective, with ``0 × Σ parameters`` added to its loss so that every rank produces a
    gradient (maybe zero) for every drafter parameter: FSDP's reduce-scatter and DDP's bucketed
    all-reduce need the same set on every rank, and objectives may leave a parameter unused on a batch (e.g. carryover's
    E_carry when no draft of the batch was rejected)."""

    def __init__(self, objective: nn.Module):
        super().__init__()
        self.objective = objective

    def forward(self, batch: Any, generator: torch.Generator | None = None) -> tuple[Tensor, Any]:
        loss, out = self.objective(batch, generator)
        touch = sum((p.sum() for p in self.objective.parameters() if p.requires_grad), loss.new_zeros(()))
        return loss + 0.0 * touch, out


def wrap(module: nn.Module, strategy: str) -> nn.Module:
    """``module`` (an objective) under ``strategy`` when several ranks train; itself otherwise."""
    check_strategy(strategy)
    if not distributed():
        return module
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # every parameter gets a gradient (maybe zero) on every rank: no unused-parameter search
        return DistributedDataParallel(EveryParameterUsed(module))
    from torch.distributed.fsdp import fully_shard

    return fully_shard(EveryParameterUsed(module))


def full_tensor(t: Tensor) -> Tensor:
    """The whole tensor of a DTensor (a collective: every rank calls it), ``t`` itself otherwise."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def is_sharded(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` is a DTensor (FSDP-sharded)."""
    return any(isinstance(p, DTensor) for p in module.parameters())


@dataclass
class FullState:
    """Unsharded copies (CPU) of what a checkpoint stores from sharded training."""

    weights: dict[str, Tensor]  # drafter.state_dict() keys, full shapes
    optimizer: dict[str, Any]  # optimizer.state_dict() layout, full tensors


def gather_full_state(drafter: nn.Module, optimizer: torch.optim.Optimizer) -> FullState:
    """Full weights and optimizer state of sharded training; a collective: every rank calls it in
    the same order (only rank 0 needs the result)."""
    weights = {k: full_tensor(v).detach().cpu() for k, v in drafter.state_dict().items()}
    sd = optimizer.state_dict()
    state = {idx: {name: full_tensor(v).detach().cpu() if isinstance(v, Tensor) else v for name, v in per.items()}
             for idx, per in sd["state"].items()}
    return FullState(weights, {"state": state, "param_groups": sd["param_groups"]})


def shard_optimizer_state(optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
    """A full optimizer state dict → the same with every tensor of a sharded parameter's shape
    split like that parameter (each rank keeps its own shard; no communication)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[int, dict[str, Any]] = {}
    for idx, per in sd["state"].items():
        p = params[int(idx)]
        state[idx] = {name: distribute_like(v, p) for name, v in per.items()}
    return {"state": state, "param_groups": sd["param_groups"]}


def distribute_like(value: Any, param: Tensor) -> Any:
    """``value`` as a DTensor placed like ``param`` when ``param`` is one and shapes agree."""
    if not (isinstance(param, DTensor) and isinstance(value, Tensor) and value.shape == param.shape):
        return value
    return torch.distributed.tensor.distribute_tensor(value.to(param.dtype), param.device_mesh, param.placements,
                                                      src_data_rank=None)
