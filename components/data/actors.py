"""The Ray Data callable classes of the data stage (one :class:`Roller` per actor).

- :class:`RecordMaker` (stream mode): a batch of prompt rows → an arrow table of records.
- :class:`ShardWriter` (shards mode): a batch of shard rows (each a whole planned shard) →
  one shard file per row, written by the actor itself, and a small summary row back, so hidden
  states never pass through the object store on their way to disk. On a multi-node cluster
  ``data.output_dir`` must therefore be storage every node sees (a shared filesystem mount).

Knows Ray Data's batch formats; the target work is :mod:`components.data.rollout`'s, the file
format :mod:`components.data.shards`'.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from components.config import DataConfig, TargetConfig
from components.data.prompts import Prompt
from components.data.records import Record, RecordMeta, records_to_table
from components.data.rollout import Roller, rows_to_prompts
from components.data.shards import ShardSpec, write_shard


def actor_options(cfg: DataConfig) -> dict[str, Any]:
    """``map_batches`` resources: a fixed pool of actors, each with its configured CPUs/GPUs.
    An actor that dies is not restarted (Ray Data's default restarts it forever, and Ray warns
    about every such actor, ray-project/ray#53727): the stage fails with its error, and running
    it again keeps the shards already written and generates the rest."""
    import ray.data

    opts: dict[str, Any] = {"compute": ray.data.ActorPoolStrategy(size=cfg.num_actors),
                            "num_cpus": cfg.cpus_per_actor, "max_restarts": 0}
    if cfg.gpus_per_actor:
        opts["num_gpus"] = cfg.gpus_per_actor
    return opts


class RecordMaker:
    """Stream mode: prompt rows {sample_id, input_ids, seed} → record rows."""

    def __init__(self, target_cfg: TargetConfig, data_cfg: DataConfig, meta: RecordMeta):
        self.roller = Roller(target_cfg, data_cfg, meta)

    def __call__(self, batch: dict[str, Any]) -> pa.Table:
        return records_to_table(self.roller(rows_to_prompts(batch)))


def shard_rows(specs: list[ShardSpec]) -> list[dict[str, Any]]:
    """One row per planned shard; prompts travel as JSON (small)."""
    return [{"index": s.index,
             "prompts": json.dumps([[p.prompt_id, list(p.input_ids), p.seed] for p in s.prompts])}
            for s in specs]


class Tally:
    """Records and tokens rolled out so far, summed over every actor of a run (a Ray actor of its
    own, made with :func:`start_tally`): each actor adds its finished generation batches, the driver
    reads the run's progress as one line (:func:`components.data.build.build_shards`)."""

    def __init__(self, records_todo: int, started: float):
        self.todo, self.records, self.tokens, self.started = records_todo, 0, 0, started

    def add(self, records: int, tokens: int) -> None:
        self.records += records
        self.tokens += tokens

    def progress(self) -> tuple[int, str]:
        """(records done, ``data: 48/160 records, 9,210 tokens, 38 tok/s``)."""
        rate = self.tokens / max(time.time() - self.started, 1e-9)
        return self.records, f"data: {self.records:,}/{self.todo:,} records, {self.tokens:,} tokens, {rate:.0f} tok/s"


def start_tally(records_todo: int) -> Any:
    """A :class:`Tally` actor (no CPU of its own) for a run that rolls out ``records_todo`` records
    from now on (wall clock: the actor's process starts later, maybe elsewhere)."""
    import ray

    return ray.remote(num_cpus=0)(Tally).remote(records_todo, time.time())


class ShardWriter:
    """Shards mode: shard rows → shard files under ``out_dir`` + summary rows; with a ``tally``
    (:func:`start_tally`), every generation batch counted there as it finishes."""

    def __init__(self, target_cfg: TargetConfig, data_cfg: DataConfig, meta: RecordMeta,
                 out_dir: str, plan: str, samples_per_shard: int = 1, tally: Any = None):
        self.roller = Roller(target_cfg, data_cfg, meta)
        self.out_dir, self.plan, self.fmt = Path(out_dir), plan, data_cfg.format
        self.meta, self.samples, self.tally = meta, samples_per_shard, tally

    def _report(self, records: list[Record]) -> None:
        self.tally.add.remote(len(records), sum(r.num_tokens for r in records))

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {"summary": [], "samples": [], "generate_s": [], "capture_s": [],
                                     "wall_s": []}
        for index, prompts_json in zip(batch["index"], batch["prompts"]):
            prompts = tuple(Prompt(pid, tuple(ids), seed) for pid, ids, seed in json.loads(prompts_json))
            before = dict(self.roller.seconds)
            t0 = time.perf_counter()
            records = self.roller(prompts, self._report if self.tally is not None else None)
            summary = write_shard(self.out_dir, ShardSpec(int(index), prompts), records,
                                  self.meta, self.plan, self.fmt)
            out["summary"].append(json.dumps(summary))
            out["samples"].append(json.dumps([self.roller.decode(r) for r in records[:self.samples]]))
            out["generate_s"].append(self.roller.seconds["generate"] - before["generate"])
            out["capture_s"].append(self.roller.seconds["capture"] - before["capture"])
            out["wall_s"].append(time.perf_counter() - t0)
        return out
