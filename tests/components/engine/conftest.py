"""Shared engine-test fixtures: the target's own greedy outputs for the standard prompts."""

from __future__ import annotations

import pytest

from components.engine import target_only_generate
from tests.components.engine.test_engine_greedy import MAX_NEW, prompts


@pytest.fixture(scope="module")
def references(tiny_target) -> list[list[int]]:
    """Target-only greedy continuations (MAX_NEW tokens) of ``prompts(tiny_target)``."""
    return [target_only_generate(tiny_target, p, MAX_NEW).tokens for p in prompts(tiny_target)]


@pytest.fixture(scope="module")
def greedy_refs(tiny_target) -> list[list[int]]:
    """Target-only greedy outputs of the batch tests' requests (``batch.test_continuous.requests``)."""
    from tests.components.engine.batch.test_continuous import requests

    return [target_only_generate(tiny_target, r.prompt_ids, r.max_new_tokens).tokens
            for r in requests(tiny_target)]
