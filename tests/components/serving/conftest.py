"""Serving-test fixtures: a saved (random) drafter for the fixture target, its engine parts,
and the fixture target's own greedy continuations to compare served outputs with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from components.config import DrafterConfig, ServeConfig
from components.engine import target_only_generate
from components.serving.app import served_for
from components.serving.assemble import build_parts
from components.serving.provenance import DrafterSource

SERVING_DRAFTER = DrafterConfig(name="dspark", num_layers=1, block_size=4, markov_rank=8)


@pytest.fixture(scope="session")
def serving_drafter(tmp_path_factory, tiny_target) -> Path:
    from components.drafters import build_drafter, save_drafter

    torch.manual_seed(0)
    return save_drafter(build_drafter(SERVING_DRAFTER, tiny_target), tmp_path_factory.mktemp("serving") / "drafter")


def make_parts(tiny_target_cfg, tiny_target_build, drafter_path: Path | None, method: str = "model", **serve):
    sc = ServeConfig(**{"adaptive": False, "max_ongoing_requests": 4, "max_queued_requests": 4, **serve})
    source = DrafterSource(str(drafter_path) if drafter_path else None, "test", method=method)
    parts = build_parts(tiny_target_cfg, sc, str(tiny_target_build[0]), source)
    return parts, served_for(parts.target, sc, "tiny"), sc


def greedy_reference(target, prompt_ids: list[int], n: int) -> list[int]:
    return target_only_generate(target, prompt_ids, n).tokens


def prompt_ids(target, count: int) -> list[list[int]]:
    """``count`` prompts of 6..14 token ids (different lengths), cut from a piece of code."""
    text = ("def parse(path):\n    with open(path) as f:\n        return [line.split() for line in f]\n"
            "class Queue:\n    def __init__(self):\n        self.items = []\n")
    ids = target.tokenizer.encode(text)
    return [ids[2 * i % 40:2 * i % 40 + 6 + 2 * (i % 5)] for i in range(count)]
