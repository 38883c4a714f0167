"""The whole specline pipeline: the stages listed in ``stages`` of the config, in order.

One parent MLflow run; each stage is a nested run that receives the artifact references
returned by the stages before it (paths, run ids) and adds its own. A stage whose output exists
for the same config and inputs is reused (``components.reuse``; ``force=[...]`` reruns it); an
earlier stage left out of ``stages`` lends its recorded output where it matches the config. On the console each stage
is a start line and an end line with its wall time and headline figure (``pipelines.headlines``);
the rest goes to ``<run_dir>/logs/`` (``-v``: to the console as well).

    python -m pipelines.full conf=dspark.yaml [-v]
"""

from __future__ import annotations

import sys
from typing import Any

from components import reuse
from components.config import ConfigError, SpeclineConfig
from components.tracking import Tracker
from pipelines import data, evaluate, serve, target, train
from pipelines.cli import StageFn, log, main, run_stage
from pipelines.headlines import headline

# Stage name → entry point, in pipeline order.
STAGES: dict[str, StageFn] = {"target": target.run, "data": data.run, "train": train.run,
                              "eval": evaluate.run, "serve": serve.run}


def run(cfg: SpeclineConfig, tracker: Tracker, upstream: dict[str, Any]) -> dict[str, Any]:
    unknown = [s for s in cfg.stages if s not in STAGES]
    if unknown:
        raise ConfigError(f"stages: unknown {unknown}; available: {list(STAGES)}")
    reuse.check_force(cfg, list(cfg.stages))
    artifacts, looked = dict(upstream), {}
    for i, name in enumerate(cfg.stages, 1):
        artifacts, taken = reuse.recorded_upstream(name, cfg, artifacts, looked)
        for decision in taken:
            line = headline(decision.stage, artifacts)
            log.info("%s: the recorded output of an earlier run%s (same config and inputs)", decision.stage,
                     f", {line}" if line else "")
        with tracker.run(name) as run_id:
            artifacts = run_stage(name, STAGES[name], cfg, tracker, artifacts, step=f"[{i}/{len(cfg.stages)}] ",
                                  run_id=run_id)
            if not artifacts.get(f"{name}_run_id"):  # a reused stage keeps the run that made its output
                artifacts[f"{name}_run_id"] = run_id
    return artifacts


if __name__ == "__main__":
    sys.exit(main(run, "pipeline"))
