"""Rounds of no drafts: a drafter may propose nothing (prompt lookup without a match), and that
request's round is a plain step in either engine: one target forward over its last token, the
rule's own target sample, counted as a plain round. Output stays the target's own (greedy and
Gumbel token for token), and the batch engine draws what the batch-1 engine draws."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from components.drafters.base import Proposal
from components.drafters.capabilities import Capability
from components.engine import PromptLookupDrafter
from components.engine.chain import commit_round, draft_chain
from components.engine.core import GenerationResult, SequenceState, new_randomness
from components.engine.rules import get_rule
from components.engine.settings import EngineSettings
from components.spec.sampling import SamplingParams
from tests.components.engine.doubles import MarkovTarget

SAMPLED = SamplingParams(temperature=0.9)


def successor_target(target) -> MarkovTarget:
    """``target`` whose next token is (almost surely) the input token + 1: a prompt of distinct
    increasing tokens continues with distinct tokens, so prompt lookup never finds a match."""
    vocab = target.vocab_size
    table = torch.full((vocab, vocab), -12.0)
    table[torch.arange(vocab), (torch.arange(vocab) + 1) % vocab] = 0.0
    return MarkovTarget(target, table)


def counting_forwards(monkeypatch, target) -> list[int]:
    """The input width of every target forward from now on."""
    widths: list[int] = []
    forward = target.forward

    def counted(input_ids, *args, **kwargs):
        widths.append(input_ids.shape[1])
        return forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(target, "forward", counted)
    return widths


class BatchedLookup(PromptLookupDrafter):
    """Prompt lookup declaring ``propose_many`` (one lookup per row): a batched proposal in
    which some rows are empty."""

    def capabilities(self) -> frozenset[Capability]:
        return frozenset({Capability.BATCHED_PROPOSE})

    def propose_many(self, states, last, samplings, per_row, generators=None) -> list[Proposal]:
        return [self.propose(s, last[i:i + 1], samplings[i], None, g) for i, (s, g) in enumerate(zip(states, per_row))]


# ----------------------------------------------------------------------------- counting
def test_tau_is_over_drafting_rounds_and_tokens_per_round_over_all():
    res = GenerationResult([])
    res.add_round(2, 3)  # a drafting round: 3 tokens
    res.add_round()  # a plain round: 1 token
    assert res.rounds == 2 and res.accepted == [2] and res.drafted == [3]
    assert res.tau == 3.0 and res.tokens_per_round == 2.0 and res.drafting_share == 0.5


def test_a_round_of_no_drafts_is_plain_and_carries_nothing():
    """``commit_round`` with drafts [1, 0]: a plain round, and carryover attaches no rows."""
    def refuse(*args):
        raise AssertionError("with_carry called for a round of no drafts")

    drafter = SimpleNamespace(with_carry=refuse)
    settings = EngineSettings(num_speculative_tokens=2, carryover=True)
    seq = SequenceState(None, "state", torch.tensor([5]), 4, [5], carry_rows=0)
    res = GenerationResult([])
    new, emitted = commit_round(drafter, settings, seq, "state", torch.zeros(1, 0, dtype=torch.long), 0,
                                torch.tensor([6]), torch.zeros(1, 1, 1, 8), res)
    assert emitted == [6] and new.length == 5 and new.carry_rows == 0
    assert res.rounds == 1 and res.accepted == [] and res.drafted == []


# ----------------------------------------------------------------------------- DLoop
class StagedDrafter:
    """Proposes ``blocks[k]`` tokens at its k-th stage (states given, so DLoop may go on)."""

    def __init__(self, blocks: list[int], vocab: int = 9):
        self.blocks, self.vocab = blocks, vocab

    def propose(self, state, last, sampling=None, generator=None, num_speculative_tokens=None) -> Proposal:
        g = min(self.blocks[state], num_speculative_tokens)
        probs = torch.full((1, g, self.vocab), 1.0 / self.vocab)  # [1, g, V]
        return Proposal(torch.full((1, g), 3), probs.log(), probs, torch.ones(1, g), torch.zeros(1, g, 4))

    def consume_own(self, state, states):
        return state + 1


@pytest.mark.parametrize("blocks, drafted", [([2, 0, 2], 2), ([0, 2, 2], 0), ([2, 1, 0], 3)])
def test_an_empty_block_ends_dloop_drafting(blocks, drafted):
    settings = EngineSettings(num_speculative_tokens=2, loop_stages=3, loop_gate=-math.inf)
    seq = SequenceState(None, 0, torch.tensor([1]), 5, [1])
    rnd = new_randomness(SamplingParams(temperature=0.0), 0, torch.device("cpu"))
    prop, drafts = draft_chain(StagedDrafter(blocks), settings, get_rule("greedy"), seq, 6, rnd)
    assert drafts.shape == (1, drafted) and prop.tokens.shape == (1, drafted)
    assert prop.confidences is not None and prop.confidences.shape == (1, drafted)
