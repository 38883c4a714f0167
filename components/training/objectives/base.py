"""The objective interface, its registry and strict parameter checking.

An objective class declares its knobs as a dataclass ``Params`` (checked strictly, so a typo in
``train.per_objective.<name>`` is an error naming the key), a ``default_loss`` (None: the
configured ``train.loss``) and, if it needs architecture changes on the drafter it starts from
(e.g. a new learned embedding), ``drafter_overrides``: drafter config fields to set before
loading the previous stage's weights. Knows torch and the drafter/loss interfaces only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from components.drafters.base import DraftBatch, Drafter
from components.losses import DrafterLoss, LossOutput


@dataclass
class ObjectiveContext:
    """What an objective may use besides the drafter and the loss."""

    target: Any = None  # the frozen target (components.target.Target), for objectives that verify


class Objective(nn.Module):
    """Drafter + loss (+ whatever the objective needs): ``forward(batch, gen) -> (loss, LossOutput)``."""

    name: ClassVar[str] = ""
    default_loss: ClassVar[str | None] = None
    drafter_overrides: ClassVar[dict[str, Any]] = {}

    @dataclass
    class Params:
        pass

    def __init__(self, drafter: Drafter, loss: DrafterLoss, params: Any, context: ObjectiveContext):
        super().__init__()
        self.drafter = drafter
        self.loss = loss
        self.params = params
        self._context = [context]  # not a submodule: the target is never trained or saved

    @property
    def context(self) -> ObjectiveContext:
        return self._context[0]

    def at_step(self, step: int, total: int) -> None:
        """Called before each training step's forward with the optimizer steps done and planned
        (a curriculum reads its schedule here; the default ignores it)."""

    def forward(self, batch: DraftBatch, generator: torch.Generator | None = None) -> tuple[Tensor, LossOutput]:
        raise NotImplementedError


OBJECTIVES: dict[str, type[Objective]] = {}


def register_objective(name: str) -> Callable[[type[Objective]], type[Objective]]:
    def add(cls: type[Objective]) -> type[Objective]:
        if name in OBJECTIVES:
            raise ValueError(f"objective {name!r} is already registered")
        cls.name = name
        OBJECTIVES[name] = cls
        return cls

    return add


def objective_class(name: str) -> type[Objective]:
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; known: {', '.join(sorted(OBJECTIVES))}")
    return OBJECTIVES[name]


def objective_params(name: str, values: Mapping[str, Any]) -> Any:
    """The objective's Params from ``values``; unknown keys raise naming them."""
    cls = objective_class(name)
    known = {f.name for f in dataclasses.fields(cls.Params)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"objective {name!r}: unknown parameter(s) {unknown}; known: {', '.join(sorted(known)) or '-'}")
    return cls.Params(**values)


def build_objective(name: str, drafter: Drafter, loss: DrafterLoss, params: Mapping[str, Any] | None = None,
                    context: ObjectiveContext | None = None) -> Objective:
    """The objective registered as ``name`` around ``drafter`` and ``loss``."""
    cls = objective_class(name)
    return cls(drafter, loss, objective_params(name, params or {}), context or ObjectiveContext())
