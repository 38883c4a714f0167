"""Suffix decoding: the trees against brute force over the token lists they hold (counts, next
tokens, longest match, the greedy draft, eviction), the drafter's choice between the request's
tree and the global one, its empty proposals, and the engines with it: the target's own output,
greedy and sampled, in the batch-1 and the batch engine.

Random cases use small vocabularies and short sequences so that repeats (the lazily stored
nodes' splits) are everywhere; nothing here rests on what the fixture target learned."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch

from components.config import EvalConfig
from components.engine import BatchEngine, SpeculativeEngine, SuffixDrafter, target_only_generate
from components.engine.batch import Request
from components.engine.suffix import (
    REQUEST,
    ResponseCache,
    SuffixTree,
    conditionals,
    speculate,
    suffix_drafter,
)
from components.spec.sampling import SamplingParams
from tests.components.engine.batch.test_continuous import requests
from tests.components.engine.test_engine_zero_draft import SAMPLED, successor_target


# ----------------------------------------------------------------------------- brute force
def brute_counts(seqs: list[list[int]], depth: int) -> Counter:
    """Every string of ≤ ``depth`` tokens → its occurrences in ``seqs``."""
    counts: Counter = Counter()
    for s in seqs:
        for i in range(len(s)):
            for n in range(1, min(depth, len(s) - i) + 1):
                counts[tuple(s[i:i + n])] += 1
    return counts


def brute_next(seqs: list[list[int]], x: list[int], depth: int) -> Counter:
    """Next token → how many occurrences of ``x`` it follows (none once ``x`` is ``depth`` long)."""
    if len(x) >= depth:
        return Counter()
    return Counter(s[i + len(x)] for s in seqs for i in range(len(s) - len(x)) if s[i:i + len(x)] == x)


def brute_match(seqs, context, max_match, depth) -> int:
    """The longest suffix of ``context`` (≤ max_match, < depth) that was followed by a token."""
    top = min(max_match, len(context), depth - 1)
    return max((n for n in range(1, top + 1) if brute_next(seqs, context[len(context) - n:], depth)), default=0)


def brute_walk(seqs, context, max_match, gamma, factor, min_prob, depth) -> tuple[list[int], list[float], int, list[int]]:
    """(tokens, probabilities, match length, occurrences each token was read over) as the module
    docstring defines them: the greedy walk from the longest match, matched again on context +
    draft where it runs out."""
    first = m = brute_match(seqs, context, max_match, depth)
    limit = min(gamma, int(factor * m + 1e-6))
    tokens, probs, totals, prob = [], [], [], 1.0
    while m and len(tokens) < limit:
        x = (context + tokens)[len(context) + len(tokens) - m:]
        while len(tokens) < limit and (nxt := brute_next(seqs, x, depth)):
            best = min(nxt, key=lambda t: (-nxt[t], t))
            prob *= nxt[best] / sum(nxt.values())
            if prob < min_prob:
                return tokens, probs, first, totals
            tokens, probs, x, totals = tokens + [best], probs + [prob], x + [best], totals + [sum(nxt.values())]
        m = brute_match(seqs, context + tokens, max_match, depth)
    return tokens, probs, first, totals


def brute_speculate(seqs, context, max_match, gamma, factor, min_prob, depth) -> tuple[list[int], list[float], int]:
    """``brute_walk``'s (tokens, probabilities, match length)."""
    return brute_walk(seqs, context, max_match, gamma, factor, min_prob, depth)[:3]


def random_seq(rng: random.Random, vocab: int, longest: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(rng.randint(0, longest))]


def grown(tree: SuffixTree, seq_id: int, seq: list[int], rng: random.Random) -> None:
    """Appends ``seq`` to ``tree`` in random pieces (the engine commits 1..γ+1 tokens a round)."""
    i = 0
    while i < len(seq):
        j = i + rng.randint(1, 5)
        tree.extend(seq_id, seq[i:j])
        i = j


def assert_exact(tree: SuffixTree, seqs: list[list[int]]) -> None:
    counts = brute_counts(seqs, tree.max_depth)
    assert tree.root.count == sum(map(len, seqs))
    for x, n in counts.items():
        assert tree.count(x) == n, x
        assert tree.next_counts(tree.find(x)) == brute_next(seqs, list(x), tree.max_depth), x
        assert tree.goes_on(tree.find(x)) == bool(brute_next(seqs, list(x), tree.max_depth)), x
    absent = [(v,) for v in range(6) if (v,) not in counts] + [x + (9,) for x in list(counts)[:5]]
    assert all(tree.find(x) is None and tree.count(x) == 0 for x in absent)


# ----------------------------------------------------------------------------- the tree
@pytest.mark.parametrize("seed", range(4))
def test_counts_and_next_tokens_are_the_brute_forces(seed):
    rng = random.Random(seed)
    for _ in range(40):
        tree, seqs = SuffixTree(rng.randint(1, 7)), []
        for k in range(rng.randint(1, 4)):
            seqs.append(random_seq(rng, rng.randint(1, 4), 30))
            grown(tree, k, seqs[-1], rng)
            tree.close(k)
        assert_exact(tree, seqs)


def test_counts_stay_exact_when_several_sequences_grow_and_one_is_removed():
    rng = random.Random(7)
    for _ in range(60):
        tree, seqs = SuffixTree(rng.randint(1, 6)), {0: [], 1: [], 2: []}
        for _ in range(50):
            k = rng.randrange(3)
            if k in seqs:
                seqs[k].append(rng.randrange(3))
                tree.extend(k, seqs[k][-1:])
            if 2 in seqs and seqs[2] and rng.random() < 0.05:
                tree.remove(2)
                del seqs[2]
        assert_exact(tree, list(seqs.values()))


def test_a_closed_sequence_does_not_grow():
    tree = SuffixTree(4)
    tree.extend(0, [1, 2])
    tree.close(0)
    with pytest.raises(ValueError, match="closed"):
        tree.extend(0, [3])


@pytest.mark.parametrize("seed", range(3))
def test_longest_match_and_draft_are_the_brute_forces(seed):
    rng = random.Random(100 + seed)
    for _ in range(60):
        depth, vocab = rng.randint(2, 8), rng.randint(1, 4)
        seqs = [random_seq(rng, vocab, 25) for _ in range(rng.randint(1, 3))]
        tree = SuffixTree(depth)
        for k, s in enumerate(seqs):
            tree.extend(k, s)
            tree.close(k)
        for _ in range(10):
            context = random_seq(rng, vocab + 1, 12) or [0]  # vocab + 1: sometimes a token never seen
            args = (rng.randint(1, depth), rng.randint(1, 6), rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 0.1, 0.4]))
            got = speculate(tree, context, *args)
            assert (got.tokens, got.probs, got.match_len, got.totals) == brute_walk(seqs, context, *args, depth)


def test_the_draft_grows_with_the_match():
    """max_spec_factor 1: a match of m tokens drafts at most m (here every continuation is unique)."""
    tree = SuffixTree(16)
    tree.extend(0, [5, 1, 2, 3, 4, 6, 7, 8])
    assert speculate(tree, [9, 1], 15, 8, 1.0, 0.1).tokens == [2]  # "1": one token
    assert speculate(tree, [5, 1, 2], 15, 8, 1.0, 0.1).tokens == [3, 4, 6]  # "5 1 2": three
    assert speculate(tree, [5, 1, 2], 15, 2, 1.0, 0.1).tokens == [3, 4]  # at most γ
    assert speculate(tree, [9, 9], 15, 8, 1.0, 0.1).match_len == 0  # never seen: no candidate


def test_a_loop_is_continued_past_one_period():
    """Where the match's earlier occurrence runs into the end, context + draft is matched again."""
    tree = SuffixTree(16)
    tree.extend(0, [5, 7, 7, 7])
    assert speculate(tree, [5, 7, 7, 7, 7], 10, 8, 1.0, 0.1).tokens == [7, 7]  # "7 7": two tokens
    assert speculate(tree, [5, 7, 7, 7, 7], 10, 8, 3.0, 0.1).tokens == [7] * 6
    tree = SuffixTree(16)
    tree.extend(0, [1, 2, 3, 1, 2, 3])
    assert speculate(tree, [1, 2, 3, 1, 2, 3, 1], 10, 8, 1.0, 0.1).tokens == [2, 3, 1, 2]  # "1 2 3 1"


def test_the_draft_stops_where_the_estimated_probability_falls_below_the_minimum():
    tree = SuffixTree(8)
    tree.extend(0, [1, 2, 3, 1, 2, 4, 1, 2, 3, 9])  # after "1 2": 3 twice, 4 once
    got = speculate(tree, [0, 1, 2], 7, 5, 2.0, 0.5)
    assert got.tokens[:1] == [3] and got.probs[0] == pytest.approx(2 / 3)
    assert speculate(tree, [0, 1, 2], 7, 5, 2.0, 0.7).tokens == []


# ----------------------------------------------------------------------------- the global tree
@pytest.mark.parametrize("max_responses, max_tokens", [(3, 1000), (100, 40), (2, 25)])
def test_eviction_keeps_counts_those_of_the_kept_responses(max_responses, max_tokens):
    rng = random.Random(max_tokens)
    cache, kept = ResponseCache(5, max_responses, max_tokens), []  # kept: brute-force FIFO
    for i in range(30):
        response = random_seq(rng, 3, 30)[:max_tokens]
        key = rng.choice([None, "a", "b"])
        cache.add(response, key)
        kept = [(k, r) for k, r in kept if key is None or k != key]
        if response:
            kept.append((key, response))
        while len(kept) > max_responses or sum(len(r) for _, r in kept) > max_tokens:
            kept.pop(0)
        assert [cache.tree.seqs[s] for s in cache.kept.values()] == [r for _, r in kept]
        assert cache.tokens == sum(len(r) for _, r in kept)
        assert_exact(cache.tree, [r for _, r in kept])
    for key in list(cache.kept):
        cache.forget(key)
    assert cache.tree.root.children == {} and cache.tree.root.count == 0 and cache.tokens == 0


def test_no_global_tree_when_no_response_is_kept():
    cache = ResponseCache(8, 0, 100)
    cache.add([1, 2, 3])
    assert not cache.kept and cache.tree.root.count == 0


# ----------------------------------------------------------------------------- the drafter
def _state(drafter: SuffixDrafter, committed: list[int]):
    return drafter.consume(drafter.init_state(1), torch.tensor([committed]), None)


def test_proposes_nothing_without_a_match():
    drafter = SuffixDrafter(50, 4, 8)
    empty = drafter.propose(_state(drafter, [7, 8, 9]), torch.tensor([10]))
    assert empty.tokens.shape == (1, 0) and empty.logits.shape == empty.probs.shape == (1, 0, 50)
    found = drafter.propose(_state(drafter, [1, 2, 3, 9]), torch.tensor([1]))  # "1" was followed by 2
    assert found.tokens.tolist() == [[2]] and found.probs[0, 0, 2] == 1.0
    picky = SuffixDrafter(50, 4, 8, min_score=1.5)  # a one-token draft scores at most 1
    assert picky.propose(_state(picky, [1, 2, 3, 9]), torch.tensor([1])).tokens.shape == (1, 0)


@pytest.mark.parametrize("seed", range(3))
def test_the_request_or_the_global_candidate_whichever_scores_higher(seed):
    """propose = the brute force over both trees: the global candidate only when it scores higher."""
    rng = random.Random(seed)
    for _ in range(40):
        depth, gamma = rng.randint(3, 9), rng.randint(1, 2)
        drafter = SuffixDrafter(6, gamma, depth, rng.choice([1.0, 2.0]), rng.choice([0.0, 0.3]), max_cached_responses=2)
        responses = [random_seq(rng, 3, 20) for _ in range(rng.randint(0, 3))]
        for r in responses:
            drafter.observe(r)
        kept = [r for r in responses if r][-2:]
        committed, last = random_seq(rng, 3, 20) + [0], rng.randrange(4)
        context = committed[max(0, len(committed) - drafter.max_match + 1):] + [last]
        args = (drafter.max_match, gamma, drafter.max_spec_factor, drafter.min_token_prob, depth)
        own, shared = brute_speculate([committed], context, *args), brute_speculate(kept, context, *args)
        want = shared[0] if sum(shared[1]) > sum(own[1]) else own[0]
        assert drafter.propose(_state(drafter, committed), torch.tensor([last])).tokens[0].tolist() == want


def test_rolled_back_and_stale_states_read_their_own_ids():
    drafter = SuffixDrafter(20, 3, 8)

    def drafts(state, last):
        return drafter.propose(state, torch.tensor([last])).tokens[0].tolist()

    old = _state(drafter, [1, 2, 3, 4])
    new = drafter.consume(old, torch.tensor([[1, 2, 5, 6]]), None)  # shares old's tree, which grows
    assert drafts(new, 1) == [2]  # "1": 2 twice, then 3 or 5 once each
    assert drafts(old, 4) == [] and drafts(old, 1) == [2]  # old reads [1, 2, 3, 4] only
    branch = drafter.consume(old, torch.tensor([[9, 1, 2]]), None)  # from the older state: rebuilt
    assert branch.tokens == [1, 2, 3, 4, 9, 1, 2] and new.tokens == [1, 2, 3, 4, 1, 2, 5, 6]
    assert drafts(branch, 3) == [4, 9, 1] and drafts(new, 5) == [6]
    back = drafter.rollback(new, 4)
    assert back.tokens == [1, 2, 3, 4] and drafts(back, 1) == drafts(_state(drafter, [1, 2, 3, 4]), 1)


def test_a_prompt_run_again_is_not_drafted_from_its_own_earlier_answer():
    drafter = SuffixDrafter(50, 4, 8)
    drafter.observe([30, 31, 32, 33], key="p")
    state = _state(drafter, [1, 2])
    assert drafter.propose(state, torch.tensor([30])).tokens.tolist() == [[31]]
    drafter.forget("p")
    assert drafter.propose(state, torch.tensor([30])).tokens.shape == (1, 0)
    drafter.observe([30, 31], key="q")
    drafter.observe([30, 40], key="q")  # replaces q's earlier answer
    assert drafter.propose(state, torch.tensor([30])).tokens.tolist() == [[40]]


def test_rollouts_start_the_global_tree_and_are_the_first_to_go():
    """``suffix_drafter(responses=...)``: rollouts are kept as the oldest responses, so a
    continuation seen only in them is drafted, and requests' responses evict them first."""
    drafter = suffix_drafter(EvalConfig(suffix_num_speculative_tokens=4, suffix_max_tree_depth=8,
                                        suffix_max_cached_responses=2), 50, responses=[[30, 31, 32], [40, 41]])
    state = _state(drafter, [1, 2])
    assert drafter.propose(state, torch.tensor([30])).tokens.tolist() == [[31]]
    drafter.observe([5, 6], key="request")  # a third response: the oldest rollout goes
    assert drafter.propose(state, torch.tensor([30])).tokens.shape == (1, 0)
    assert drafter.propose(state, torch.tensor([40])).tokens.tolist() == [[41]]


def test_settings_out_of_range_are_refused():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SuffixDrafter(50, 16, 16)
    with pytest.raises(ValueError, match="min_token_prob"):
        SuffixDrafter(50, 4, 16, min_token_prob=1.5)
    with pytest.raises(ValueError, match="batch"):
        SuffixDrafter(50).init_state(2)


# ----------------------------------------------------------------------------- the engines
def test_drafts_from_an_earlier_response_lengthen_with_the_match(tiny_target):
    """The successor target (next = input + 1) makes the output known; with that output learned
    from an earlier run, each round's match grows by the round's tokens (1, then 1 + 1 + 1, ...)
    and every draft is accepted, up to γ; the batch engine drafts the same."""
    target, prompt, n = successor_target(tiny_target), list(range(10, 20)), 20
    ref = target_only_generate(target, prompt, n).tokens
    drafter = SuffixDrafter(target.vocab_size, 4, 12)
    drafter.observe(ref)
    out = SpeculativeEngine(target, drafter).generate(prompt, n)
    assert out.tokens == ref and out.accepted == out.drafted
    assert out.drafted[:4] == [1, 3, 4, 4]
    batch = BatchEngine(target, drafter, max_batch_size=2).generate([Request(prompt, n)])[0]
    assert batch.tokens == ref and batch.drafted == out.drafted and batch.accepted == out.accepted


def test_without_any_match_every_round_is_a_plain_step(tiny_target):
    target, prompt, n = successor_target(tiny_target), list(range(10, 20)), 12
    out = SpeculativeEngine(target, SuffixDrafter(target.vocab_size, 4, 12)).generate(prompt, n)
    assert out.tokens == list(range(20, 32)) and out.accepted == [] and out.rounds == n - 1


def test_greedy_is_the_targets_output_in_both_engines(tiny_target, greedy_refs):
    """Real prompts, responses of other requests in the global tree: token for token the target's."""
    reqs = requests(tiny_target)
    drafter = SuffixDrafter(tiny_target.vocab_size, 4, 16)
    for other in greedy_refs[::2]:
        drafter.observe(other)
    single = SpeculativeEngine(tiny_target, drafter)
    outs = [single.generate(r.prompt_ids, r.max_new_tokens) for r in reqs]
    assert [o.tokens for o in outs] == greedy_refs
    assert all(o.target_forwards == o.rounds + 1 for o in outs)
    assert [r.tokens for r in BatchEngine(tiny_target, drafter, max_batch_size=4).generate(reqs)] == greedy_refs


@pytest.mark.parametrize("rule", ["gumbel", "speculative"])
def test_sampled_rows_draw_what_the_batch_1_engine_draws(tiny_target, rule):
    """One-hot q under a sampling rule: Gumbel gives the target's own Gumbel-max sample; the
    batch engine draws, per request seed, what the batch-1 engine draws."""
    reqs = requests(tiny_target, rule=rule, sampling=SAMPLED)
    for i, r in enumerate(reqs):
        r.seed = 40 + i
    drafter = SuffixDrafter(tiny_target.vocab_size, 4, 16, max_cached_responses=0)  # the batch engine teaches it
    single = SpeculativeEngine(tiny_target, drafter, rule=rule)
    expected = [single.generate(r.prompt_ids, r.max_new_tokens, SAMPLED, r.seed) for r in reqs]
    if rule == "gumbel":
        assert [o.tokens for o in expected] == [
            target_only_generate(tiny_target, r.prompt_ids, r.max_new_tokens, SAMPLED, r.seed, rule="gumbel").tokens
            for r in reqs]
    got = BatchEngine(tiny_target, drafter, max_batch_size=4).generate(reqs)
    assert [r.tokens for r in got] == [o.tokens for o in expected]
    assert [r.accepted for r in got] == [o.accepted for o in expected]


def test_one_hot_q_under_sampling():
    drafter = SuffixDrafter(12, 4, 8)
    prop = drafter.propose(_state(drafter, [1, 2, 3, 1, 2, 3]), torch.tensor([1]), SamplingParams(temperature=0.7))
    assert prop.tokens.tolist() == [[2, 3, 1, 2]]  # "1 2 3 1" went on with 2, 3; the loop goes on
    assert torch.equal(prop.probs[0], torch.nn.functional.one_hot(torch.tensor([2, 3, 1, 2]), 12).float())


def test_confidences_are_each_drafts_estimated_probability_given_the_drafts_before_it():
    drafter = SuffixDrafter(20, 4, 8, min_token_prob=0.0)
    # the longest match "0 5 6" went on with 7 once and 8 once (1/2: the smaller id, 7); "0 5 6 7"
    # occurred once, so its continuation (9, 11) keeps that probability: ratios 1/2, 1, 1; before
    # any evidence each is smoothed by its occurrences, (c + 1) / (n + 2): 2/4, 2/3, 2/3
    state = _state(drafter, [5, 6, 7, 9, 10, 0, 5, 6, 7, 9, 11, 0, 5, 6, 8, 0, 5])
    prop = drafter.propose(state, torch.tensor([6]))
    assert prop.tokens.tolist() == [[7, 9, 11]]
    assert torch.allclose(prop.confidences, torch.tensor([[1 / 2, 2 / 3, 2 / 3]]))
    best = drafter.candidate(state, torch.tensor([6]), 4)
    assert torch.allclose(torch.tensor(conditionals(best.probs)), torch.tensor([1 / 2, 1.0, 1.0]))
    assert best.totals == [2, 1, 1]
    assert drafter.propose(_state(drafter, [1, 2]), torch.tensor([3])).confidences is None  # nothing proposed


# ----------------------------------------------------------------------------- draft-then-decide
@pytest.mark.parametrize("seed", range(3))
def test_the_preview_is_what_propose_gives_once_the_deferred_ids_are_consumed(seed):
    """Over ids committed but not consumed yet (a plain round's deferral) and the last token:
    the confidences of the very draft ``propose`` makes after consuming them; the request's tree
    run ahead for it is then reused, not rebuilt, and stays exact."""
    rng = random.Random(seed)
    for _ in range(30):
        drafter = SuffixDrafter(5, rng.randint(1, 4), 10, min_token_prob=rng.choice([0.0, 0.3]))
        for _ in range(rng.randint(0, 2)):
            drafter.observe(random_seq(rng, 4, 15))
        state = _state(drafter, random_seq(rng, 4, 12) + [0])
        deferred = random_seq(rng, 4, 6)
        last = rng.randrange(4)
        preview = drafter.preview(state, torch.tensor([deferred + [last]]))
        tree = state.tree
        after = drafter.consume(state, torch.tensor([deferred]), None) if deferred else state
        prop = drafter.propose(after, torch.tensor([last]))
        assert after.tree is tree and tree.seqs[REQUEST] == after.tokens
        assert preview.shape == (1, prop.tokens.shape[1])
        if prop.confidences is not None:
            assert torch.equal(preview, prop.confidences)
        assert_exact(tree, [after.tokens])


@pytest.mark.parametrize("seed", range(3))
def test_propose_after_a_preview_drafts_what_it_drafts_without_one(seed):
    """``propose`` reuses the candidate its preview read where that is the one it would read
    itself (the same ids, last token and trees, γ from the draft's length up to the preview's),
    else reads again: at every γ, and after a response observed in between, the draft and its
    confidences equal a twin drafter's that never previewed."""
    rng = random.Random(seed)
    for _ in range(30):
        gamma, prob = rng.randint(1, 4), rng.choice([0.0, 0.3])
        pair = [SuffixDrafter(5, gamma, 10, min_token_prob=prob) for _ in range(2)]
        history = [random_seq(rng, 4, 15) for _ in range(rng.randint(0, 2))]
        ids, deferred, last = random_seq(rng, 4, 12) + [0], random_seq(rng, 4, 6), rng.randrange(4)
        ask, late = rng.randint(1, gamma), random_seq(rng, 4, 8) if rng.random() < 0.3 else None
        props = []
        for previews, drafter in zip((True, False), pair):
            for seq in history:
                drafter.observe(seq)
            state = _state(drafter, ids)
            if previews:
                drafter.preview(state, torch.tensor([deferred + [last]]))
            after = drafter.consume(state, torch.tensor([deferred]), None) if deferred else state
            if late is not None:
                drafter.observe(late)
            props.append(drafter.propose(after, torch.tensor([last]), num_speculative_tokens=ask))
        assert torch.equal(props[0].tokens, props[1].tokens)
        assert (props[0].confidences is None) == (props[1].confidences is None)
        if props[0].confidences is not None:
            assert torch.equal(props[0].confidences, props[1].confidences)


class CountingSuffix(SuffixDrafter):
    """Suffix decoding counting its ``propose`` calls and the previews that promised no draft."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.proposed = self.empty_previews = 0

    def propose(self, *args, **kwargs):
        self.proposed += 1
        return super().propose(*args, **kwargs)

    def preview(self, state, recent):
        conf = super().preview(state, recent)
        self.empty_previews += conf.shape[1] == 0
        return conf


class SurvivalCap:
    """A draft-length policy (the policy's interface) that records each round's survival
    estimate and drafts exactly as far as it is non-zero."""

    adapts, calibrate, row_lengths = True, False, None

    def __init__(self):
        self.seen: list[np.ndarray] = []

    def empirical_survival(self, max_cap: int) -> np.ndarray:  # → [max_cap] float64
        return np.full(max_cap, 0.5)

    def cap(self, survival, max_cap: int, remaining=None) -> int:  # survival [1, max_cap]
        self.seen.append(survival[0].copy())
        return int((survival[0] > 0).sum())

    def observe(self, *args, **kwargs) -> None:
        pass


def test_the_batch_engine_prices_each_round_on_its_own_match(tiny_target, greedy_refs):
    """The batch engine asks the preview before the cap: each round's survival is its own
    draft's (zero past its length), a round the preview finds no match for is plain without a
    proposal and without asking the cap, and the output is the target's own."""
    reqs = requests(tiny_target)[:3]
    drafter = CountingSuffix(tiny_target.vocab_size, 4, 16, max_cached_responses=0)  # each request's own tree
    policy = SurvivalCap()
    results = BatchEngine(tiny_target, drafter, max_batch_size=1, draft_length=policy).generate(reqs)
    assert [r.tokens for r in results] == greedy_refs[:3]
    drafting = [s for s in policy.seen if s[0] > 0]
    assert drafter.empty_previews > 0 and len(policy.seen) == len(drafting)
    assert drafter.proposed == len(drafting) == sum(len(r.accepted) for r in results) > 0
    for s in drafting:  # a draft's survival: non-increasing, then zeros
        n = int((s > 0).sum())
        assert np.all(s[:n] > 0) and np.all(s[n:] == 0) and np.all(s[1:n] <= s[:n - 1])
