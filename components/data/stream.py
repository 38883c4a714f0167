"""Stream mode: target rollouts as a lazy Ray Dataset of records, handed to training directly.

Nothing is written to disk: the training stage iterates the dataset (``iter_torch_batches``
or a Ray Train dataset shard) while actors keep generating. Rows have the columns of
:mod:`components.data.records`; the :class:`RecordMeta` travels beside the dataset.

Knows Ray Data; the prompt, rollout and record work belongs to the modules it calls.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from components.config import SpeclineConfig
from components.data.actors import RecordMaker, actor_options
from components.data.prompts import Prompt, PromptStats, collect_prompts
from components.data.records import RecordMeta
from components.data.rollout import config_kwargs, prompt_rows
from components.data.source import TargetDescription, describe_target, record_meta


@dataclass
class RolloutStream:
    dataset: object  # ray.data.Dataset of record rows (lazy: nothing runs until iterated)
    meta: RecordMeta  # what every record of the stream was captured for
    prompts: int
    stats: PromptStats


def prompts_dataset(prompts: Sequence[Prompt], batch_size: int):
    """Prompt rows, one block per generation batch (so batches match shards mode's)."""
    import ray.data

    rows = prompt_rows(prompts)
    return ray.data.from_items(rows, override_num_blocks=max(1, math.ceil(len(rows) / batch_size)))


def rollout_stream(cfg: SpeclineConfig, desc: TargetDescription | None = None,
                   prompts: Sequence[Prompt] | None = None) -> RolloutStream:
    """A lazy dataset of records for ``cfg``'s prompts (or the given ones) plus its meta."""
    desc = desc or describe_target(cfg)
    stats = PromptStats(used=len(prompts or ()))
    if prompts is None:
        prompts, stats = collect_prompts(cfg.data, desc.tokenizer, desc.corpus_dir)
    meta = record_meta(cfg, desc)
    ds = prompts_dataset(prompts, cfg.data.batch_size).map_batches(
        RecordMaker, batch_size=cfg.data.batch_size, batch_format="numpy",
        fn_constructor_kwargs=config_kwargs(desc.target_cfg, cfg.data, meta), **actor_options(cfg.data))
    return RolloutStream(ds, meta, len(prompts), stats)
