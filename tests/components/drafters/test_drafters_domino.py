"""Domino: a GRU over the block's previous tokens corrects the backbone's logits. It starts as its
backbone; teacher-forced training equals free-running drafting; the correction remembers the whole
prefix (DSpark's Markov head only the last token); the tree head and batched proposals agree with
``propose``; the proposal's q is the distribution its drafts were drawn from; the engines stay
lossless. The correction's W2 starts at zero, so the tests give it random weights first."""

from __future__ import annotations

import pytest
import torch

from components.drafters.capabilities import Capability, has
from components.engine import SpeculativeEngine, target_only_generate
from components.engine.batch import BatchEngine, Request
from components.spec.sampling import GREEDY, SamplingParams, probs_from_logits
from tests.components.drafters.conftest import make_drafter, run_target
from tests.components.drafters.test_drafters_propose_many import TEXTS, row_states


def domino(target, **overrides):
    """A 1-layer Domino with a non-zero correction (its own seed)."""
    d = make_drafter(target, "domino", num_layers=1, markov_rank=8, **overrides)
    with torch.no_grad():
        torch.manual_seed(3)
        d.markov_head.w2.weight.normal_(0, 0.5)
    return d


def test_starts_as_its_backbone(tiny_target, ids):
    d = make_drafter(tiny_target, "domino", num_layers=1, markov_rank=8)
    out = d.training_forward(run_target(tiny_target, d, ids).batch())
    assert out.base_logits is not None
    torch.testing.assert_close(out.draft_logits, out.base_logits)
    assert has(d, Capability.BASE_LOGITS) and has(d, Capability.CAUSAL_TREE_HEAD)
    assert not has(d, Capability.SLOT_HEADS)  # no vLLM layout: never exported as DSpark


def test_training_matches_inference(tiny_target, ids):
    """Teacher-forced logits at anchor a equal consume + propose when the data continues with
    the greedy drafts, and they differ from the backbone's (the correction is on)."""
    d, a = domino(tiny_target), 11
    run = run_target(tiny_target, d, ids)
    prop = d.propose(d.consume(d.init_state(2), ids[:, :a], run.hidden[:, :a]), ids[:, a], GREEDY)
    seq = torch.cat([ids[:, :a + 1], prop.tokens], dim=1)
    out = d.training_forward(run_target(tiny_target, d, seq).batch(anchors=torch.full((2, 1), a)))
    torch.testing.assert_close(out.draft_logits, prop.logits, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(out.draft_logits, out.base_logits, atol=1e-3)
    assert torch.equal(out.target_tokens, prop.tokens)
    conf = torch.sigmoid(out.confidence_logits)
    torch.testing.assert_close(conf, prop.confidences, rtol=1e-4, atol=1e-5)


def test_correction_reads_the_whole_prefix(tiny_target):
    """Slot 3's correction changes when only the token two slots before it changes (same z, same
    previous token); DSpark's Markov bias would not."""
    d = domino(tiny_target)
    z = torch.randn(1, 4, d.sizes.hidden_size)
    prev = torch.tensor([[5, 6, 7, 8]])
    other = prev.clone()
    other[0, 1] = 9
    c1, c2 = d.markov_head.teacher_forced(z, prev), d.markov_head.teacher_forced(z, other)
    torch.testing.assert_close(c1[:, 0], c2[:, 0])  # before the change: the same
    assert not torch.allclose(c1[:, 3], c2[:, 3])


def test_tree_head_reads_the_path(tiny_target):
    """The causal tree head's children scores at depth d equal the teacher-forced readout of a
    block whose previous tokens are that node's path."""
    d = domino(tiny_target)
    gamma = d.max_speculative_tokens
    z = torch.randn(gamma, d.sizes.hidden_size)
    paths = torch.tensor([[5, 6, 7, 0] + [0] * (gamma - 3), [5, 9, 0, 0] + [0] * (gamma - 3)])[:, :gamma + 1]
    depth = torch.tensor([2, 1])
    cand = torch.tensor([[1, 2, 3], [4, 5, 6]])
    got = d.causal_tree_head(z)(paths, depth, cand)
    for i in range(2):
        n = int(depth[i]) + 1
        logits, _ = d.train_readout(z[None, :n], paths[i:i + 1, :n])
        want = torch.log_softmax(logits[0, -1].float(), -1)[cand[i]]
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)


def test_propose_many_equals_propose_per_row(tiny_target):
    d = domino(tiny_target)
    states, last = row_states(tiny_target, d)
    gammas = [3, 1, 4, 2]
    for got, state, tok, g in zip(d.propose_many(states, torch.tensor(last), GREEDY, gammas), states, last, gammas):
        want = d.propose(state, torch.tensor([tok]), GREEDY, num_speculative_tokens=g)
        assert got.tokens.tolist() == want.tokens.tolist()
        torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
    samplings = [SamplingParams(temperature=t) for t in (1.0, 0.0, 0.7, 1.3)]
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    got = d.propose_many(states, torch.tensor(last), samplings, gammas, gens)
    for i, (state, tok, g) in enumerate(zip(states, last, gammas)):
        want = d.propose(state, torch.tensor([tok]), samplings[i], torch.Generator().manual_seed(i), g)
        assert got[i].tokens.tolist() == want.tokens.tolist()


def test_sampled_q_is_the_distribution_drawn_from(tiny_target):
    """Each sampled proposal's q at slot k is the teacher-forced distribution given the tokens it
    actually drew before k (what the verification rule needs to stay lossless), and the first
    slot's draws follow q (chi-square over its top tokens, the rest pooled)."""
    d = domino(tiny_target)
    states, last = row_states(tiny_target, d)
    state, tok = states[0], torch.tensor([last[0]])
    sampling = SamplingParams(temperature=1.0, top_k=4)
    gen = torch.Generator().manual_seed(0)
    counts: dict[int, int] = {}
    q0 = None
    for i in range(300):
        prop = d.propose(state, tok, sampling, gen)
        first = int(prop.tokens[0, 0])
        counts[first] = counts.get(first, 0) + 1
        q0 = prop.probs[0, 0].detach() if q0 is None else q0
        if i < 5:  # the conditionals: slot k's q given the drawn prefix
            z = prop.states  # [1, γ, H]
            prev = torch.cat([tok, prop.tokens[0, :-1]])[None]
            logits, _ = d.train_readout(z, prev)
            torch.testing.assert_close(probs_from_logits(d.full_logits(logits), sampling), prop.probs,
                                           atol=1e-5, rtol=1e-4)
    support = q0.nonzero().view(-1).tolist()
    assert set(counts) <= set(support) and len(support) == 4
    n = sum(counts.values())
    stat = sum((counts.get(t, 0) - n * float(q0[t])) ** 2 / (n * float(q0[t])) for t in support)
    p = float(torch.special.gammaincc(torch.tensor(1.5), torch.tensor(stat / 2)))
    assert p > 1e-3


@pytest.mark.parametrize("rule", ["greedy", "speculative"])
def test_engines_are_lossless(tiny_target, rule):
    """Greedy: the batch-1 and batch engines give the target's own tokens; sampled: the batch
    engine gives what the batch-1 engine gives each request alone with its seed."""
    d = domino(tiny_target).eval()
    prompts = [tiny_target.tokenizer(t)["input_ids"] for t in TEXTS]
    lengths = [20, 9, 25, 14]
    if rule == "greedy":
        refs = [target_only_generate(tiny_target, p, n).tokens for p, n in zip(prompts, lengths)]
        single = SpeculativeEngine(tiny_target, d, rule="greedy")
        assert [single.generate(p, n).tokens for p, n in zip(prompts, lengths)] == refs
        got = BatchEngine(tiny_target, d, max_batch_size=3).generate([Request(p, n) for p, n in zip(prompts, lengths)])
        assert [r.tokens for r in got] == refs
        return
    sampling = SamplingParams(temperature=0.9)
    reqs = [Request(p, n, rule=rule, sampling=sampling, seed=100 + i) for i, (p, n) in enumerate(zip(prompts, lengths))]
    single = SpeculativeEngine(tiny_target, d, rule=rule)
    expected = [single.generate(r.prompt_ids, r.max_new_tokens, sampling, r.seed).tokens for r in reqs]
    assert [r.tokens for r in BatchEngine(tiny_target, d, max_batch_size=3).generate(reqs)] == expected
