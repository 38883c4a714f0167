"""The whole specline pipeline: the stages listed in ``stages`` of the config, in order.

One parent MLflow run; each stage is a nested run that receives the artifact references
returned by the stages before it (paths, run ids) and adds its own.

    python -m pipelines.full conf=dspark.yaml
"""

from __future__ import annotations

import sys
from typing import Any

from components.config import ConfigError, SpeclineConfig
from components.tracking import Tracker
from pipelines import data, evaluate, serve, target, train
from pipelines.cli import StageFn, main

# Stage name → entry point, in pipeline order.
STAGES: dict[str, StageFn] = {"target": target.run, "data": data.run, "train": train.run,
                              "eval": evaluate.run, "serve": serve.run}


def run(cfg: SpeclineConfig, tracker: Tracker, upstream: dict[str, Any]) -> dict[str, Any]:
    unknown = [s for s in cfg.stages if s not in STAGES]
    if unknown:
        raise ConfigError(f"stages: unknown {unknown}; available: {list(STAGES)}")
    artifacts = dict(upstream)
    for name in cfg.stages:
        with tracker.run(name) as run_id:
            artifacts = STAGES[name](cfg, tracker, artifacts)
            artifacts[f"{name}_run_id"] = run_id
    return artifacts


if __name__ == "__main__":
    sys.exit(main(run, "pipeline"))
