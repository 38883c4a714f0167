"""Fixtures shared by the pipeline tests: one small data-stage output for every train-stage test."""

from __future__ import annotations

from pathlib import Path

import pytest

from components.config import DataConfig, DrafterConfig, SpeclineConfig
from components.data.build import build_shards
from components.data.prompts import collect_prompts
from components.data.source import describe_target

TRAIN_DATA = DataConfig(max_prompts=10, max_new_tokens=12, batch_size=5, shard_size=5, storage="float16",
                        temperature=0.8, num_actors=1, cpus_per_actor=0.5)
TRAIN_DRAFTER = DrafterConfig(name="dspark", block_size=4, num_anchors=16, markov_rank=8)


@pytest.fixture(scope="session")
def train_data_dir(tmp_path_factory, tiny_target_cfg, tiny_target_build, ray_session) -> Path:
    """Rollouts of the fixture target with the taps of TRAIN_DRAFTER (built once per session)."""
    cfg = SpeclineConfig(run_dir=str(tmp_path_factory.mktemp("train-data")), target=tiny_target_cfg,
                         data=TRAIN_DATA, drafter=TRAIN_DRAFTER)
    info = describe_target(cfg)
    prompts, stats = collect_prompts(cfg.data, info.tokenizer, info.corpus_dir)
    build_shards(cfg, info, prompts, stats, Path(cfg.data.output_dir))
    return Path(cfg.data.output_dir)
