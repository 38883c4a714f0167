"""Shards mode, end to end: plan → resume → Ray Data actors write the missing shards → manifest.

Idempotent: a rerun into the same ``output_dir`` keeps every finished shard of the same plan,
removes temporary files a crash left behind, writes only the missing shards, and rewrites the
manifest. Progress is reported shard by shard through a callback (the pipeline logs it to
MLflow while the run goes on), and as a line of text every few seconds while generation batches
finish (records and tokens so far, summed over the actors by a :class:`~components.data.actors.Tally`).

Knows Ray Data and the stage's modules; nothing about MLflow.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from components import interrupts
from components.config import SpeclineConfig
from components.data.actors import ShardWriter, actor_options, shard_rows, start_tally
from components.data.prompts import Prompt, PromptStats
from components.data.records import RecordMeta
from components.data.rollout import config_kwargs
from components.data.shards import (
    clean_partial,
    existing_shards,
    plan_id,
    plan_shards,
    write_manifest,
)
from components.data.source import TargetDescription, generation_params, record_meta

Progress = Callable[[dict[str, Any]], None]
Lines = Callable[[str], None]
LINE_EVERY_S = 5.0  # how often the live progress line is read (shown when more records are done)


def build_shards(cfg: SpeclineConfig, desc: TargetDescription, prompts: Sequence[Prompt], stats: PromptStats,
                 out_dir: Path, progress: Progress | None = None, lines: Lines | None = None) -> dict[str, Any]:
    """Writes (or completes) the shards of ``prompts`` under ``out_dir``; returns the manifest.
    ``progress`` gets a dict per finished shard, ``lines`` a line of text as generation goes on."""
    meta = record_meta(cfg, desc)
    out_dir.mkdir(parents=True, exist_ok=True)
    specs = plan_shards(prompts, cfg.data.shard_size)
    plan = plan_id(prompts, generation_params(cfg.data), cfg.data.shard_size, cfg.data.format)
    removed = clean_partial(out_dir)
    done = existing_shards(out_dir, specs, meta, plan, cfg.data.format)
    todo = [s for s in specs if s.index not in done]
    run = _write_missing(cfg, desc, meta, plan, todo, out_dir, progress, lines) if todo else _empty_run()
    shards = [*done.values(), *run["summaries"]]
    extra = {"prompts": asdict(stats), "generation": generation_params(cfg.data),
             "run": {"shards_reused": len(done), "shards_written": len(todo), "partial_removed": removed,
                     "seconds": run["seconds"], "generate_seconds": run["generate_s"],
                     "capture_seconds": run["capture_s"]},
             "samples": run["samples"]}
    return write_manifest(out_dir, meta, plan, cfg.data.format, shards, extra)


def _empty_run() -> dict[str, Any]:
    return {"summaries": [], "samples": [], "seconds": 0.0, "generate_s": 0.0, "capture_s": 0.0}


def _write_missing(cfg: SpeclineConfig, desc: TargetDescription, meta: RecordMeta, plan: str, todo: list,
                   out_dir: Path, progress: Progress | None, lines: Lines | None) -> dict[str, Any]:
    import ray.data

    rows = shard_rows(todo)
    tally = start_tally(sum(len(s.prompts) for s in todo)) if lines is not None else None  # nobody reads it otherwise
    ds = ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
        ShardWriter, batch_size=1, batch_format="numpy",
        fn_constructor_kwargs={**config_kwargs(desc.target_cfg, cfg.data, meta), "out_dir": str(out_dir),
                               "plan": plan, "samples_per_shard": 1, "tally": tally},
        **actor_options(cfg.data))
    out, t0 = _empty_run(), time.perf_counter()
    tokens = 0
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(tally, lines, stop), daemon=True, name="data-progress")
    if tally is not None:
        watcher.start()
    try:
        for row in ds.iter_rows():
            summary = json.loads(row["summary"])
            out["summaries"].append(summary)
            out["samples"] += json.loads(row["samples"])
            out["generate_s"] += float(row["generate_s"])
            out["capture_s"] += float(row["capture_s"])
            tokens += summary["tokens"]
            interrupts.check()  # a Ctrl-C lost inside Ray Data's own code stops after this whole shard
            if progress is not None:
                elapsed = time.perf_counter() - t0
                progress({"shards_done": len(out["summaries"]), "shards_todo": len(todo),
                          "records_done": sum(s["records"] for s in out["summaries"]),
                          "tokens_done": tokens, "tokens_per_s": tokens / max(elapsed, 1e-9)})
    finally:
        stop.set()
        if tally is not None:
            watcher.join()
            ray.kill(tally)
    out["seconds"] = time.perf_counter() - t0
    return out


def _watch(tally: Any, lines: Lines, stop: threading.Event) -> None:
    """Every LINE_EVERY_S (and once at the end): the tally's line to ``lines`` when more records
    are done than the last line said."""
    import ray

    shown = 0
    while True:
        stopping = stop.wait(LINE_EVERY_S)
        done, line = ray.get(tally.progress.remote())
        if done > shown:
            lines(line)
            shown = done
        if stopping:
            return
