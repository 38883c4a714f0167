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
from components.engine import PromptLookupDrafter, SpeculativeEngine, target_only_generate
from components.engine.batch import BatchEngine, Request
from components.engine.chain import commit_round, draft_chain
from components.engine.core import GenerationResult, SequenceState, new_randomness
from components.engine.model_free import TokenState, one_hot_proposal
from components.engine.rules import get_rule
from components.engine.settings import EngineSettings
from components.engine.tree import TreeEngine
from components.spec.sampling import SamplingParams
from tests.components.engine.batch.test_continuous import batch_prompts, requests
from tests.components.engine.doubles import MarkovTarget, counting_forwards

SAMPLED = SamplingParams(temperature=0.9)


def successor_target(target) -> MarkovTarget:
    """``target`` whose next token is (almost surely) the input token + 1: a prompt of distinct
    increasing tokens continues with distinct tokens, so prompt lookup never finds a match."""
    vocab = target.vocab_size
    table = torch.full((vocab, vocab), -12.0)
    table[torch.arange(vocab), (torch.arange(vocab) + 1) % vocab] = 0.0
    return MarkovTarget(target, table)


class BatchedLookup(PromptLookupDrafter):
    """Prompt lookup declaring ``propose_many`` (one lookup per row): a batched proposal in
    which some rows are empty."""

    def capabilities(self) -> frozenset[Capability]:
        return frozenset({Capability.BATCHED_PROPOSE})

    def propose_many(self, states, last, samplings, per_row, generators=None) -> list[Proposal]:
        return [self.propose(s, last[i:i + 1], samplings[i], None, g) for i, (s, g) in enumerate(zip(states, per_row))]


# ----------------------------------------------------------------------------- the drafter
def test_prompt_lookup_proposes_nothing_without_a_match():
    lookup = PromptLookupDrafter(50, 4)
    empty = lookup.propose(TokenState(3, [7, 8, 9]), torch.tensor([10]))
    assert empty.tokens.shape == (1, 0) and empty.logits.shape == empty.probs.shape == (1, 0, 50)
    found = lookup.propose(TokenState(4, [1, 2, 3, 9]), torch.tensor([1]))  # "1" was followed by 2, 3, 9
    assert found.tokens.tolist() == [[2, 3, 9, 1]]
    assert lookup.propose(TokenState(4, [1, 2, 3, 9]), torch.tensor([1]), num_speculative_tokens=2).tokens.tolist() == [[2, 3]]


@pytest.mark.parametrize("tokens", [[], [5], [3, 3, 0, 11], list(range(12))])
def test_one_hot_proposal_is_the_one_hot_construction(tokens):
    """The scatter construction gives exactly ``F.one_hot(ids, V).float()`` and its log."""
    prop = one_hot_proposal(tokens, 12, torch.device("cpu"))
    ids = torch.tensor([tokens], dtype=torch.long).view(1, len(tokens))
    probs = torch.nn.functional.one_hot(ids, 12).float()  # [1, G, V]
    assert torch.equal(prop.tokens, ids) and prop.probs.dtype == prop.logits.dtype == torch.float32
    assert torch.equal(prop.probs, probs) and torch.equal(prop.logits, torch.log(probs))


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


# ----------------------------------------------------------------------------- the engines
def test_no_match_ever_means_every_round_is_a_plain_step(tiny_target, monkeypatch):
    """Distinct tokens in and out: prompt lookup never matches; the batch-1 and the batch engine
    both emit the target's own tokens in plain rounds, each one forward over one token."""
    target, prompt, n = successor_target(tiny_target), list(range(10, 20)), 20
    ref = target_only_generate(target, prompt, n).tokens
    assert ref == list(range(20, 40))
    widths = counting_forwards(monkeypatch, target)
    out = SpeculativeEngine(target, PromptLookupDrafter(target.vocab_size, 4)).generate(prompt, n)
    assert out.tokens == ref
    assert out.rounds == n - 1 and out.accepted == [] and out.drafting_share == 0.0
    assert widths == [len(prompt)] + [1] * (n - 1) and out.target_forwards == n
    reqs = [Request(list(range(s, s + 10)), n) for s in (10, 100, 200)]
    engine = BatchEngine(target, PromptLookupDrafter(target.vocab_size, 4), max_batch_size=3)
    results = engine.generate(reqs)
    assert [r.tokens for r in results] == [list(range(s + 10, s + 30)) for s in (10, 100, 200)]
    assert all(r.rounds == n - 1 and r.accepted == [] for r in results)
    assert engine.stats.drafting_rounds == 0


@pytest.mark.parametrize("seed", [0, 3])
def test_gumbel_with_zero_draft_rounds_is_the_targets_sample(tiny_target, seed):
    """Prompt lookup on real prompts mixes drafting and plain rounds; under Gumbel coupling the
    output is the target's own Gumbel-max sample either way, in both engines."""
    reqs = requests(tiny_target, lengths=(24, 24, 24, 24, 24, 24), rule="gumbel", sampling=SAMPLED, seed=seed)
    refs = [target_only_generate(tiny_target, r.prompt_ids, r.max_new_tokens, SAMPLED, seed, rule="gumbel").tokens
            for r in reqs]
    single = SpeculativeEngine(tiny_target, PromptLookupDrafter(tiny_target.vocab_size, 4), rule="gumbel")
    outs = [single.generate(r.prompt_ids, r.max_new_tokens, SAMPLED, seed) for r in reqs]
    assert [o.tokens for o in outs] == refs
    drafting = sum(len(o.accepted) for o in outs)
    assert 0 < drafting < sum(o.rounds for o in outs)  # both kinds of round occurred
    batch = BatchEngine(tiny_target, PromptLookupDrafter(tiny_target.vocab_size, 4), max_batch_size=4)
    assert [r.tokens for r in batch.generate(reqs)] == refs


@pytest.mark.parametrize("rule", ["speculative", "block"])
def test_sampled_rows_draw_what_the_batch_1_engine_draws(tiny_target, rule):
    """Per-request randomness with zero-draft rounds in the mix: same seed, same tokens."""
    reqs = requests(tiny_target, rule=rule, sampling=SAMPLED)
    for i, r in enumerate(reqs):
        r.seed = 40 + i
    single = SpeculativeEngine(tiny_target, PromptLookupDrafter(tiny_target.vocab_size, 4), rule=rule)
    expected = [single.generate(r.prompt_ids, r.max_new_tokens, SAMPLED, r.seed) for r in reqs]
    assert 0 < sum(len(o.accepted) for o in expected) < sum(o.rounds for o in expected)
    got = BatchEngine(tiny_target, PromptLookupDrafter(tiny_target.vocab_size, 4), max_batch_size=4).generate(reqs)
    assert [r.tokens for r in got] == [o.tokens for o in expected]
    assert [r.accepted for r in got] == [o.accepted for o in expected]


def test_batched_propose_may_leave_some_rows_empty(tiny_target, greedy_refs):
    """A ``propose_many`` whose proposal is empty for some rows: those rows step plainly in the
    shared verify pass, the others verify their drafts; greedy output is the target's."""
    engine = BatchEngine(tiny_target, BatchedLookup(tiny_target.vocab_size, 4), max_batch_size=6)
    assert engine.drafting.batched
    results = engine.generate(requests(tiny_target))
    assert [r.tokens for r in results] == greedy_refs
    assert 0 < engine.stats.drafting_rounds < engine.stats.row_rounds
    assert 0 < engine.stats.summary()["drafting_share"] < 1
    assert all(r.target_forwards == r.rounds + 1 for r in results)


def test_the_adaptive_cap_with_zero_draft_rows(tiny_target, greedy_refs):
    """The adaptive policy sees only the rows that drafted; output stays the target's."""
    from components.engine.adaptive.policy import AdaptiveDraftLength
    from components.spec.cost import ProfileTable

    policy = AdaptiveDraftLength(ProfileTable([1, 512], [1.0, 1.0]))
    engine = BatchEngine(tiny_target, PromptLookupDrafter(tiny_target.vocab_size, 4), draft_length=policy)
    assert [r.tokens for r in engine.generate(requests(tiny_target))] == greedy_refs
    assert engine.caps


def test_prompt_lookup_greedy_mixes_plain_and_drafting_rounds(tiny_target):
    prompts = batch_prompts(tiny_target)
    engine = SpeculativeEngine(tiny_target, PromptLookupDrafter(tiny_target.vocab_size, 4))
    outs = [engine.generate(p, 24) for p in prompts]
    assert [o.tokens for o in outs] == [target_only_generate(tiny_target, p, 24).tokens for p in prompts]
    assert all(o.target_forwards == o.rounds + 1 for o in outs)
    assert 0 < sum(len(o.accepted) for o in outs) < sum(o.rounds for o in outs)


@pytest.mark.parametrize("rule, sampling", [("greedy", SamplingParams()), ("gumbel", SAMPLED)])
def test_tree_rounds_of_no_drafts_are_plain_steps(tiny_target, rule, sampling):
    """A token tree from a drafter that proposed nothing is empty: that round is the chain
    engine's plain step (no tree pass), in the tree engine and in the batch engine's lone-row
    tree round; output stays the target's own, with both kinds of round in the mix."""
    prompts = batch_prompts(tiny_target)
    refs = [target_only_generate(tiny_target, p, 24, sampling, 5, rule=rule).tokens for p in prompts]
    engine = TreeEngine(tiny_target, PromptLookupDrafter(tiny_target.vocab_size, 4), rule=rule, budget=8)
    outs = [engine.generate(p, 24, sampling, 5) for p in prompts]
    assert [o.tokens for o in outs] == refs
    assert all(o.target_forwards == o.rounds + 1 for o in outs)
    assert 0 < sum(len(o.accepted) for o in outs) < sum(o.rounds for o in outs)
    batch = BatchEngine(tiny_target, PromptLookupDrafter(tiny_target.vocab_size, 4), max_batch_size=1, tree_budget=8)
    got = batch.generate([Request(p, 24, sampling=sampling, seed=5, rule=rule) for p in prompts])
    assert [r.tokens for r in got] == refs
    assert 0 < batch.stats.drafting_rounds < batch.stats.row_rounds
