"""Stage ``train``: offline drafter training on the data stage's shards, with Ray Train.

    python -m pipelines.train conf=dspark.yaml train.data_dir=runs/data
    python -m pipelines.train conf=dspark.yaml train.max_steps=200 train.loss=lk_hybrid

Holds out ``train.eval_fraction`` of the records, trains the configured drafter with the
configured registry loss on ``train.num_workers`` TorchTrainer workers (DDP, gloo on CPU),
copies the final drafter checkpoint to ``<train.output_dir>/drafter`` and logs to MLflow: the
per-step training metrics (from rank 0), α by position / τ / loss on the held-out records for
the initial and the trained drafter, a plot of α by position, and the drafter checkpoint.
Rerunning the same run (same ``train.run_name`` and ``train.output_dir``) after a crash
resumes from the last checkpoint; a finished run rerun only re-evaluates.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from components.cluster import init_ray
from components.config import ConfigError, SpeclineConfig
from components.data.records import RecordMeta, check_meta
from components.data.shards import load_manifest, read_header, read_records
from components.drafters import build_drafter, load_drafter
from components.target import load_target
from components.target.hf import resolve_target_path
from components.tracking import Tracker, tracking_uri
from components.training import build_train_loss, evaluate_records, heldout_ids
from components.training.loop import train_loop_per_worker
from pipelines.cli import main


class TrainingFailed(RuntimeError):
    """Ray Train gave up (e.g. a non-finite loss); the last good checkpoint is kept."""


def plan_steps(num_train: int, cfg: SpeclineConfig) -> dict[str, int]:
    """Batches per epoch per worker and total optimizer steps for ``num_train`` records."""
    tc = cfg.train
    per_worker = num_train // tc.num_workers
    if per_worker < 1:
        raise ConfigError(f"train: {num_train} training records cannot feed {tc.num_workers} workers")
    spe = math.ceil(per_worker / tc.batch_size)
    return {"steps_per_epoch": spe, "total_steps": tc.max_steps if tc.max_steps > 0 else tc.epochs * spe}


RESERVED = ("drafter", "plots")  # entries of output_dir this stage writes itself


def _data_dir(cfg: SpeclineConfig, upstream: dict[str, Any]) -> Path:
    if cfg.train.run_name in RESERVED:
        raise ConfigError(f"train.run_name: '{cfg.train.run_name}' is reserved ({', '.join(RESERVED)})")
    found = cfg.train.data_dir or upstream.get("data_dir")
    if not found:
        raise ConfigError("train: no data; set train.data_dir or run the data stage first (shards mode)")
    return Path(found).expanduser().resolve()


def _expected_meta(data_dir: Path, target: Any, target_path: str, layer_ids: list[int]) -> RecordMeta:
    """The meta the shards must carry for this target and drafter (any storage dtype)."""
    found = RecordMeta.from_dict(load_manifest(data_dir)["meta"])
    return RecordMeta(target=target_path, tokenizer_hash=target.tokenizer_hash, layer_ids=tuple(layer_ids),
                      last_layer=target.num_layers - 1, hidden_size=target.hidden_size, storage=found.storage)


def _sample_ids(data_dir: Path) -> list[str]:
    names = [s["name"] for s in load_manifest(data_dir)["shards"]]
    return [i for n in names for i in pq.read_table(data_dir / n, columns=["sample_id"]).column(0).to_pylist()]


def _train_dataset(data_dir: Path, expect: RecordMeta, held: set[str]) -> Any:
    """The training records (held-out ones removed) as a Ray Dataset.

    Shards are read here and handed to Ray with ``from_arrow``: Ray Data's parquet listing
    spawns nested footer tasks that deadlock when Train workers hold the small box's CPUs.
    Fine for the embedded default (tens of MB); a streaming read is the scale-out path."""
    import ray.data

    manifest = load_manifest(data_dir, expect)
    drop = pa.array(sorted(held), pa.string())
    tables = []
    for shard in manifest["shards"]:
        path = data_dir / shard["name"]
        check_meta(RecordMeta.from_dict(read_header(path)["meta"]), expect, str(path))
        table = pq.read_table(path)
        tables.append(table.filter(pc.invert(pc.is_in(table["sample_id"], value_set=drop))))
    return ray.data.from_arrow(tables)


def _fit(cfg: SpeclineConfig, dataset: Any, loop_config: dict[str, Any], storage: Path) -> Any:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    tc = cfg.train
    trainer = TorchTrainer(
        train_loop_per_worker, train_loop_config=loop_config, datasets={"train": dataset},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=tc.num_workers, resources_per_worker={"CPU": tc.cpus_per_worker}),
        run_config=RunConfig(name=tc.run_name, storage_path=str(storage),
                             failure_config=FailureConfig(max_failures=tc.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=tc.keep_checkpoints)))
    try:
        return trainer.fit()
    except Exception as err:
        raise TrainingFailed(f"train: Ray Train failed after {tc.max_failures} restart(s): "
                             f"{str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__}") from err


def _copy_drafter(result: Any, out: Path) -> Path:
    """The final checkpoint's drafter/ → ``out``/drafter (temp copy, then rename)."""
    if result.checkpoint is None:
        raise TrainingFailed("train: Ray Train finished without a checkpoint")
    final = out / "drafter"
    with result.checkpoint.as_directory() as d:
        tmp = Path(tempfile.mkdtemp(prefix=".drafter.", dir=out))
        shutil.copytree(Path(d) / "drafter", tmp, dirs_exist_ok=True)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def _plot_alpha(evals: dict[str, dict[str, Any]], path: Path) -> Path | None:
    """α by draft position, one line per evaluated drafter; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for name, ev in evals.items():
        if ev:
            ax.plot(range(1, len(ev["alpha"]) + 1), ev["alpha"], marker="o", label=f"{name} (τ={ev['tau']:.2f})")
    ax.set(xlabel="draft position k", ylabel="α_k = 1 − TV", ylim=(0, 1), title="held-out acceptance by position")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _eval_metrics(prefix: str, ev: dict[str, Any]) -> dict[str, float]:
    if not ev:
        return {}
    out = {f"{prefix}/loss": ev["loss"], f"{prefix}/tau": ev["tau"], f"{prefix}/blocks": ev["blocks"]}
    out.update({f"{prefix}/alpha/{k + 1}": a for k, a in enumerate(ev["alpha"])})
    return out


def _evaluate(cfg: SpeclineConfig, target: Any, drafter_path: Path, records: list[Any]) -> dict[str, dict[str, Any]]:
    """Held-out α/τ of the initial drafter (same seed as the workers) and the trained one."""
    loss = build_train_loss(cfg.train)
    torch.manual_seed(cfg.train.seed)
    initial = build_drafter(cfg.drafter, target)
    trained = load_drafter(drafter_path, target)
    bs, seed = cfg.train.eval_batch_size, cfg.train.seed
    return {"initial": evaluate_records(initial, loss, records, bs, seed),
            "trained": evaluate_records(trained, loss, records, bs, seed)}


def _active_run_id(tracker: Tracker) -> str | None:
    if not tracker.enabled:
        return None
    import mlflow

    active = mlflow.active_run()
    return active.info.run_id if active else None


def run(cfg: SpeclineConfig, tracker: Tracker, upstream: dict[str, Any]) -> dict[str, Any]:
    """Returns upstream plus ``drafter_path``, ``train_checkpoint``, ``train_run_id`` and results."""
    data_dir = _data_dir(cfg, upstream)
    target_path = upstream.get("target_path") or resolve_target_path(cfg.target, progress=True)
    target = load_target(dataclasses.replace(cfg.target, name_or_path=target_path), progress=False)
    torch.manual_seed(cfg.train.seed)
    expect = _expected_meta(data_dir, target, target_path, build_drafter(cfg.drafter, target).layer_ids)
    ids = _sample_ids(data_dir)
    held = heldout_ids(ids, cfg.train.eval_fraction, cfg.train.seed)
    num_train = len(ids) - len(held)
    plan = plan_steps(num_train, cfg)
    tracker.log_params({f"train.{k}": v for k, v in dataclasses.asdict(cfg.train).items()}
                       | {"train.num_train_records": num_train, "train.num_heldout_records": len(held), **plan})
    init_ray(cfg.ray)
    out = Path(cfg.train.output_dir).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    run_id = _active_run_id(tracker)
    loop_config = {"cfg": cfg, "target_path": target_path, **plan,
                   "mlflow": {"uri": tracking_uri(cfg), "run_id": run_id} if run_id else None}
    t0 = time.perf_counter()
    result = _fit(cfg, _train_dataset(data_dir, expect, held), loop_config, out)
    seconds = time.perf_counter() - t0
    drafter_path = _copy_drafter(result, out)
    evals = _evaluate(cfg, target, drafter_path, [r for r in read_records(data_dir, expect) if r.sample_id in held])
    final = dict(result.metrics or {})
    tracker.log_metrics({**_eval_metrics("heldout", evals["trained"]), **_eval_metrics("heldout_init", evals["initial"]),
                         "train_seconds": seconds, "final_step": final.get("train/step", 0)})
    plot = _plot_alpha(evals, out / "plots" / "alpha_by_position.png")
    if plot is not None:
        tracker.log_artifacts(plot.parent, "train/plots")
    tracker.log_artifacts(drafter_path, "train/drafter")
    tracker.log_dict({"plan": plan, "final_metrics": final, "heldout": evals}, "train/summary.json")
    return {**upstream, "drafter_path": str(drafter_path), "train_checkpoint": str(result.checkpoint.path),
            "train_run_id": run_id, "train_steps": int(final.get("train/step", 0)), "train_seconds": seconds,
            "train_loss_first": final.get("train/first_loss"), "train_loss_last": final.get("train/loss"),
            "train_tokens_per_s": final.get("train/tokens_per_s"),
            "heldout_alpha": evals["trained"].get("alpha"), "heldout_tau": evals["trained"].get("tau"),
            "heldout_tau_initial": evals["initial"].get("tau"), "plot": str(plot) if plot else None}


if __name__ == "__main__":
    sys.exit(main(run, "train"))
