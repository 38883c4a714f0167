"""Stage ``train``: drafter training on the data stage's shards with Ray Train, objectives chained.

    python -m pipelines.train conf=dspark.yaml train.data_dir=runs/data
    python -m pipelines.train conf=dspark.yaml train.max_steps=200 train.loss=lk_hybrid
    python -m pipelines.train conf=dspark.yaml "train.objectives=[offline,opd]"
    python -m pipelines.train conf=dspark.yaml data.mode=stream       # online: no shards on disk

Input: the data stage's shards (``train.data_dir`` or the data stage's output), or, with
``data.mode=stream`` and no ``train.data_dir``, a rollout stream that the data stage's Ray Data
actors generate while the workers train (``check_stream_resources``: both must fit at once).
Holds out ``train.eval_fraction`` of the records, then runs each objective of
``train.objectives`` in order as its own Ray Train run (``train.num_workers`` TorchTrainer
workers, DDP, gloo on CPU) and its own nested MLflow run, starting from the drafter the previous
objective produced. Each objective's drafter lands in ``<output_dir>/drafters/<objective>``, the
last one also in ``<output_dir>/drafter``. MLflow gets per-step metrics (from rank 0), held-out
α by position / τ (the 1 − TV estimate) and the simulated greedy τ for the initial drafter and
after every objective, a plot of α by position, the drafter, and a registered model version.
Rerunning the same command after a crash resumes the unfinished objective from its last
checkpoint; finished objectives are only re-evaluated.
"""

from __future__ import annotations

import dataclasses
import hashlib
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
from components.data.prompts import collect_prompts
from components.data.records import RecordMeta, batch_to_records, check_meta
from components.data.shards import load_manifest, read_header, read_records
from components.data.source import describe_target
from components.data.stream import rollout_stream
from components.drafters import build_drafter, load_drafter
from components.io import replace_dir
from components.target import load_target
from components.target.hf import resolve_target_path
from components.tracking import Tracker, tracking_uri
from components.training import build_train_loss, evaluate_records, heldout_ids
from components.training.chain import ObjectiveStage, resolve_chain
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


def _data_dir(cfg: SpeclineConfig, upstream: dict[str, Any]) -> Path:
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


def check_stream_resources(cfg: SpeclineConfig, cluster: dict[str, float]) -> None:
    """Streaming input runs the data stage's rollout actors *while* the train workers hold their
    CPUs (GPUs): Ray Train reserves the workers' resources and leaves Ray Data only the rest of
    the cluster, so when the workers take it all the rollout actors stay pending forever (seen on
    a 2-CPU box with 2 workers × 1 CPU: "Active & requested resources: 0/0 CPU (pending: 0.5 CPU)").
    A ConfigError naming the keys instead of that hang."""
    tc, dc = cfg.train, cfg.data
    needs = {"CPU": (tc.num_workers * tc.cpus_per_worker + dc.num_actors * dc.cpus_per_actor,
                     (f"train.num_workers × train.cpus_per_worker ({tc.num_workers} × {tc.cpus_per_worker}) + "
                      f"data.num_actors × data.cpus_per_actor ({dc.num_actors} × {dc.cpus_per_actor})"))}
    if tc.use_gpu or dc.gpus_per_actor:
        needs["GPU"] = ((tc.num_workers if tc.use_gpu else 0) + dc.num_actors * dc.gpus_per_actor,
                        (f"train.num_workers ({tc.num_workers}, train.use_gpu={tc.use_gpu}) + "
                         f"data.num_actors × data.gpus_per_actor ({dc.num_actors} × {dc.gpus_per_actor})"))
    for kind, (need, how) in needs.items():
        have = float(cluster.get(kind, 0.0))
        if need > have + 1e-9:
            raise ConfigError(f"train: streaming input (data.mode=stream) needs {how} = {need:g} {kind}s at once, "
                              f"the Ray cluster has {have:g}: the rollout actors would wait forever for the "
                              f"{kind}s the train workers hold; lower train.cpus_per_worker / data.cpus_per_actor "
                              "(fractions are fine) or the worker/actor counts")


def _stream_inputs(cfg: SpeclineConfig, target: Any, target_path: str, layer_ids: list[int]) -> dict[str, Any]:
    """Online input: the training prompts as a lazy rollout stream (Ray Data actors generate
    while the workers train; every epoch regenerates with the same per-prompt seeds), the
    held-out prompts rolled out once, before training, by an actor pool of the same kind."""
    import ray

    info = describe_target(cfg, target_path)
    prompts, _ = collect_prompts(cfg.data, info.tokenizer, info.corpus_dir)
    held = heldout_ids([p.prompt_id for p in prompts], cfg.train.eval_fraction, cfg.train.seed)
    check_stream_resources(cfg, ray.cluster_resources())
    stream = rollout_stream(cfg, info, [p for p in prompts if p.prompt_id not in held])
    expect = RecordMeta(target=target_path, tokenizer_hash=target.tokenizer_hash, layer_ids=tuple(layer_ids),
                        last_layer=target.num_layers - 1, hidden_size=target.hidden_size, storage=cfg.data.storage)
    check_meta(stream.meta, expect, "data stream")
    heldout: list[Any] = []
    if held:
        held_ds = rollout_stream(cfg, info, [p for p in prompts if p.prompt_id in held]).dataset
        for batch in held_ds.iter_batches(batch_size=64, batch_format="numpy"):
            heldout += batch_to_records(batch)
    return {"num_train": len(prompts) - len(held), "dataset": stream.dataset, "heldout": heldout}


def _shard_inputs(cfg: SpeclineConfig, data_dir: Path, target: Any, target_path: str,
                  layer_ids: list[int]) -> dict[str, Any]:
    """Offline input: the data stage's shards, held-out records removed (and kept for evaluation)."""
    expect = _expected_meta(data_dir, target, target_path, layer_ids)
    ids = _sample_ids(data_dir)
    held = heldout_ids(ids, cfg.train.eval_fraction, cfg.train.seed)
    heldout = [r for r in read_records(data_dir, expect) if r.sample_id in held]
    return {"num_train": len(ids) - len(held), "dataset": _train_dataset(data_dir, expect, held), "heldout": heldout}


def _fit(cfg: SpeclineConfig, dataset: Any, loop_config: dict[str, Any], storage: Path, name: str) -> Any:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    tc = cfg.train
    trainer = TorchTrainer(
        train_loop_per_worker, train_loop_config=loop_config, datasets={"train": dataset},
        torch_config=TorchConfig(backend="nccl" if tc.use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=tc.num_workers, use_gpu=tc.use_gpu,
                                     resources_per_worker={"CPU": tc.cpus_per_worker}),
        run_config=RunConfig(name=name, storage_path=str(storage),
                             failure_config=FailureConfig(max_failures=tc.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=tc.keep_checkpoints)))
    try:
        return trainer.fit()
    except Exception as err:
        raise TrainingFailed(f"train: Ray Train failed after {tc.max_failures} restart(s): "
                             f"{str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__}") from err


def _copy_drafter(source: Path, final: Path) -> Path:
    """A drafter directory → ``final`` (temp copy, then rename)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    shutil.copytree(source, tmp, dirs_exist_ok=True)
    replace_dir(tmp, final)
    return final


def _plot_alpha(evals: dict[str, dict[str, Any]], path: Path) -> Path | None:
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


def _eval_metrics(prefix: str, ev: dict[str, Any]) -> dict[str, float]:
    if not ev:
        return {}
    out = {f"{prefix}/{k}": ev[k] for k in ("loss", "tau", "blocks", "sim_tau", "rounds")}
    out.update({f"{prefix}/alpha/{k + 1}": a for k, a in enumerate(ev["alpha"])})
    out.update({f"{prefix}/sim_alpha/{k + 1}": a for k, a in enumerate(ev["sim_alpha"])})
    return out


def _evaluate(cfg: SpeclineConfig, drafter: Any, records: list[Any]) -> dict[str, Any]:
    """Held-out α/τ of ``drafter`` with the configured ``train.loss`` (the same for every objective)."""
    return evaluate_records(drafter, build_train_loss(cfg.train), records, cfg.train.eval_batch_size, cfg.train.seed)


def _active_run_id(tracker: Tracker) -> str | None:
    if not tracker.enabled:
        return None
    import mlflow

    active = mlflow.active_run()
    return active.info.run_id if active else None


def _register(tracker: Tracker, cfg: SpeclineConfig, run_id: str | None, artifact: str) -> int | None:
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


def _run_name(stage: ObjectiveStage, init: str | None) -> str:
    """The Ray Train run of an objective. After the first objective it names the drafter it starts
    from (a digest of its weights): rerunning resumes only a run that started from the same one,
    and a changed earlier objective starts its successors afresh instead of resuming stale runs."""
    if not init:
        return stage.run_name
    digest = hashlib.sha256((Path(init) / "model.safetensors").read_bytes()).hexdigest()[:10]
    return f"{stage.run_name}-from-{digest}"


def _train_objective(cfg: SpeclineConfig, stage: ObjectiveStage, ctx: dict[str, Any], tracker: Tracker) -> dict[str, Any]:
    """One objective as its own Ray Train run and nested MLflow run; returns its results."""
    scfg = dataclasses.replace(cfg, train=stage.train)
    plan = plan_steps(ctx["num_train"], scfg)
    out: Path = ctx["out"]
    with tracker.run(f"train-{stage.name}", log_config=False):
        tracker.log_params({"objective": stage.name, "init_drafter": ctx["init"] or "fresh", **plan,
                            **{f"objective.{k}": v for k, v in stage.params.items()},
                            **{f"train.{k}": v for k, v in dataclasses.asdict(stage.train).items()}})
        run_id = _active_run_id(tracker)
        loop_config = {"cfg": scfg, "target_path": ctx["target_path"], **plan, "init_drafter": ctx["init"],
                       "stage": {"name": stage.name, "params": stage.params},
                       "mlflow": {"uri": tracking_uri(cfg), "run_id": run_id} if run_id else None}
        t0 = time.perf_counter()
        result = _fit(scfg, ctx["dataset"], loop_config, out, _run_name(stage, ctx["init"]))
        seconds = time.perf_counter() - t0
        if result.checkpoint is None:
            raise TrainingFailed(f"train: objective '{stage.name}' finished without a checkpoint")
        with result.checkpoint.as_directory() as d:
            drafter_path = _copy_drafter(Path(d) / "drafter", out / "drafters" / stage.name)
        ev = _evaluate(cfg, load_drafter(drafter_path, ctx["target"]), ctx["heldout"])
        final = dict(result.metrics or {})
        tracker.log_metrics({**_eval_metrics("heldout", ev), "train_seconds": seconds,
                             "final_step": final.get("train/step", 0)})
        tracker.log_artifacts(drafter_path, "drafter")
    return {"objective": stage.name, "run_id": run_id, "drafter_path": str(drafter_path), "eval": ev,
            "checkpoint": str(result.checkpoint.path), "seconds": seconds, "steps": int(final.get("train/step", 0)),
            "loss_first": final.get("train/first_loss"), "loss_last": final.get("train/loss"),
            "tokens_per_s": final.get("train/tokens_per_s")}


def run(cfg: SpeclineConfig, tracker: Tracker, upstream: dict[str, Any]) -> dict[str, Any]:
    """Returns upstream plus ``drafter_path``, ``train_checkpoint``, ``train_run_id``, per-objective
    results (``train_objectives``) and the last objective's headline numbers."""
    streaming = cfg.data.mode == "stream" and not cfg.train.data_dir
    data_dir = None if streaming else _data_dir(cfg, upstream)
    chain = resolve_chain(cfg.train)
    target_path = upstream.get("target_path") or resolve_target_path(cfg.target, progress=True)
    target = load_target(dataclasses.replace(cfg.target, name_or_path=target_path), progress=False)
    torch.manual_seed(cfg.train.seed)
    initial = build_drafter(cfg.drafter, target)
    init_ray(cfg.ray)
    inputs = (_stream_inputs(cfg, target, target_path, initial.layer_ids) if data_dir is None
              else _shard_inputs(cfg, data_dir, target, target_path, initial.layer_ids))
    tracker.log_params({"train.input": "stream" if data_dir is None else "shards",
                        "train.num_train_records": inputs["num_train"], "train.num_heldout_records": len(inputs["heldout"])})
    out = Path(cfg.train.output_dir).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    ctx = {**inputs, "out": out, "target": target, "target_path": target_path, "init": None}
    heldout = inputs["heldout"]
    evals = {"initial": _evaluate(cfg, initial, heldout)}
    results = []
    for stage in chain:
        results.append(_train_objective(cfg, stage, ctx, tracker))
        ctx["init"] = results[-1]["drafter_path"]
        evals[stage.name] = results[-1]["eval"]
    last = results[-1]
    drafter_path = _copy_drafter(Path(last["drafter_path"]), out / "drafter")
    tracker.log_metrics({**_eval_metrics("heldout", last["eval"]), **_eval_metrics("heldout_init", evals["initial"]),
                         "train_seconds": sum(r["seconds"] for r in results)})
    plot = _plot_alpha(evals, out / "plots" / "alpha_by_position.png")
    if plot is not None:
        tracker.log_artifacts(plot.parent, "train/plots")
    tracker.log_artifacts(drafter_path, "train/drafter")
    tracker.log_dict({"objectives": results, "heldout": evals}, "train/summary.json")
    run_id = _active_run_id(tracker)
    version = _register(tracker, cfg, run_id, "train/drafter")
    return {**upstream, "drafter_path": str(drafter_path), "train_checkpoint": last["checkpoint"],
            "train_run_id": run_id, "train_objectives": results, "registered_version": version,
            "train_steps": last["steps"], "train_seconds": sum(r["seconds"] for r in results),
            "train_loss_first": last["loss_first"], "train_loss_last": last["loss_last"],
            "train_tokens_per_s": last["tokens_per_s"],
            "heldout_alpha": last["eval"].get("alpha"), "heldout_tau": last["eval"].get("tau"),
            "heldout_sim_tau": last["eval"].get("sim_tau"), "heldout_sim_alpha": last["eval"].get("sim_alpha"),
            "heldout_tau_initial": evals["initial"].get("tau"),
            "heldout_sim_tau_initial": evals["initial"].get("sim_tau"), "plot": str(plot) if plot else None}


if __name__ == "__main__":
    sys.exit(main(run, "train"))
