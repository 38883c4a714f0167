"""The hybrid drafter: suffix decoding's draft when its score clears the threshold, else the
trained drafter's. Greedy output stays the target's own token for token in both engines, with
DLoop stages, carryover, batched passes and the adaptive cap; sampled output follows the target's
distribution; the side chosen each round follows the threshold.

The suffix side of most tests is scripted (``ScriptedSuffix``: the known continuation, or none
every other round), so that both kinds of round occur whatever the fixture target's training
produced; the threshold test runs the real suffix drafter on a target whose output is known."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from components.drafters.capabilities import Capability, CapabilityError
from components.engine import (
    OPEN_GATE,
    BatchEngine,
    HybridDrafter,
    SpeculativeEngine,
    SuffixDrafter,
    TreeEngine,
    adaptive_engine,
    chain,
    resolve_settings,
    target_only_generate,
)
from components.engine.chain import draft_chain
from components.engine.core import SequenceState, new_randomness
from components.engine.hybrid import MODEL, SUFFIX
from components.engine.rules import get_rule
from components.engine.suffix import Candidate
from components.spec.sampling import SamplingParams
from tests.components.engine.batch.test_continuous import requests
from tests.components.engine.doubles import ScriptedDrafter, markov_target
from tests.components.engine.test_engine_capabilities import forbid, without
from tests.components.engine.test_engine_carryover import carry_drafter, expected_carried
from tests.components.engine.test_engine_greedy import MAX_NEW, prompts
from tests.components.engine.test_engine_sampling import (
    FixedQDrafter,
    chi_square_p_value,
    expected_and_q,
    prompt_of,
)
from tests.components.engine.test_engine_zero_draft import SAMPLED, successor_target


class ScriptedSuffix(SuffixDrafter):
    """The suffix side made to order: its candidate is the continuation of the reference (prompt
    + expected output) whose prefix the context is, every token's estimated probability 1 (score
    = length); the last token made wrong with ``wrong_last`` (each suffix round then rejects
    something); with ``alternate`` nothing where the context's length is even (so the model
    drafts those rounds): a choice by the context alone, so that every engine makes the same
    choices, however often it looks a candidate up (``preview`` looks before the cap)."""

    def __init__(self, references: list[list[int]], vocab_size: int, gamma: int, alternate: bool = True,
                 wrong_last: bool = False):
        super().__init__(vocab_size, gamma, gamma + 1)
        self.references, self.alternate, self.wrong_last = [list(r) for r in references], alternate, wrong_last

    def candidate(self, state, last_token, gamma, ahead=()) -> Candidate:
        context = state.tokens + list(ahead) + [int(last_token[0])]
        i = next((i for i, r in enumerate(self.references) if r[:len(context)] == context), -1)
        if i < 0 or (self.alternate and len(context) % 2 == 0):
            return Candidate()
        tokens = self.references[i][len(context):len(context) + gamma]
        if self.wrong_last and tokens:
            tokens[-1] = (tokens[-1] + 1) % self.vocab_size
        return Candidate(tokens, [1.0] * len(tokens), len(context))


def dspark(target, carryover: bool = False):
    """A random DSpark drafter (block 4: γ = 4), with a random non-zero E_carry if ``carryover``."""
    return carry_drafter(target, "dspark", carryover)


def hybrid(target, references, trained=None, gamma_s: int = 8, threshold: float = 0.0, **scripted) -> HybridDrafter:
    trained = trained if trained is not None else dspark(target)
    return HybridDrafter(trained, ScriptedSuffix(references, target.vocab_size, gamma_s, **scripted), threshold)


def full(prompt_list, outputs) -> list[list[int]]:
    return [p + o for p, o in zip(prompt_list, outputs)]


MODES = {"plain": {}, "dloop": {"loop_stages": 3, "loop_gate": -2.0},
         "carryover": {"carryover": True}, "dloop+carryover": {"loop_stages": 3, "loop_gate": OPEN_GATE, "carryover": True}}


# ----------------------------------------------------------------------------- lossless, both engines
@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_is_the_targets_output_in_the_batch_1_engine(tiny_target, references, mode):
    """Both kinds of round in every generation; carry rows attached after either, as counted."""
    settings = MODES[mode]
    trained = dspark(tiny_target, carryover=settings.get("carryover", False))
    draft = hybrid(tiny_target, full(prompts(tiny_target), references), trained, wrong_last=True)
    attached: list[int] = []
    if settings.get("carryover"):
        with_carry = trained.with_carry
        trained.with_carry = lambda s, h, start: attached.append(h.shape[1]) or with_carry(s, h, start)
    engine = SpeculativeEngine(tiny_target, draft, **settings)
    gamma, longest = trained.num_speculative_tokens, 0
    for prompt, ref in zip(prompts(tiny_target), references):
        attached.clear()
        out = engine.generate(prompt, MAX_NEW)
        assert out.tokens == ref and out.target_forwards == out.rounds + 1
        longest = max(longest, *out.drafted)
        if settings.get("carryover"):
            assert out.carried == expected_carried(out, gamma)
            assert attached == [min(d - a, gamma) for d, a in zip(out.drafted, out.accepted) if d > a]
    assert draft.drafted_by[SUFFIX] > 0 and draft.drafted_by[MODEL] > 0
    if settings.get("loop_stages", 1) > 1:
        assert longest > gamma  # a round drafted past one block (the suffix's 8 over two stages at least)


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("batched", [True, False])
def test_greedy_is_the_targets_output_in_the_batch_engine(tiny_target, greedy_refs, mode, batched):
    """Batched propose/consume (the trained drafter's, passed on) or row by row: same output."""
    settings = MODES[mode]
    reqs = requests(tiny_target)
    trained = dspark(tiny_target, carryover=settings.get("carryover", False))
    if not batched:
        without(trained, Capability.BATCHED_PROPOSE, Capability.BATCHED_CONSUME)
    draft = hybrid(tiny_target, full([r.prompt_ids for r in reqs], greedy_refs), trained, wrong_last=True)
    assert (Capability.BATCHED_PROPOSE in draft.capabilities()) == batched
    engine = BatchEngine(tiny_target, draft, max_batch_size=4, **settings)
    results = engine.generate(reqs)
    assert [r.tokens for r in results] == greedy_refs
    assert all(r.target_forwards == r.rounds + 1 for r in results)
    assert draft.drafted_by[SUFFIX] > 0 and draft.drafted_by[MODEL] > 0


@pytest.mark.parametrize("mode", ["plain", "dloop+carryover"])
def test_the_trained_drafter_reads_the_targets_states_after_either_kind_of_round(tiny_target, references, mode,
                                                                              monkeypatch):
    """After every round, suffix or model, the trained side's state is what consuming the
    committed tokens with the target's own hidden states gives (carry rows aside)."""
    settings = MODES[mode]
    trained = dspark(tiny_target, carryover=settings.get("carryover", False))
    draft = hybrid(tiny_target, full(prompts(tiny_target), references), trained, wrong_last=True)
    states = []

    def recording_accept(*args, accept=chain.accept_chain):
        new = accept(*args)
        states.append((new.length, new.draft_state))
        return new

    monkeypatch.setattr(chain, "accept_chain", recording_accept)
    prompt = prompts(tiny_target)[0]
    out = SpeculativeEngine(tiny_target, draft, **settings).generate(prompt, MAX_NEW)
    ids = torch.tensor([prompt + out.tokens])
    hidden = tiny_target.forward(ids, layer_ids=trained.layer_ids).hidden
    for length, state in states:
        want = trained.consume(trained.init_state(1), ids[:, :length - 1], hidden[:, :length - 1])
        assert state.trained.length == state.suffix.length == length - 1
        assert state.suffix.tokens == ids[0, :length - 1].tolist()
        for (k, v), (k0, v0) in zip(state.trained.kv, want.kv):
            torch.testing.assert_close(k, k0, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(v, v0, rtol=1e-4, atol=1e-4)
    assert draft.drafted_by[SUFFIX] > 0 and draft.drafted_by[MODEL] > 0 and len(states) == out.rounds


def test_the_batch_engine_drafts_what_the_batch_1_engine_drafts(tiny_target, greedy_refs):
    """Per request, the same rounds: drafts and acceptances, whichever side drafted them."""
    reqs = requests(tiny_target)
    refs = full([r.prompt_ids for r in reqs], greedy_refs)
    single = SpeculativeEngine(tiny_target, hybrid(tiny_target, refs, wrong_last=True), loop_stages=2)
    expected = [single.generate(r.prompt_ids, r.max_new_tokens) for r in reqs]
    batch = BatchEngine(tiny_target, hybrid(tiny_target, refs, wrong_last=True), max_batch_size=6, loop_stages=2)
    got = batch.generate(reqs)
    assert [(r.tokens, r.drafted, r.accepted) for r in got] == [(o.tokens, o.drafted, o.accepted) for o in expected]


def test_the_adaptive_engine_is_lossless(tiny_target, greedy_refs, tmp_path):
    """As the serve stage and ``drafter_adaptive`` run it: the adaptive cap over γ·stages, open
    gate, a round profile measured for the hybrid (once, at batch 1)."""
    reqs = requests(tiny_target)[:3]
    draft = hybrid(tiny_target, full([r.prompt_ids for r in reqs], greedy_refs), wrong_last=True)
    settings = resolve_settings(draft, loop_stages=2, loop_gate=OPEN_GATE)
    engine, stored = adaptive_engine(tiny_target, draft, settings, tmp_path, 1)
    assert not stored.reused
    assert [r.tokens for r in engine.generate(reqs)] == greedy_refs[:3] and engine.capped_rounds > 0


class PinnedCap:
    """A draft-length policy that picks ``value`` every round (the policy's interface)."""

    adapts, calibrate, row_lengths = True, False, None

    def __init__(self, value: int):
        self.value = value

    def empirical_survival(self, max_cap: int) -> np.ndarray:  # → [max_cap] float64
        return np.ones(max_cap)

    def cap(self, survival, max_cap: int, remaining=None) -> int:
        return min(self.value, max_cap)

    def observe(self, *args, **kwargs) -> None:
        pass


@pytest.mark.parametrize("cap", [0, 3, 6])
def test_the_cap_bounds_suffix_rounds_as_model_rounds(tiny_target, greedy_refs, cap):
    """The cap is the round's whoever drafts (γ 4, two stages, a suffix candidate of 8): no
    round verifies more; a cap of 0 makes every round plain, without asking either side."""
    reqs = requests(tiny_target)
    draft = hybrid(tiny_target, full([r.prompt_ids for r in reqs], greedy_refs))
    engine = BatchEngine(tiny_target, draft, max_batch_size=4, loop_stages=2, loop_gate=OPEN_GATE,
                         draft_length=PinnedCap(cap))
    results = engine.generate(reqs)
    assert [r.tokens for r in results] == greedy_refs
    drafted = [d for r in results for d in r.drafted]
    assert max(drafted, default=0) <= cap and (cap == 0) == (sum(draft.drafted_by.values()) == 0)
    if cap == 6:  # past one block: the suffix's stages (and the model's)
        assert draft.drafted_by[SUFFIX] > 0 and max(drafted) == 6


def test_token_trees_are_lossless(tiny_target, references, greedy_refs):
    """DDTree rounds (batch 1, and the batch engine's lone row): a suffix round's one-hot
    marginals make its tree the suffix chain; the model's rounds branch as before."""
    draft = hybrid(tiny_target, full(prompts(tiny_target), references), wrong_last=True)
    engine = TreeEngine(tiny_target, draft, budget=8)
    assert [engine.generate(p, MAX_NEW).tokens for p in prompts(tiny_target)] == references
    assert draft.drafted_by[SUFFIX] > 0 and draft.drafted_by[MODEL] > 0
    reqs = requests(tiny_target)
    draft = hybrid(tiny_target, full([r.prompt_ids for r in reqs], greedy_refs), wrong_last=True)
    results = BatchEngine(tiny_target, draft, max_batch_size=2, tree_budget=8).generate(reqs)
    assert [r.tokens for r in results] == greedy_refs


# ----------------------------------------------------------------------------- stages and capabilities
def test_a_suffix_round_continues_over_dloop_stages(tiny_target):
    """γ = 4 per stage, three stages: a suffix candidate of 9 tokens is drafted 4 + 4 + 1 in one
    round, the round's committed state unchanged but for the candidate it recorded."""
    prompt = [5, 6, 7]
    reference = prompt + list(range(30, 45))
    draft = hybrid(tiny_target, [reference], gamma_s=9, alternate=False)
    settings = resolve_settings(draft, loop_stages=3, loop_gate=0.0)
    ids = torch.tensor([prompt])
    state = draft.consume(draft.init_state(1), ids, tiny_target.forward(ids, layer_ids=draft.layer_ids).hidden)
    seq = SequenceState(None, state, torch.tensor([30]), 4, [30])
    rnd = new_randomness(SamplingParams(), 0, torch.device("cpu"))
    prop, drafts = draft_chain(draft, settings, get_rule("greedy"), seq, settings.max_cap, rnd)
    assert drafts[0].tolist() == reference[4:13] and prop.tokens.shape == (1, 9)
    assert prop.confidences is not None and prop.confidences.shape == (1, 9)  # every stage's, for the adaptive cap
    assert seq.draft_state is state and state.trained.length == 3 and state.suffix.length == 3
    assert draft.drafted_by == Counter({SUFFIX: 1})


def test_a_trained_drafter_without_own_states_gets_no_later_stages(tiny_target, references, monkeypatch):
    """The hybrid declares OWN_CONTEXT for its suffix rounds; the model's rounds stay one block
    when the trained drafter does not declare it (its proposals' states are dropped)."""
    trained = without(dspark(tiny_target), Capability.OWN_CONTEXT)
    forbid(monkeypatch, trained, "consume_own")
    draft = hybrid(tiny_target, full(prompts(tiny_target), references), trained)
    assert Capability.OWN_CONTEXT in draft.capabilities()
    engine = SpeculativeEngine(tiny_target, draft, loop_stages=3, loop_gate=OPEN_GATE)
    for prompt, ref in zip(prompts(tiny_target), references):
        assert engine.generate(prompt, MAX_NEW).tokens == ref


def test_capabilities_are_those_of_the_trained_drafter_passed_on(tiny_target):
    draft = HybridDrafter(dspark(tiny_target, carryover=True), SuffixDrafter(tiny_target.vocab_size, 4, 8), 1.0)
    assert draft.capabilities() == {Capability.OWN_CONTEXT, Capability.LEARNS_RESPONSES, Capability.PREVIEWS,
                                    Capability.CARRYOVER, Capability.BATCHED_PROPOSE, Capability.BATCHED_CONSUME}
    for cap in draft.capabilities():
        assert all(getattr(draft, m, None) is not None for m in cap.methods)
    assert draft.layer_ids == draft.trained.layer_ids and draft.num_speculative_tokens == 4
    plain = HybridDrafter(dspark(tiny_target), SuffixDrafter(tiny_target.vocab_size, 4, 8), 1.0)
    with pytest.raises(CapabilityError, match="needs capability carryover"):
        resolve_settings(plain, carryover=True)
    with pytest.raises(ValueError, match="threshold"):
        HybridDrafter(dspark(tiny_target), SuffixDrafter(tiny_target.vocab_size, 4, 8), float("nan"))


# ----------------------------------------------------------------------------- the choice
class Sides(Counter):
    """``HybridDrafter.drafted_by`` that also keeps the order of its counts (one per round)."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list[str] = []

    def __setitem__(self, key: str, value: int) -> None:
        self.order.append(key)
        super().__setitem__(key, value)


@pytest.mark.parametrize("threshold", [0.0, 2.5, 3.0, float("inf")])
def test_the_side_drafting_each_round_follows_the_threshold(tiny_target, threshold):
    """The real suffix drafter, its global tree holding the known output of a successor target
    (next = input + 1: a response of distinct tokens, so every estimated probability is 1 and a
    candidate's score is its length, the match's up to γ_s = 4); the trained side always wrong
    (each model round commits one token). Each round's side is the suffix iff its candidate is
    not empty and scores ≥ the threshold: 0 every round, ∞ none, 2.5 and 3 from the third (scores
    1, 2, 3)."""
    target, prompt, n = successor_target(tiny_target), list(range(10, 20)), 20
    ref = target_only_generate(target, prompt, n).tokens
    suffix = SuffixDrafter(target.vocab_size, 4, 12)
    suffix.observe(ref)
    draft = HybridDrafter(ScriptedDrafter([prompt + ref], target.vocab_size, 4, wrong=True), suffix, threshold)
    draft.drafted_by = Sides()
    seen = []
    candidate = suffix.candidate

    def recorded(state, last_token, gamma):
        best = candidate(state, last_token, gamma)
        seen.append(best)
        return best

    suffix.candidate = recorded
    out = SpeculativeEngine(target, draft).generate(prompt, n)
    assert out.tokens == ref
    chosen = draft.drafted_by.order
    assert chosen == [SUFFIX if c.tokens and c.score >= threshold else MODEL for c in seen]
    assert len(chosen) == len(out.accepted) == out.rounds
    assert (MODEL not in chosen) == (threshold == 0.0) and (SUFFIX not in chosen) == (threshold == float("inf"))
    if threshold in (2.5, 3.0):  # a score equal to the threshold clears it
        assert [c.score for c in seen[:3]] == [1.0, 2.0, 3.0] and chosen[:3] == [MODEL, MODEL, SUFFIX]


# ----------------------------------------------------------------------------- sampling
class FixedGuess(SuffixDrafter):
    """A suffix side whose candidate is always ``tokens`` (score = their number), on every
    second round of the generation only."""

    def __init__(self, tokens: list[int], vocab_size: int):
        super().__init__(vocab_size, len(tokens), len(tokens) + 1)
        self.tokens, self.calls = tokens, 0

    def candidate(self, state, last_token, gamma) -> Candidate:
        self.calls += 1
        return Candidate(list(self.tokens), [1.0] * len(self.tokens)) if self.calls % 2 else Candidate()


def test_sampled_sequences_follow_the_target(tiny_target):
    """Speculative sampling, 4 new tokens with top-k 2 on the two-token Markov target
    (``doubles``), drafts of one token a round: the first round a suffix guess (one-hot q on A:
    accepted or a recovered B), the next the model's (q uniform over A, B and a token the target
    never emits): 16 outcomes of known probability (chi-square)."""
    prompt, length, n = prompt_of(tiny_target), 4, 300
    target, a, _ = markov_target(tiny_target, prompt)
    sampling = SamplingParams(temperature=1.0, top_k=2)
    expected, q = expected_and_q(target, prompt, sampling, length)
    counts: Counter[tuple] = Counter()
    suffix_rounds = 0
    for seed in range(n):
        draft = HybridDrafter(FixedQDrafter(q, 1), FixedGuess([a], target.vocab_size), 0.0)
        out = SpeculativeEngine(target, draft, rule="speculative").generate(prompt, length, sampling, seed)
        counts[tuple(out.tokens)] += 1
        suffix_rounds += draft.drafted_by[SUFFIX]
    assert suffix_rounds >= n  # every generation's first round
    assert chi_square_p_value(counts, expected, n) > 1e-3


@pytest.mark.parametrize("rule", ["gumbel", "speculative"])
def test_sampled_rows_draw_what_the_batch_1_engine_draws(tiny_target, greedy_refs, rule):
    """Same seed, same tokens and acceptances in both engines; Gumbel: the target's own sample."""
    reqs = requests(tiny_target, rule=rule, sampling=SAMPLED)
    for i, r in enumerate(reqs):
        r.seed = 40 + i
    refs = full([r.prompt_ids for r in reqs], greedy_refs)  # right under greedy only: a guess here
    single = SpeculativeEngine(tiny_target, hybrid(tiny_target, refs), rule=rule)
    expected = [single.generate(r.prompt_ids, r.max_new_tokens, SAMPLED, r.seed) for r in reqs]
    if rule == "gumbel":
        assert [o.tokens for o in expected] == [
            target_only_generate(tiny_target, r.prompt_ids, r.max_new_tokens, SAMPLED, r.seed, rule="gumbel").tokens
            for r in reqs]
    got = BatchEngine(tiny_target, hybrid(tiny_target, refs), max_batch_size=4).generate(reqs)
    assert [(r.tokens, r.accepted) for r in got] == [(o.tokens, o.accepted) for o in expected]


def test_the_preview_is_the_suffix_candidates_else_the_models_latest_confidences(tiny_target):
    """Draft-then-decide: before drafting, the hybrid tells the suffix candidate's confidences
    when it will clear the threshold, else those of the trained drafter's latest round (None
    before its first), carried through consume."""
    prompt = [5, 6, 7]
    draft = hybrid(tiny_target, [prompt + list(range(30, 45))], gamma_s=6, alternate=False)
    ids = torch.tensor([prompt + [99]])
    hidden = tiny_target.forward(ids, layer_ids=draft.layer_ids).hidden
    state = draft.consume(draft.init_state(1), ids[:, :3], hidden[:, :3])
    seen_once = torch.full((1, 6), 2 / 3)  # the reference goes on: 31..36, each seen once: (1 + 1) / (1 + 2)
    assert torch.allclose(draft.preview(state, torch.tensor([[30]])), seen_once)
    assert draft.preview(state, torch.tensor([[99]])) is None  # no candidate, no model round yet
    prop = draft.propose(state, torch.tensor([99]))
    assert draft.drafted_by == Counter({MODEL: 1}) and prop.confidences is not None
    after = draft.consume(state, ids[:, 3:], hidden[:, 3:])
    assert torch.equal(draft.preview(after, torch.tensor([[98]])), prop.confidences)
