"""DLoop multi-stage drafting in the engine stays lossless: greedy output equals the target's own
token for token (float32), sampled output follows the target's distribution (chi-square), and
rounds really draft beyond one block when the gate lets them."""

from __future__ import annotations

import pytest
import torch

from components.config import DrafterConfig
from components.drafters.base import Proposal
from components.drafters.capabilities import Capability
from components.drafters.registry import build_drafter
from components.engine import SpeculativeEngine
from components.spec.sampling import SamplingParams
from tests.components.engine.doubles import markov_target
from tests.components.engine.test_engine_greedy import MAX_NEW, prompts
from tests.components.engine.test_engine_sampling import (
    FixedQDrafter,
    chi_square_p_value,
    expected_and_q,
    prompt_of,
)


@pytest.mark.parametrize("name", ["dspark", "dflash"])
@pytest.mark.parametrize("gate", [float("-inf"), -2.0])
def test_dloop_greedy_lossless(tiny_target, references, name, gate):
    torch.manual_seed(0)
    drafter = build_drafter(DrafterConfig(name=name, num_layers=1, block_size=4), tiny_target).eval()
    engine = SpeculativeEngine(tiny_target, drafter, rule="greedy", loop_stages=3, loop_gate=gate)
    looped = False
    for prompt, ref in zip(prompts(tiny_target), references):
        out = engine.generate(prompt, MAX_NEW)
        assert out.tokens == ref and out.target_forwards == out.rounds + 1
        looped |= max(out.drafted) > drafter.num_speculative_tokens
    if gate == float("-inf"):
        assert looped  # the gate never stops: rounds draft 3 blocks (budget permitting)


def test_dloop_gate_zero_never_loops_a_random_drafter(tiny_target):
    torch.manual_seed(0)
    drafter = build_drafter(DrafterConfig(name="dspark", num_layers=1, block_size=4), tiny_target).eval()
    out = SpeculativeEngine(tiny_target, drafter, loop_stages=3, loop_gate=0.0).generate(prompts(tiny_target)[0], 12)
    assert max(out.drafted) <= drafter.num_speculative_tokens  # Σ log q < 0 for any non-degenerate q


class LoopingFixedQ(FixedQDrafter):
    """FixedQDrafter with (dummy) own states, so the engine loops it stage after stage."""

    def capabilities(self) -> frozenset[Capability]:
        return frozenset({Capability.OWN_CONTEXT})

    def propose(self, state, last_token, sampling=None, generator=None, num_speculative_tokens=None) -> Proposal:
        prop = super().propose(state, last_token, sampling, generator, num_speculative_tokens)
        prop.states = torch.zeros(1, prop.tokens.shape[1], 1)
        return prop

    def consume_own(self, state, states):
        return state


def test_dloop_sampled_sequences_follow_target(tiny_target):
    """Speculative sampling over two one-token stages in the first round: 4 new tokens (the
    prefill's, two drafts and the bonus/recovered one, then more), top-k 2 on the two-token
    Markov target (``doubles``): 16 outcomes of known probability."""
    prompt, length, n = prompt_of(tiny_target), 4, 300
    target, _, _ = markov_target(tiny_target, prompt)
    sampling = SamplingParams(temperature=1.0, top_k=2)
    expected, q = expected_and_q(target, prompt, sampling, length)
    engine = SpeculativeEngine(target, LoopingFixedQ(q, 1), rule="speculative", loop_stages=2,
                               loop_gate=float("-inf"))
    counts: dict[tuple, int] = {}
    two_stage = 0
    for seed in range(n):
        out = engine.generate(prompt, length, sampling, seed)
        counts[tuple(out.tokens)] = counts.get(tuple(out.tokens), 0) + 1
        two_stage += out.drafted[0] == 2
    assert two_stage == n  # every first round drafted two stages of one token
    assert chi_square_p_value(counts, expected, n) > 1e-3
