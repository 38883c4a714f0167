"""The train stage's input: the data stage's shards or a live rollout stream → one :class:`TrainInputs`.

* **Shards** (``train.data_dir``, or the data stage's ``data_dir``): every shard the manifest
  lists is read once, in either format (``components.data.shards.read_tables``), and checked
  against the records this target and drafter need; the held-out split (:func:`heldout_ids`
  over every sample id) is kept as records for evaluation and the rest handed to Ray Data with
  ``from_arrow``. Ray Data's own parquet listing spawns nested footer tasks that deadlock when
  Train workers hold a small box's CPUs; reading here suits the embedded default's tens of MB,
  a streaming read is the scale-out path.
* **Stream** (``data.mode=stream`` and no ``train.data_dir``): the training prompts become a lazy
  rollout stream that the data stage's Ray Data actors generate while the workers train (every
  epoch regenerates with the same per-prompt seeds); the held-out prompts are rolled out once,
  before training, by an actor pool of the same kind. Both must fit on the cluster at once
  (:func:`check_stream_resources`).
* **Draft vocabulary** (``drafter.draft_vocab_size``): shards also give the training split's
  response-token counts (``TrainInputs.token_counts``, two columns read once);
  :func:`choose_draft_vocab` gives the initial drafter its vocabulary from them and writes it to
  ``<train.output_dir>/draft_vocab`` (config.json + d2t/t2d safetensors), which every Ray Train
  worker building a fresh drafter reads (:func:`shared_draft_vocab`); later objectives load
  checkpoints, which carry it. A stream has no records before training: refused.

Knows the data stage's readers and streams, Ray Data, the held-out split and the drafter
registry's vocabulary step; nothing about Ray Train, MLflow or drafter families.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from components.config import ConfigError, SpeclineConfig
from components.data.prompts import collect_prompts
from components.data.records import (
    Record,
    RecordMeta,
    TargetIdentity,
    batch_to_records,
    check_meta,
    records_to_table,
    select_layers,
    split_rows,
    table_to_batch,
    table_to_records,
)
from components.data.shards import load_manifest, read_tables
from components.data.source import describe_target
from components.data.stream import rollout_stream
from components.drafters.base import Drafter
from components.drafters.registry import with_draft_vocab
from components.io import write_checkpoint_dir
from components.training.heldout import heldout_ids

VOCAB_DIR, VOCAB_WEIGHTS = "draft_vocab", "draft_vocab.safetensors"


@dataclass
class TrainInputs:
    """What every objective of the chain trains and is evaluated on."""

    source: str  # "shards" | "stream"
    dataset: Any  # ray.data.Dataset of record rows, the training split (lazy for a stream)
    num_train: int  # training records per epoch
    heldout: list[Record]  # the held-out split, in memory
    token_counts: np.ndarray | None = None  # [max id + 1] int64 response tokens of the training split (shards, with drafter.draft_vocab_size)


def train_inputs(cfg: SpeclineConfig, upstream: dict[str, Any], target: TargetIdentity,
                 layer_ids: list[int]) -> TrainInputs:
    """The stage's input for ``target`` and a drafter reading ``layer_ids``: the shards, or the
    stream when ``data.mode=stream`` and no ``train.data_dir`` is given."""
    if cfg.data.mode == "stream" and not cfg.train.data_dir:
        return stream_inputs(cfg, target, layer_ids)
    return shard_inputs(cfg, data_dir(cfg, upstream), target, layer_ids)


def data_dir(cfg: SpeclineConfig, upstream: dict[str, Any]) -> Path:
    """``train.data_dir``, else the data stage's output."""
    found = cfg.train.data_dir or upstream.get("data_dir")
    if not found:
        raise ConfigError("train: no data; set train.data_dir or run the data stage first (shards mode)")
    return Path(found)


def shard_inputs(cfg: SpeclineConfig, data_dir: Path, target: TargetIdentity, layer_ids: list[int]) -> TrainInputs:
    """Offline input: the shards under ``data_dir`` (any storage dtype), held-out records split off.
    Shards captured at more layers than the drafter reads (rollouts made for another drafter)
    give it its own taps (a copy of the hidden states, made in memory as the shards are read)."""
    import ray.data

    stored = RecordMeta.from_dict(load_manifest(data_dir)["meta"])
    want = RecordMeta.of(target, layer_ids, stored.storage)
    if want != stored and dataclasses.replace(stored, layer_ids=want.layer_ids) == want \
            and set(want.layer_ids) <= set(stored.layer_ids):  # captured for another drafter, holding these taps
        tables = [records_to_table(select_layers(table_to_records(t), stored.layer_ids, want.layer_ids))
                  for t in read_tables(data_dir, stored)]
    else:
        tables = read_tables(data_dir, want)  # refuses another target, tokenizer or layer set by name
    ids = [i for t in tables for i in t.column("sample_id").to_pylist()]
    held = heldout_ids(ids, cfg.train.eval_fraction, cfg.train.seed)
    split = [split_rows(t, held) for t in tables]  # (train, held-out) per shard
    heldout = [r for _, part in split for r in table_to_records(part)]
    train = [part for part, _ in split]
    counts = response_counts(train) if cfg.drafter.draft_vocab_size else None  # only a reduced vocabulary reads them
    return TrainInputs("shards", ray.data.from_arrow(train), len(ids) - len(held), heldout, counts)


def response_counts(tables: list[Any]) -> np.ndarray:  # -> [max id + 1] int64
    """How often each token id is a supervised (loss-masked) response token in ``tables``."""
    counts = np.zeros(1, dtype=np.int64)
    for table in tables:
        batch = table_to_batch(table.select(["input_ids", "loss_mask"]))
        for ids, mask in zip(batch["input_ids"], batch["loss_mask"]):
            found = np.bincount(np.asarray(ids, dtype=np.int64)[np.asarray(mask).astype(bool)])
            counts = np.pad(counts, (0, max(0, found.shape[0] - counts.shape[0])))
            counts[:found.shape[0]] += found
    return counts


def choose_draft_vocab(cfg: SpeclineConfig, target: Any, drafter: Drafter, inputs: TrainInputs) -> Drafter:
    """With ``drafter.draft_vocab_size``: gives ``drafter`` (in place, returned) the training split's
    most frequent response tokens (+ special/stop tokens) and writes them for the workers; else a no-op."""
    if drafter.vocab is None:
        return drafter
    if inputs.token_counts is None:
        raise ConfigError(f"drafter.draft_vocab_size={drafter.vocab.size} chooses the draft vocabulary from the "
                          f"training records, which a {inputs.source} input does not have before training: "
                          "use data.mode=shards (or train.data_dir), or drafter.draft_vocab_size=0")
    with_draft_vocab(drafter, target, torch.from_numpy(inputs.token_counts))
    meta = {"draft_vocab_size": drafter.vocab.size, "target_vocab_size": drafter.vocab.vocab_size,
            "target_tokenizer_hash": drafter.spec.target.tokenizer_hash, "counted_records": inputs.num_train}
    tensors = {"d2t": drafter.vocab.d2t.cpu(), "t2d": drafter.vocab.t2d.cpu()}
    write_checkpoint_dir(vocab_dir(cfg), meta, tensors, VOCAB_WEIGHTS)
    return drafter


def vocab_dir(cfg: SpeclineConfig) -> Path:
    return Path(cfg.train.output_dir) / VOCAB_DIR


def shared_draft_vocab(cfg: SpeclineConfig, drafter: Drafter) -> Drafter:
    """A worker's fresh drafter gets the vocabulary :func:`choose_draft_vocab` wrote (no-op without one)."""
    if drafter.vocab is None:
        return drafter
    where = vocab_dir(cfg)
    if not (where / VOCAB_WEIGHTS).is_file():
        raise ConfigError(f"{where}: no draft vocabulary; the train stage chooses it before training starts")
    meta = json.loads((where / "config.json").read_text())
    want = {"draft_vocab_size": drafter.vocab.size, "target_vocab_size": drafter.vocab.vocab_size,
            "target_tokenizer_hash": drafter.spec.target.tokenizer_hash}
    diffs = [f"{k}: written {meta.get(k)!r}, drafter {v!r}" for k, v in want.items() if meta.get(k) != v]
    if diffs:
        raise ConfigError(f"{where}: the draft vocabulary was chosen for another drafter/target: " + "; ".join(diffs))
    d2t = load_file(str(where / VOCAB_WEIGHTS))["d2t"]
    return drafter.set_draft_vocab(torch.arange(d2t.shape[0]) + d2t)


def stream_inputs(cfg: SpeclineConfig, target: TargetIdentity, layer_ids: list[int]) -> TrainInputs:
    """Online input: the training prompts as a lazy rollout stream, the held-out ones rolled out now."""
    import ray

    desc = describe_target(cfg, str(target.name_or_path))
    prompts, _ = collect_prompts(cfg.data, desc.tokenizer, desc.corpus_dir)
    held = heldout_ids([p.prompt_id for p in prompts], cfg.train.eval_fraction, cfg.train.seed)
    check_stream_resources(cfg, ray.cluster_resources())
    stream = rollout_stream(cfg, desc, [p for p in prompts if p.prompt_id not in held])
    check_meta(stream.meta, RecordMeta.of(target, layer_ids, cfg.data.storage), "data stream")
    heldout: list[Record] = []
    if held:
        held_ds = rollout_stream(cfg, desc, [p for p in prompts if p.prompt_id in held]).dataset
        for batch in held_ds.iter_batches(batch_size=64, batch_format="numpy"):
            heldout += batch_to_records(batch)
    return TrainInputs("stream", stream.dataset, len(prompts) - len(held), heldout)


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
