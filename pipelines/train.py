"""Stage ``train``: drafter training on the data stage's shards with Ray Train, objectives chained.

    python -m pipelines.train conf=dspark.yaml train.data_dir=runs/data
    python -m pipelines.train conf=dspark.yaml train.max_steps=200 train.loss=lk_hybrid
    python -m pipelines.train conf=dspark.yaml "train.objectives=[offline,opd]"
    python -m pipelines.train conf=dspark.yaml data.mode=stream       # online: no shards on disk

Setup: the target, the initial drafter and the input (``components.training.inputs``: the data
stage's shards, either format, from ``train.data_dir`` or the data stage's output; or, with
``data.mode=stream`` and no ``train.data_dir``, a rollout stream generated while the workers
train), with ``train.eval_fraction`` of the records held out. Run: each objective of
``train.objectives`` in order as its own Ray Train run (``components.training.fit``) and nested
MLflow run, starting from the drafter the previous objective produced, then evaluated on the
held-out records. Each objective's drafter lands in ``<output_dir>/drafters/<objective>``, the
last one also in ``<output_dir>/drafter``. Report (``components.training.report``): held-out α
by position / τ for the initial drafter and after every objective, a plot of α by position, the
drafter and a registered model version. Rerunning the same command after a crash resumes the
unfinished objective from its last checkpoint; finished objectives are only re-evaluated.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch

from components.cluster import init_ray
from components.config import SpeclineConfig
from components.drafters import build_drafter, load_drafter
from components.target import Target, load_target
from components.target.hf import resolve_target_path
from components.tracking import Tracker, tracking_uri
from components.training.chain import ObjectiveStage, resolve_chain
from components.training.fit import copy_drafter, fit_objective, plan_steps, worker_config
from components.training.heldout import evaluate_heldout
from components.training.inputs import TrainInputs, choose_draft_vocab, train_inputs
from components.training.report import eval_metrics, objective_result, report_stage
from pipelines.cli import main


def _train_objective(cfg: SpeclineConfig, stage: ObjectiveStage, inputs: TrainInputs, target: Target,
                     out: Path, init: str | None, tracker: Tracker) -> dict[str, Any]:
    """One objective as its own Ray Train run and nested MLflow run, evaluated on the held-out records."""
    scfg = dataclasses.replace(cfg, train=stage.train)
    plan = plan_steps(inputs.num_train, scfg)
    with tracker.run(f"train-{stage.name}", log_config=False) as run_id:
        tracker.log_params({"objective": stage.name, "init_drafter": init or "fresh", **plan,
                            **{f"objective.{k}": v for k, v in stage.params.items()},
                            **{f"train.{k}": v for k, v in dataclasses.asdict(stage.train).items()}})
        mlflow_ref = {"uri": tracking_uri(cfg), "run_id": run_id} if run_id else None
        loop_config = worker_config(scfg, stage, plan, target.name_or_path, init, mlflow_ref)
        fitted = fit_objective(scfg, stage, inputs.dataset, loop_config, out, init)
        ev = evaluate_heldout(cfg.train, load_drafter(fitted.drafter_path, target), inputs.heldout)
        tracker.log_metrics({**eval_metrics("heldout", ev), "train_seconds": fitted.seconds,
                             "final_step": fitted.metrics.get("train/step", 0)})
        tracker.log_artifacts(fitted.drafter_path, "drafter")
    return objective_result(stage.name, run_id, fitted, ev)


def run(cfg: SpeclineConfig, tracker: Tracker, upstream: dict[str, Any]) -> dict[str, Any]:
    """Returns upstream plus ``drafter_path``, ``train_checkpoint``, ``train_run_id``, per-objective
    results (``train_objectives``) and the last objective's headline numbers."""
    chain = resolve_chain(cfg.train)
    target_path = upstream.get("target_path") or resolve_target_path(cfg.target, progress=True)
    target = load_target(dataclasses.replace(cfg.target, name_or_path=target_path), progress=False)
    torch.manual_seed(cfg.train.seed)
    initial = build_drafter(cfg.drafter, target)
    init_ray(cfg.ray)
    inputs = train_inputs(cfg, upstream, target, initial.layer_ids)
    initial = choose_draft_vocab(cfg, target, initial, inputs)  # drafter.draft_vocab_size: from the records
    tracker.log_params({"train.input": inputs.source, "train.num_train_records": inputs.num_train,
                        "train.num_heldout_records": len(inputs.heldout)})
    out = Path(cfg.train.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    evals = {"initial": evaluate_heldout(cfg.train, initial, inputs.heldout)}
    results: list[dict[str, Any]] = []
    init: str | None = None  # the drafter the next objective starts from (None: fresh)
    for stage in chain:
        results.append(_train_objective(cfg, stage, inputs, target, out, init, tracker))
        init, evals[stage.name] = results[-1]["drafter_path"], results[-1]["eval"]
    drafter_path = copy_drafter(Path(results[-1]["drafter_path"]), out / "drafter")
    return {**upstream, **report_stage(cfg, tracker, results, evals, drafter_path, out)}


if __name__ == "__main__":
    sys.exit(main(run, "train"))
