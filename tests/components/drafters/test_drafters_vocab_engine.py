"""Engines with a reduced draft vocabulary stay lossless: greedy output equals the target's own
token for token (float32, batch-1, batch, trees, DLoop), including continuations that need a token
the drafter can never propose (it comes out as the target's recovered/bonus token), and Gumbel
output equals the target's own Gumbel sample with the same noise.

The vocabularies are built from the target's own reference continuations with one needed token
left out on purpose, and a "bigram" DSpark (its Markov head set to replay the reference's
next-token pairs) makes acceptance non-vacuous; nothing depends on what the fixture's training
produced on this CPU beyond the references computed here."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from components.config import DrafterConfig
from components.drafters import build_drafter
from components.drafters.registry import target_special_ids
from components.engine import SpeculativeEngine, TreeEngine, target_only_generate
from components.engine.batch import BatchEngine, Request
from components.spec.sampling import SamplingParams

TEXTS = ["def main(args):\n    ", "import os\nimport sys\n", "class Foo:\n    def __init__(self"]
MAX_NEW = 24
DV = 48
SAMPLING = SamplingParams(temperature=1.0)


def prompts(target) -> list[list[int]]:
    return [target.tokenizer(t)["input_ids"] for t in TEXTS]


@pytest.fixture(scope="module")
def refs(tiny_target) -> list[list[int]]:
    return [target_only_generate(tiny_target, p, MAX_NEW).tokens for p in prompts(tiny_target)]


def left_out(target, continuations: list[list[int]]) -> int:
    """The token kept out of the vocabulary: the rarest non-special one (ties: smallest id) that a
    continuation needs after its first token (which the prefill, not a round, produces)."""
    specials = set(target_special_ids(target))
    seen = Counter(t for c in continuations for t in c[1:] if t not in specials)
    return min(seen, key=lambda t: (seen[t], t))


def vocab_counts(target, continuations: list[list[int]], missing: int) -> torch.Tensor:
    """Counts [V] that put the continuations' tokens first and ``missing`` last."""
    counts = torch.zeros(target.vocab_size, dtype=torch.float64)
    for c in continuations:
        for t in c:
            counts[t] += 1
    counts[missing] = -1.0
    return counts


def reduced(target, name: str, counts: torch.Tensor, **cfg):
    torch.manual_seed(0)
    return build_drafter(DrafterConfig(name=name, num_layers=1, draft_vocab_size=DV, **cfg), target, counts).eval()


@torch.no_grad()
def bigram_dspark(target, sequences: list[list[int]], counts: torch.Tensor):
    """A DSpark whose drafts follow the sequences' next-token pairs (inside its vocabulary): zero
    base head, Markov bias W2(W1[prev]) = 30 at the recorded successor's draft id."""
    d = reduced(target, "dspark", counts, markov_rank=64)
    d.vocab.head.weight.zero_()
    w1, w2 = d.markov_head.markov_w1.weight, d.markov_head.markov_w2.weight
    w1.zero_()
    w2.zero_()
    draft_of, slot = d.vocab.draft_of(), {}
    for seq in sequences:
        for prev, nxt in itertools.pairwise(seq):
            if prev in slot or draft_of[nxt] < 0 or len(slot) == w1.shape[1]:
                continue
            slot[prev] = len(slot)
            w1[prev, slot[prev]] = 1.0
            w2[draft_of[nxt], slot[prev]] = 30.0
    return d


def spread(spy) -> list:
    """The proposals over a draft vocabulary whose logits or probs were spread into V."""
    from components.drafters.vocab import VocabProposal

    return [p for p in spy.props if isinstance(p, VocabProposal) and (p._logits is not None or p._probs is not None)]


class Spy:
    """Records every token a drafter proposes (batch-1 and batched)."""

    def __init__(self, drafter):
        self.proposed: set[int] = set()
        self.props: list = []  # every proposal, as the drafter returned it
        for method in ("propose", "propose_many"):
            setattr(drafter, method, self.wrap(getattr(drafter, method)))

    def wrap(self, fn):
        def spied(*args, **kwargs):
            out = fn(*args, **kwargs)
            for prop in out if isinstance(out, list) else [out]:
                self.proposed |= set(prop.tokens.flatten().tolist())
                self.props.append(prop)
            return out
        return spied


def drafters(target, refs):
    missing = left_out(target, refs)
    counts = vocab_counts(target, refs, missing)
    seqs = [p + r for p, r in zip(prompts(target), refs)]
    return missing, {"dspark-bigram": bigram_dspark(target, seqs, counts),
                     "eagle3": reduced(target, "eagle3", counts)}


def test_the_setup_needs_a_token_outside_the_vocabulary(tiny_target, refs):
    missing, ds = drafters(tiny_target, refs)
    for d in ds.values():
        assert not bool(d.vocab.t2d[missing]) and d.vocab.t2d[[t for r in refs for t in r if t != missing]].all()
    assert any(missing in r[1:] for r in refs)


@pytest.mark.parametrize("name", ["dspark-bigram", "eagle3"])
def test_greedy_batch1_is_lossless_and_recovers_what_the_drafter_cannot_propose(tiny_target, refs, name):
    missing, ds = drafters(tiny_target, refs)
    spy, accepted = Spy(ds[name]), 0
    engine = SpeculativeEngine(tiny_target, ds[name], rule="greedy")
    for prompt, ref in zip(prompts(tiny_target), refs):
        out = engine.generate(prompt, MAX_NEW)
        assert out.tokens == ref
        accepted += sum(out.accepted)
    assert missing not in spy.proposed and spy.proposed  # never proposed, yet it came out (after the prefill)
    assert not spread(spy)  # greedy verification compares tokens: q over V is never built
    if name == "dspark-bigram":
        assert accepted >= MAX_NEW  # drafts from the draft vocabulary were accepted


@pytest.mark.parametrize("name", ["dspark-bigram", "eagle3"])
@pytest.mark.parametrize("max_batch", [2, 8])
def test_greedy_batch_engine_is_lossless(tiny_target, refs, name, max_batch):
    missing, ds = drafters(tiny_target, refs)
    spy = Spy(ds[name])
    engine = BatchEngine(tiny_target, ds[name], max_batch_size=max_batch)
    results = engine.generate([Request(p, MAX_NEW) for p in prompts(tiny_target)])
    assert [r.tokens for r in results] == refs
    assert missing not in spy.proposed and spy.proposed
    assert not spread(spy)
    if name == "dspark-bigram":
        assert sum(sum(r.accepted) for r in results) >= MAX_NEW


@pytest.mark.parametrize("builder", ["ddtree", "causal"])
def test_token_trees_and_dloop_are_lossless(tiny_target, refs, builder):
    _, ds = drafters(tiny_target, refs)
    d = ds["dspark-bigram"]
    tree = TreeEngine(tiny_target, d, "greedy", budget=8, builder=builder)
    dloop = SpeculativeEngine(tiny_target, d, rule="greedy", loop_stages=2, loop_gate=-50.0)
    for prompt, ref in zip(prompts(tiny_target), refs):
        assert tree.generate(prompt, MAX_NEW).tokens == ref
        assert dloop.generate(prompt, MAX_NEW).tokens == ref


@pytest.mark.parametrize("seed", [0, 5])
def test_gumbel_output_is_the_targets_own_sample(tiny_target, seed):
    ps = prompts(tiny_target)
    sampled = [target_only_generate(tiny_target, p, MAX_NEW, SAMPLING, seed + i, rule="gumbel").tokens
               for i, p in enumerate(ps)]
    missing = left_out(tiny_target, sampled)
    counts = vocab_counts(tiny_target, sampled, missing)
    ds = [bigram_dspark(tiny_target, [p + s for p, s in zip(ps, sampled)], counts),
          reduced(tiny_target, "eagle3", counts)]
    for d in ds:
        single = SpeculativeEngine(tiny_target, d, rule="gumbel")
        assert [single.generate(p, MAX_NEW, SAMPLING, seed + i).tokens for i, p in enumerate(ps)] == sampled
        reqs = [Request(p, MAX_NEW, sampling=SAMPLING, seed=seed + i, rule="gumbel") for i, p in enumerate(ps)]
        assert [r.tokens for r in BatchEngine(tiny_target, d, max_batch_size=4).generate(reqs)] == sampled
    assert any(missing in s[1:] for s in sampled)


def test_speculative_rule_batch_matches_batch1(tiny_target, refs):
    """Per-request randomness with q over V (zero outside the draft vocabulary): same seed, same tokens."""
    _, ds = drafters(tiny_target, refs)
    d = ds["eagle3"]
    single = SpeculativeEngine(tiny_target, d, rule="speculative")
    ps = prompts(tiny_target)
    expected = [single.generate(p, MAX_NEW, SAMPLING, 3 + i).tokens for i, p in enumerate(ps)]
    reqs = [Request(p, MAX_NEW, sampling=SAMPLING, seed=3 + i, rule="speculative") for i, p in enumerate(ps)]
    assert [r.tokens for r in BatchEngine(tiny_target, d, max_batch_size=4).generate(reqs)] == expected
