"""A config's chain of objectives → one resolved TrainConfig + objective parameters per stage.

``train.per_objective.<name>`` mixes two kinds of keys: TrainConfig fields that change for that
objective only (``lr``, ``max_steps``, ``epochs``, ``loss``, ``loss_params``, ``warmup_steps`` ...)
and the objective's own parameters (its ``Params`` dataclass). The loss of a stage is, in order:
its ``loss`` override, the objective's ``default_loss``, ``train.loss``. Every mistake is a
ConfigError naming the key. Knows the config dataclasses and the objective registry.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from components.config import ConfigError, TrainConfig
from components.training.objectives import OBJECTIVES, objective_class
from components.training.objectives.base import objective_params
from components.training.sharding import check_strategy

# Fields that belong to the whole stage, not to one objective.
STAGE_ONLY = ("objectives", "per_objective", "data_dir", "output_dir", "eval_fraction", "run_name")


@dataclass(frozen=True)
class ObjectiveStage:
    """One link of the chain."""

    name: str  # registered objective
    train: TrainConfig  # the stage's settings (overrides applied)
    params: dict[str, Any]  # the objective's own parameters
    run_name: str  # Ray Train run name (directory under output_dir)


def resolve_chain(tc: TrainConfig) -> list[ObjectiveStage]:
    """The stages of ``tc.objectives`` in order, or a ConfigError naming what is wrong."""
    check_strategy(tc.strategy)
    if not tc.objectives:
        raise ConfigError("train.objectives: empty; name at least one of " + ", ".join(sorted(OBJECTIVES)))
    names = list(tc.objectives)
    for i, name in enumerate(names):
        if name not in OBJECTIVES:
            raise ConfigError(f"train.objectives[{i}]: unknown objective '{name}'; known: {', '.join(sorted(OBJECTIVES))}")
    if len(set(names)) != len(names):
        raise ConfigError(f"train.objectives: {names} names an objective twice")
    stray = sorted(set(tc.per_objective) - set(names))
    if stray:
        raise ConfigError(f"train.per_objective: {stray} not in train.objectives {names}")
    return [_stage(tc, name) for name in names]


def _stage(tc: TrainConfig, name: str) -> ObjectiveStage:
    values = dict(tc.per_objective.get(name) or {})
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    bad = sorted(k for k in values if k in STAGE_ONLY)
    if bad:
        raise ConfigError(f"train.per_objective.{name}: {bad} apply to the whole train stage, set them under train")
    train_keys = {k: values.pop(k) for k in list(values) if k in fields}
    if "strategy" in train_keys:
        check_strategy(train_keys["strategy"], f"train.per_objective.{name}.strategy")
    cls = objective_class(name)
    if "loss" not in train_keys and cls.default_loss is not None:
        train_keys.setdefault("loss_params", {})
        train_keys["loss"] = cls.default_loss
    try:
        params = dataclasses.asdict(objective_params(name, values))
    except (TypeError, ValueError) as err:
        raise ConfigError(f"train.per_objective.{name}: {err}") from err
    run = name if not tc.run_name else f"{tc.run_name}-{name}"
    return ObjectiveStage(name, dataclasses.replace(tc, **train_keys), params, run)
