"""Batched proposals of EAGLE-3, P-EAGLE, DFlash2, D-Loop, DEdit, Medusa and MTP: ``propose_many`` over rows of different context
lengths, each with its own γ, sampling and generator, gives each row what ``propose`` gives it
alone; the batch engine uses it and stays lossless."""

from __future__ import annotations

import pytest
import torch

from components.engine import SpeculativeEngine, target_only_generate
from components.engine.batch import BatchEngine, Request
from components.spec.sampling import SamplingParams
from tests.components.drafters.conftest import make_drafter

KINDS = [("eagle3", {}), ("peagle", {"ttt_steps": 4}), ("dflash2", {"markov_rank": 8}), ("dflash2", {"markov_rank": 8, "selector_candidates": 16}),
         ("d_loop", {}), ("dedit", {}), ("medusa", {}), ("mtp", {"mtp_depth": 2})]  # MTP: steps past depth 2 reuse module 1
TEXTS = ["def main(args):\n    ", "x = 1", "class Foo:\n    def __init__(self", "import os\nimport sys\n"]


def row_states(target, drafter) -> tuple[list, list[int]]:
    states, last = [], []
    for text in TEXTS:
        p = target.tokenizer(text)["input_ids"]
        hidden = target.forward(torch.tensor([p]), layer_ids=drafter.layer_ids).hidden
        states.append(drafter.consume(drafter.init_state(1), torch.tensor([p[:-1]]), hidden[:, :-1]))
        last.append(p[-1])
    return states, last


@pytest.mark.parametrize("name, extra", KINDS)
def test_propose_many_equals_propose_per_row(tiny_target, name, extra):
    drafter = make_drafter(tiny_target, name, num_layers=1, **extra)
    states, last = row_states(tiny_target, drafter)
    gammas = [3, 1, 4, 2]
    greedy = SamplingParams(temperature=0.0)
    for got, state, tok, g in zip(drafter.propose_many(states, torch.tensor(last), greedy, gammas), states, last,
                                  gammas):
        want = drafter.propose(state, torch.tensor([tok]), greedy, num_speculative_tokens=g)
        assert got.tokens.tolist() == want.tokens.tolist() and got.tokens.shape == (1, g)
        torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
    samplings = [SamplingParams(temperature=t) for t in (1.0, 0.0, 0.7, 1.3)]
    gens = [torch.Generator().manual_seed(s) for s in range(4)]
    many = drafter.propose_many(states, torch.tensor(last), samplings, gammas, generators=gens)
    for i, (got, state, tok, g) in enumerate(zip(many, states, last, gammas)):
        alone = torch.Generator().manual_seed(i)
        want = drafter.propose(state, torch.tensor([tok]), samplings[i], alone, g)
        assert got.tokens.tolist() == want.tokens.tolist()
        torch.testing.assert_close(got.probs, want.probs, atol=1e-4, rtol=1e-4)
        assert torch.equal(gens[i].get_state(), alone.get_state())  # drawn from as often as propose() draws


@pytest.mark.parametrize("name, extra", KINDS)
def test_batch_engine_with_rows_proposed_together(tiny_target, name, extra):
    drafter = make_drafter(tiny_target, name, num_layers=1, **extra)
    prompts = [tiny_target.tokenizer(t)["input_ids"] for t in TEXTS]
    refs = [target_only_generate(tiny_target, p, 14).tokens for p in prompts]
    calls = [0]
    inner = drafter.propose_many

    def counted(*args, **kwargs):
        calls[0] += 1
        return inner(*args, **kwargs)

    drafter.propose_many = counted
    got = BatchEngine(tiny_target, drafter, max_batch_size=4).generate(Request(p, 14) for p in prompts)
    assert [r.tokens for r in got] == refs and calls[0] > 0
    sampling = SamplingParams(temperature=0.9)
    reqs = [Request(p, 14, sampling=sampling, seed=5 + i, rule="speculative") for i, p in enumerate(prompts)]
    single = SpeculativeEngine(tiny_target, drafter, rule="speculative")
    expected = [single.generate(r.prompt_ids, 14, sampling, r.seed).tokens for r in reqs]
    assert [r.tokens for r in BatchEngine(tiny_target, drafter, max_batch_size=4).generate(reqs)] == expected
