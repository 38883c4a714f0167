"""Greedy speculative decoding equals the target's own greedy decoding, token for token (float32),
for every registered drafter, the cheating drafters, and prompt lookup; the cache is cropped to
the committed length after rejections and no accepted token is recomputed."""

from __future__ import annotations

import pytest
import torch

import components.drafters  # noqa: F401  (registers every family)
from components.config import DrafterConfig
from components.drafters.registry import DRAFTERS, build_drafter
from components.engine import (
    OracleDrafter,
    PromptLookupDrafter,
    SpeculativeEngine,
    TargetDrafter,
    chain,
    target_only_generate,
)
from tests.components.engine.doubles import counting_forwards

MAX_NEW = 24


def prompts(target) -> list[list[int]]:
    texts = ["def main(args):\n    ", "import os\nimport sys\n", "class Foo:\n    def __init__(self"]
    return [target.tokenizer(t)["input_ids"] for t in texts]


def random_drafter(target, name: str):
    torch.manual_seed(0)
    return build_drafter(DrafterConfig(name=name, num_layers=1), target).eval()


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_every_drafter_greedy_lossless(tiny_target, references, name):
    engine = SpeculativeEngine(tiny_target, random_drafter(tiny_target, name), rule="greedy")
    for prompt, ref in zip(prompts(tiny_target), references):
        out = engine.generate(prompt, MAX_NEW)
        assert out.tokens == ref
        assert len(out.tokens) == MAX_NEW
        assert out.target_forwards == out.rounds + 1
        assert sum(out.accepted) + out.rounds + 1 >= MAX_NEW  # prefill token + accepted + next per round


@pytest.mark.parametrize("kind", ["oracle", "target"])
def test_cheating_drafter_accepts_everything(tiny_target, references, kind):
    gamma = 5
    max_new = 1 + 4 * (gamma + 1)  # prefill token + 4 full rounds
    for prompt in prompts(tiny_target):
        ref = target_only_generate(tiny_target, prompt, max_new).tokens
        drafter = (OracleDrafter(prompt + ref, tiny_target.vocab_size, gamma) if kind == "oracle"
                   else TargetDrafter(tiny_target, gamma))
        out = SpeculativeEngine(tiny_target, drafter, rule="greedy").generate(prompt, max_new)
        assert out.tokens == ref
        assert out.accepted == [gamma] * 4 and out.drafted == [gamma] * 4
        assert out.tau == gamma + 1
        assert out.target_forwards == 5


def test_prompt_lookup_greedy_lossless(tiny_target, references):
    engine = SpeculativeEngine(tiny_target, PromptLookupDrafter(tiny_target.vocab_size, 4), rule="greedy")
    for prompt, ref in zip(prompts(tiny_target), references):
        assert engine.generate(prompt, MAX_NEW).tokens == ref


def test_lookup_finds_latest_ngram():
    from components.engine.model_free import lookup

    assert lookup([1, 2, 3, 9, 1, 2, 4, 5, 1, 2], 2) == [4, 5, 1, 2]
    assert lookup([7, 8, 9], 3) == []
    # a loop one period back: the continuation is looked up again instead of stopping at 3 tokens
    assert lookup([5, 6, 7, 5, 6, 7, 5, 6], 2, count=7) == [7, 5, 6, 7, 5, 6, 7]
    assert lookup([1, 2, 3, 9, 1, 2, 4, 5, 1, 2], 2, count=3) == [4, 5, 1]
    assert lookup([7, 8, 9], 3, count=4) == []


def test_cache_cropped_to_committed_length_no_recompute(tiny_target, references, monkeypatch):
    """A half-right oracle: every round has rejections; the cache must hold exactly n-1 positions."""
    prompt, ref = prompts(tiny_target)[0], references[0]
    wrong = [(t + 1) % tiny_target.vocab_size if i % 3 == 2 else t for i, t in enumerate(ref)]
    engine = SpeculativeEngine(tiny_target, OracleDrafter(prompt + wrong, tiny_target.vocab_size, 4))
    calls = counting_forwards(monkeypatch, tiny_target)
    lengths: list[tuple[int, int]] = []
    accept = chain.accept_chain

    def checked_accept(drafter, settings, seq, drafts, result, hidden, cache, res, proposal=None):
        new = accept(drafter, settings, seq, drafts, result, hidden, cache, res, proposal)
        lengths.append((new.cache.get_seq_length(), new.length - 1))
        assert new.draft_state.length == new.length - 1
        return new

    monkeypatch.setattr(chain, "accept_chain", checked_accept)  # the batch-1 round's accept step
    out = engine.generate(prompt, MAX_NEW)
    assert out.tokens == ref
    assert 0 < sum(out.accepted) < sum(out.drafted)  # some accepted, some rejected
    assert all(cache_len == committed for cache_len, committed in lengths)
    assert len(calls) == out.rounds + 1 == out.target_forwards
    assert calls[0] == len(prompt) and all(c == g + 1 for c, g in zip(calls[1:], out.drafted))


@pytest.mark.parametrize("rule", ["speculative", "block", "gumbel"])
def test_sampling_rules_at_temperature_zero_are_greedy(tiny_target, references, rule):
    from components.spec.sampling import SamplingParams

    engine = SpeculativeEngine(tiny_target, random_drafter(tiny_target, "dspark"), rule=rule)
    prompt, ref = prompts(tiny_target)[1], references[1]
    assert engine.generate(prompt, MAX_NEW, SamplingParams(temperature=0.0), seed=3).tokens == ref


def test_every_engine_records_when_its_first_token_was_known(tiny_target):
    """The baseline and the engines time their prefill (the first new token comes from it), so
    the eval can split time to first token from decoding; it is part of the total."""
    prompt = prompts(tiny_target)[0]
    for out in (target_only_generate(tiny_target, prompt, 6),
                SpeculativeEngine(tiny_target, PromptLookupDrafter(tiny_target.vocab_size, 4)).generate(prompt, 6)):
        assert 0 < out.prefill_seconds <= out.total_seconds
