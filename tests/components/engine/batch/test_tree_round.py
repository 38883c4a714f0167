"""Token trees in the batch engine: a lone greedy or Gumbel row drafts a tree, losslessly, and
the batch goes back to chains when requests join; sampled rows keep chains."""

from __future__ import annotations

import pytest

from components.engine import OracleDrafter, SpeculativeEngine, target_only_generate
from components.engine.batch import BatchEngine, Request
from components.spec.sampling import SamplingParams
from tests.components.engine.batch.test_continuous import requests
from tests.components.engine.test_engine_greedy import random_drafter


@pytest.mark.parametrize("max_batch", [1, 3])
@pytest.mark.parametrize("builder", ["ddtree", "causal"])
def test_lone_greedy_row_drafts_trees_losslessly(tiny_target, greedy_refs, max_batch, builder):
    """max_batch 1: every round after a prefill is a tree; 3: trees only once one row is left
    (requests join between, so the ragged cache goes from tree rounds back to chains)."""
    drafter = random_drafter(tiny_target, "dspark")
    budget = SpeculativeEngine(tiny_target, drafter).settings.num_speculative_tokens + 5
    engine = BatchEngine(tiny_target, drafter, max_batch_size=max_batch, tree_budget=budget, tree_builder=builder)
    got = engine.generate(requests(tiny_target))
    assert [r.tokens for r in got] == greedy_refs
    trees = [d for r in got for d in r.drafted if d == budget]  # a chain drafts at most γ < budget
    assert trees and (max_batch == 1 or len(trees) < sum(len(r.drafted) for r in got))


def test_tree_rounds_keep_the_accepted_path_in_the_cache(tiny_target):
    """An oracle's tree holds the target's own path: every tree round accepts its full depth,
    and the next rounds (trees, then chains beside a request that joins) read the kept slots."""
    prompt = requests(tiny_target)[0].prompt_ids
    ref = target_only_generate(tiny_target, prompt, 26).tokens
    engine = BatchEngine(tiny_target, OracleDrafter(prompt + ref, tiny_target.vocab_size, 4), max_batch_size=2,
                         tree_budget=9)
    engine.add(Request(prompt, 26, request_id="lone"))
    outs = [o for _ in range(2) for o in engine.step()]  # prefill + a tree round, then another
    assert sum(len(o.new_tokens) for o in outs) == 1 + 2 * 5
    other = Request(requests(tiny_target)[1].prompt_ids, 12, request_id="joins")
    engine.add(other)
    results = {}
    while engine.has_work:
        for o in engine.step():
            if o.finished:
                results[o.request_id] = o.result.tokens
    assert results["lone"] == ref
    assert results["joins"] == target_only_generate(tiny_target, other.prompt_ids, 12).tokens


def test_gumbel_trees_and_sampled_chains_keep_their_outputs(tiny_target):
    """Gumbel rows alone draft trees and still emit the target's own Gumbel sample; a sampled
    (speculative) row keeps chains, so it draws what the batch-1 chain engine draws."""
    drafter = random_drafter(tiny_target, "dspark")
    sampling = SamplingParams(temperature=0.9)
    gumbel = requests(tiny_target, rule="gumbel", sampling=sampling)[:3]
    for i, r in enumerate(gumbel):
        r.seed = 11 + i
    expected = [target_only_generate(tiny_target, r.prompt_ids, r.max_new_tokens, sampling, r.seed,
                                     rule="gumbel").tokens for r in gumbel]
    got = BatchEngine(tiny_target, drafter, max_batch_size=1, tree_budget=12).generate(gumbel)
    assert [r.tokens for r in got] == expected and any(d == 12 for r in got for d in r.drafted)
    spec = requests(tiny_target, rule="speculative", sampling=sampling)[:2]
    single = SpeculativeEngine(tiny_target, drafter, rule="speculative")
    chains = [single.generate(r.prompt_ids, r.max_new_tokens, sampling, r.seed).tokens for r in spec]
    assert [r.tokens for r in BatchEngine(tiny_target, drafter, max_batch_size=1, tree_budget=12).generate(spec)] \
        == chains


def test_trees_refuse_what_they_cannot_combine_with(tiny_target):
    drafter = random_drafter(tiny_target, "dspark")
    with pytest.raises(ValueError, match="DLoop stages or carryover"):
        BatchEngine(tiny_target, drafter, loop_stages=2, tree_budget=8)
    with pytest.raises(ValueError, match="need a drafter"):
        BatchEngine(tiny_target, None, tree_budget=8)
