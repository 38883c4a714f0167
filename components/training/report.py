"""What the train stage reports: held-out metrics, the α-by-position plot, the registered model
version, and the stage's result for later stages.

Every evaluated drafter of a chain (the initial one, then one per objective) has a held-out
evaluation (:func:`components.training.heldout.evaluate_heldout`); here they become MLflow
metrics (``heldout/...`` for the last drafter, ``heldout_init/...`` for the initial one), one
plot of α by draft position with a line per drafter, a ``train/summary.json``, and a new
version of the registered model ``train.register_as`` whose source is the stage run's drafter.

Knows MLflow (through the Tracker, and its model registry) and matplotlib, both imported lazily,
and the shape of the evaluation dicts; nothing about Ray or how the drafters were trained.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from components.config import SpeclineConfig
from components.tracking import Tracker, tracking_uri
from components.training.fit import Fitted

Eval = dict[str, Any]  # evaluate_records' dict: loss, alpha [γ], tau, blocks, sim_tau, sim_alpha [γ], rounds


def eval_metrics(prefix: str, ev: Eval) -> dict[str, float]:
    """An evaluation as flat metrics ``<prefix>/tau``, ``<prefix>/alpha/<k>``, ...; {} without data."""
    if not ev:
        return {}
    out = {f"{prefix}/{k}": ev[k] for k in ("loss", "tau", "blocks", "sim_tau", "rounds")}
    out.update({f"{prefix}/alpha/{k + 1}": a for k, a in enumerate(ev["alpha"])})
    out.update({f"{prefix}/sim_alpha/{k + 1}": a for k, a in enumerate(ev["sim_alpha"])})
    return out


def objective_result(name: str, run_id: str | None, fitted: Fitted, ev: Eval) -> dict[str, Any]:
    """One objective's entry of ``train_objectives`` (and of ``train/summary.json``)."""
    final = fitted.metrics
    return {"objective": name, "run_id": run_id, "drafter_path": str(fitted.drafter_path), "eval": ev,
            "checkpoint": fitted.checkpoint, "seconds": fitted.seconds, "steps": int(final.get("train/step", 0)),
            "loss_first": final.get("train/first_loss"), "loss_last": final.get("train/loss"),
            "tokens_per_s": final.get("train/tokens_per_s")}


def plot_alpha(evals: dict[str, Eval], path: Path) -> Path | None:
    """α by draft position, one line per evaluated drafter; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), sharey=True)
    for name, ev in evals.items():
        if ev:
            k = range(1, len(ev["alpha"]) + 1)
            axes[0].plot(k, ev["alpha"], marker="o", label=f"{name} (τ={ev['tau']:.2f})")
            axes[1].plot(k, ev["sim_alpha"], marker="o", label=f"{name} (τ={ev['sim_tau']:.2f})")
    axes[0].set(xlabel="draft position k", ylabel="acceptance", ylim=(0, 1), title="α_k = 1 − TV (random anchors)")
    axes[1].set(xlabel="draft position k", title="greedy rounds: P(accept k | reached k)")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def active_run_id(tracker: Tracker) -> str | None:
    """The id of the MLflow run in progress (the stage's), None when tracking is off."""
    return tracker.active_run_id()


def register(tracker: Tracker, cfg: SpeclineConfig, run_id: str | None, artifact: str) -> int | None:
    """The run's drafter artifact as a new version of registered model ``train.register_as``."""
    if not (tracker.enabled and run_id and cfg.train.register_as):
        return None
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri(cfg))
    try:
        client.get_registered_model(cfg.train.register_as)
    except Exception:  # noqa: BLE001  (MLflow raises its own RestException for "not found")
        client.create_registered_model(cfg.train.register_as, description="specline drafter checkpoints")
    source = f"{client.get_run(run_id).info.artifact_uri}/{artifact}"
    version = client.create_model_version(cfg.train.register_as, source, run_id=run_id,
                                          tags={"drafter": cfg.drafter.name, "objectives": ",".join(cfg.train.objectives)})
    return int(version.version)


def report_stage(cfg: SpeclineConfig, tracker: Tracker, results: list[dict[str, Any]], evals: dict[str, Eval],
                 drafter_path: Path, out: Path) -> dict[str, Any]:
    """Logs the stage's metrics, plot (under ``out/plots``), final drafter and summary, registers the
    drafter; returns the stage's result keys (``drafter_path``, ``train_run_id``, ``heldout_tau``, ...)."""
    last, initial = results[-1], evals["initial"]
    seconds = sum(r["seconds"] for r in results)
    tracker.log_metrics({**eval_metrics("heldout", last["eval"]), **eval_metrics("heldout_init", initial),
                         "train_seconds": seconds})
    plot = plot_alpha(evals, out / "plots" / "alpha_by_position.png")
    if plot is not None:
        tracker.log_artifacts(plot.parent, "train/plots")
    tracker.log_artifacts(drafter_path, "train/drafter")
    tracker.log_dict({"objectives": results, "heldout": evals}, "train/summary.json")
    run_id = active_run_id(tracker)
    ev = last["eval"]
    return {"drafter_path": str(drafter_path), "train_checkpoint": last["checkpoint"], "train_run_id": run_id,
            "train_objectives": results, "registered_version": register(tracker, cfg, run_id, "train/drafter"),
            "train_steps": last["steps"], "train_seconds": seconds, "train_loss_first": last["loss_first"],
            "train_loss_last": last["loss_last"], "train_tokens_per_s": last["tokens_per_s"],
            "heldout_alpha": ev.get("alpha"), "heldout_tau": ev.get("tau"), "heldout_sim_tau": ev.get("sim_tau"),
            "heldout_sim_alpha": ev.get("sim_alpha"), "heldout_tau_initial": initial.get("tau"),
            "heldout_sim_tau_initial": initial.get("sim_tau"), "plot": str(plot) if plot else None}
