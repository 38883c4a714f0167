"""Token trees in the engine are lossless: greedy and Gumbel output equal the target's own token
for token (float32) for every drafter and budget; sampled sequences follow the target's exact
distribution (chi-square); accepted paths are kept in the cache without recomputation."""

from __future__ import annotations

import pytest

from components.drafters.capabilities import CapabilityError
from components.engine import OracleDrafter, TargetDrafter, target_only_generate
from components.engine.tree import TreeEngine
from components.spec.sampling import SamplingParams
from tests.components.engine.doubles import SecondGuessDrafter, markov_target
from tests.components.engine.test_engine_greedy import MAX_NEW, prompts, random_drafter
from tests.components.engine.test_engine_sampling import (
    FixedQDrafter,
    chi_square_p_value,
    expected_and_q,
    prompt_of,
)


@pytest.mark.parametrize("name", ["dspark", "dflash", "eagle3"])
@pytest.mark.parametrize("budget", [1, 24])
def test_tree_greedy_lossless(tiny_target, references, name, budget):
    engine = TreeEngine(tiny_target, random_drafter(tiny_target, name), budget=budget)
    for prompt, ref in zip(prompts(tiny_target), references):
        out = engine.generate(prompt, MAX_NEW)
        assert out.tokens == ref
        assert out.target_forwards == out.rounds + 1
        assert max(out.drafted) <= budget


def test_tree_holding_the_target_path_accepts_its_full_depth(tiny_target):
    """An oracle's one-hot slots make the tree the target's own greedy chain: every round
    accepts γ, and the kept cache slots carry the next rounds correctly."""
    gamma = 4
    max_new = 1 + 3 * (gamma + 1)
    for prompt in prompts(tiny_target):
        ref = target_only_generate(tiny_target, prompt, max_new).tokens
        drafter = OracleDrafter(prompt + ref, tiny_target.vocab_size, gamma)
        out = TreeEngine(tiny_target, drafter, budget=10).generate(prompt, max_new)
        assert out.tokens == ref
        assert out.accepted == [gamma] * 3 and out.drafted == [gamma] * 3


def test_wider_trees_accept_more(tiny_target):
    """Every slot's favourite is wrong and its runner-up right (``SecondGuessDrafter``): a one-node
    tree accepts nothing, a tree of all 2 + 4 + 8 + 16 two-way paths holds the target's own and
    accepts its whole depth, whatever the fixture's weights."""
    gamma, prompt = 4, prompts(tiny_target)[0]
    max_new = 1 + 3 * (gamma + 1)  # three full rounds
    ref = target_only_generate(tiny_target, prompt, max_new).tokens
    drafter = SecondGuessDrafter([prompt + ref], tiny_target.vocab_size, gamma)
    outs = [TreeEngine(tiny_target, drafter, budget=b).generate(prompt, max_new) for b in (1, 30)]
    assert all(out.tokens == ref for out in outs)
    assert outs[0].tau == 1 and outs[1].tau == gamma + 1


@pytest.mark.parametrize("seed", [0, 3])
def test_tree_gumbel_equals_target_gumbel(tiny_target, seed):
    prompt, sampling = prompt_of(tiny_target), SamplingParams(temperature=1.0)
    ref = target_only_generate(tiny_target, prompt, 20, sampling, seed, rule="gumbel").tokens
    for drafter in (random_drafter(tiny_target, "dspark"), TargetDrafter(tiny_target, 4)):
        out = TreeEngine(tiny_target, drafter, rule="gumbel", budget=8).generate(prompt, 20, sampling, seed)
        assert out.tokens == ref


def test_tree_sampling_follows_target(tiny_target):
    """As the chain test in test_engine_sampling: 3 new tokens, top-k 2, 300 seeds, on the
    two-token Markov target; the tree is built from q (uniform over A, B and one token the
    target never emits)."""
    prompt, length, n = prompt_of(tiny_target), 3, 300
    target, _, _ = markov_target(tiny_target, prompt)
    sampling = SamplingParams(temperature=1.0, top_k=2)
    expected, q = expected_and_q(target, prompt, sampling, length)
    engine = TreeEngine(target, FixedQDrafter(q, 2), rule="speculative", budget=4)
    counts: dict[tuple, int] = {}
    accepted = 0
    for seed in range(n):
        out = engine.generate(prompt, length, sampling, seed)
        counts[tuple(out.tokens)] = counts.get(tuple(out.tokens), 0) + 1
        accepted += sum(out.accepted)
    assert accepted > 0
    assert chi_square_p_value(counts, expected, n) > 1e-3


@pytest.mark.parametrize("rule", ["greedy", "gumbel"])
def test_causal_trees_from_the_dspark_head_are_lossless(tiny_target, references, rule):
    drafter = random_drafter(tiny_target, "dspark")
    sampling = SamplingParams(temperature=1.0)
    engine = TreeEngine(tiny_target, drafter, rule=rule, budget=12, builder="causal", top_m=4)
    for prompt, ref in zip(prompts(tiny_target)[:2], references):
        if rule == "gumbel":
            ref = target_only_generate(tiny_target, prompt, MAX_NEW, sampling, 5, rule="gumbel").tokens
        assert engine.generate(prompt, MAX_NEW, sampling, 5).tokens == ref
    with pytest.raises(CapabilityError, match="builder 'causal' needs capability causal_tree_head; drafter 'dflash'"):
        TreeEngine(tiny_target, random_drafter(tiny_target, "dflash"), builder="causal")


def test_tree_engine_refuses_block_rule(tiny_target):
    with pytest.raises(ValueError, match="chains only"):
        TreeEngine(tiny_target, random_drafter(tiny_target, "dspark"), rule="block")
