"""Fixtures for the evaluation tests: a random-init drafter saved as the "trained" one, and
held-out prompts of the session's fixture target (two prompt sets)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from components.config import DrafterConfig, EvalConfig


@pytest.fixture(scope="session")
def drafter_path(tmp_path_factory, tiny_target) -> Path:
    from components.drafters import build_drafter, save_drafter

    torch.manual_seed(0)
    drafter = build_drafter(DrafterConfig(name="dspark", num_layers=1, block_size=4, markov_rank=8), tiny_target)
    return save_drafter(drafter, tmp_path_factory.mktemp("eval-drafter") / "drafter")


@pytest.fixture(scope="session")
def eval_prompt_list(tiny_target, tiny_target_build):
    from components.evaluation import eval_prompts

    # one prompt of each of two sets: code completion and a raw document window
    return eval_prompts(EvalConfig(prompt_sets=["humaneval", "text"], num_prompts=1), tiny_target.tokenizer,
                        tiny_target_build[0])
