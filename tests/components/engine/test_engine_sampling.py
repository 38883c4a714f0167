"""Sampled speculative decoding is lossless: Gumbel coupling reproduces the target's own
Gumbel-max sampling exactly (whatever the drafter), and speculative sampling / block
verification emit sequences distributed as the target's own (chi-square on exact probabilities).

The distributions the chi-square tests compare are built for the purpose (``doubles.MarkovTarget``:
the fixture's forward with a known next-token table), so their power and the paths they exercise
do not depend on what the fixture's training produced on this CPU."""

from __future__ import annotations

import pytest
import torch

import components.drafters  # noqa: F401  (registers every family)
from components.config import DrafterConfig
from components.drafters.base import Proposal
from components.drafters.registry import build_drafter
from components.engine import (
    SpeculativeEngine,
    TargetDrafter,
    target_only_generate,
)
from components.engine.model_free import TokenDrafter
from components.spec.sampling import SamplingParams, probs_from_logits
from tests.components.engine.doubles import markov_target


def prompt_of(target) -> list[int]:
    return target.tokenizer("def main(args):\n    ")["input_ids"]


def random_drafter(target, name: str):
    torch.manual_seed(1)
    return build_drafter(DrafterConfig(name=name, num_layers=1), target).eval()


@pytest.mark.parametrize("seed", [0, 7])
def test_gumbel_output_is_drafter_invariant(tiny_target, seed):
    prompt, sampling, max_new = prompt_of(tiny_target), SamplingParams(temperature=1.0), 20
    ref = target_only_generate(tiny_target, prompt, max_new, sampling, seed, rule="gumbel").tokens
    drafters = [random_drafter(tiny_target, "dspark"), random_drafter(tiny_target, "eagle3"),
                TargetDrafter(tiny_target, 4)]
    outs = [SpeculativeEngine(tiny_target, d, rule="gumbel").generate(prompt, max_new, sampling, seed)
            for d in drafters]
    assert all(o.tokens == ref for o in outs)
    assert sum(outs[-1].accepted) > 0  # the target drafter, coupled, gets drafts accepted


def test_gumbel_output_depends_on_the_seed(tiny_target):
    """The invariance above is not vacuous: on a target whose next token is a fair-ish coin
    (A or B, 0.3-0.75), other seeds give other sequences, and the engine still follows them."""
    markov, _, _ = markov_target(tiny_target, prompt_of(tiny_target))
    prompt, sampling = prompt_of(tiny_target), SamplingParams(temperature=1.0)
    outs = [target_only_generate(markov, prompt, 20, sampling, seed, rule="gumbel").tokens for seed in (0, 1)]
    assert outs[0] != outs[1]
    engine = SpeculativeEngine(markov, TargetDrafter(markov, 4), rule="gumbel")
    assert [engine.generate(prompt, 20, sampling, seed).tokens for seed in (0, 1)] == outs


def exact_sequence_probs(target, prompt: list[int], sampling: SamplingParams, length: int) -> dict[tuple, float]:
    """P(first ``length`` new tokens) under the target's processed distribution, for every
    sequence in its (top-k limited) support, one batched forward per length."""
    probs: dict[tuple, float] = {(): 1.0}
    for _ in range(length):
        prefixes = list(probs)
        ids = torch.tensor([prompt + list(p) for p in prefixes])
        dist = probs_from_logits(target.forward(ids).logits[:, -1].double(), sampling)  # [N, V]
        nxt = {}
        for row, prefix in enumerate(prefixes):
            for tok in dist[row].nonzero().flatten().tolist():
                nxt[prefix + (tok,)] = probs[prefix] * float(dist[row, tok])
        probs = nxt
    return probs


def chi_square_p_value(counts: dict[tuple, int], expected: dict[tuple, float], n: int) -> float:
    """p-value of Pearson's chi-square; outcomes outside the support fail outright."""
    assert set(counts) <= set(expected), "emitted a sequence the target cannot produce"
    keys = sorted(expected)
    obs = torch.tensor([counts.get(k, 0) for k in keys], dtype=torch.float64)
    exp = torch.tensor([expected[k] * n for k in keys], dtype=torch.float64)
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(keys) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


class FixedQDrafter(TokenDrafter):
    """Samples every draft from one fixed q [V] (no network: the test's cost is the target's)."""

    def __init__(self, q: torch.Tensor, num_speculative_tokens: int):
        super().__init__(q.shape[0], num_speculative_tokens)
        self.q = q

    def propose(self, state, last_token, sampling=None, generator=None, num_speculative_tokens=None) -> Proposal:
        gamma = num_speculative_tokens or self.num_speculative_tokens
        probs = self.q.expand(1, gamma, -1)  # [1, γ, V]
        tokens = torch.multinomial(probs[0], 1, generator=generator).view(1, gamma)
        return Proposal(tokens, probs.log(), probs, None)


def expected_and_q(target, prompt: list[int], sampling: SamplingParams, length: int) -> tuple[dict, torch.Tensor]:
    """Exact sequence probabilities, and a draft q uniform over the tokens they use plus one
    token the target never emits (so accepted, recovered and bonus tokens all occur)."""
    expected = exact_sequence_probs(target, prompt, sampling, length)
    support = sorted({t for seq in expected for t in seq})
    outside = next(t for t in range(target.vocab_size) if t not in support)
    q = torch.zeros(target.vocab_size)
    q[support + [outside]] = 1.0 / (len(support) + 1)
    return expected, q


@pytest.mark.parametrize("rule", ["speculative", "block"])
def test_sampled_sequences_follow_target(tiny_target, rule):
    """3 new tokens (the prefill's, then a draft slot and its bonus, or a recovered token and one
    more round) with top-k 2 on the two-token Markov target: 8 outcomes, the rarest expected ~7
    times in 300. q is uniform over A, B and one token the target never emits, so accepted (~60%
    of drafts), recovered and bonus tokens all occur. Each seed costs ~2.5 target forwards, so n
    is kept small; the power check below shows what it can detect."""
    prompt, length, n = prompt_of(tiny_target), 3, 300
    target, _, _ = markov_target(tiny_target, prompt)
    sampling = SamplingParams(temperature=1.0, top_k=2)
    expected, q = expected_and_q(target, prompt, sampling, length)
    engine = SpeculativeEngine(target, FixedQDrafter(q, 2), rule=rule)
    counts: dict[tuple, int] = {}
    accepted = drafted = full = 0
    for seed in range(n):
        out = engine.generate(prompt, length, sampling, seed)
        counts[tuple(out.tokens)] = counts.get(tuple(out.tokens), 0) + 1
        accepted, drafted = accepted + sum(out.accepted), drafted + sum(out.drafted)
        full += out.accepted[0] == out.drafted[0]
    assert 0.1 < accepted / drafted < 0.9 and full > 0  # accepted, recovered and bonus paths
    assert chi_square_p_value(counts, expected, n) > 1e-3


def test_chi_square_rejects_a_biased_sampler(tiny_target):
    """Power check of the test above, on the same built-for-purpose distributions: the target at
    temperature 2 (a sampler that ignores the temperature, say) is told apart from the target
    at 1 with 300 samples. The two are a known distance apart whatever the fixture's weights."""
    prompt, length = prompt_of(tiny_target), 3
    target, _, _ = markov_target(tiny_target, prompt)
    expected = exact_sequence_probs(target, prompt, SamplingParams(temperature=1.0, top_k=2), length)
    hotter = exact_sequence_probs(target, prompt, SamplingParams(temperature=2.0, top_k=2), length)
    assert len(expected) == 8 and 300 * min(expected.values()) > 5  # every cell well populated
    assert 0.5 * sum(abs(expected[k] - hotter[k]) for k in expected) > 0.1  # TV distance
    counts = {k: round(v * 300) for k, v in hotter.items()}
    assert chi_square_p_value(counts, expected, sum(counts.values())) < 1e-3
    exact = {k: round(v * 300) for k, v in expected.items()}  # and the unbiased sampler passes
    assert chi_square_p_value(exact, expected, sum(exact.values())) > 0.5
