"""DFlash2: the dynamic convolution is a two-tap filter inside each block (identity at the start);
the selector's one-shot pair scores are the teacher-forced scores at the candidates; drafting
walks them from the last verified token; the q handed to verification is what each draft was
drawn from (zero outside the candidates)."""

from __future__ import annotations

import pytest
import torch

from components.drafters import DrafterError
from components.drafters.dflash2 import DynamicConv, pair_scores
from components.spec.sampling import GREEDY, SamplingParams, probs_from_logits
from tests.components.drafters.conftest import make_drafter, run_target


def test_convolution_is_two_taps_inside_each_block():
    torch.manual_seed(0)
    conv = DynamicConv(8, block_size=4)
    z = torch.randn(1, 8, 8)  # two blocks of 4
    assert torch.equal(conv(z), z)  # identity at the start
    with torch.no_grad():
        conv.base.normal_()
        conv.up.weight.normal_()
    out = conv(z)
    moved = z.clone()
    moved[0, 1] += 1.0  # block 1, slot 1
    diff = (conv(moved) - out).abs().sum(-1)[0]
    assert diff[1] > 0 and diff[2] > 0  # itself and the next slot
    assert diff[[0, 3, 4, 5, 6, 7]].eq(0).all()  # nothing two slots on, nothing in the other block
    moved = z.clone()
    moved[0, 3] += 1.0  # last slot of block 1: block 2's first slot does not read it
    assert (conv(moved) - out)[0, 4:].eq(0).all()


CANDIDATES = 16  # the survey's selector: the top 16 of U_k per position


def _drafter(target, **overrides):
    """The survey's candidate selector unless ``overrides`` say otherwise."""
    return make_drafter(target, "dflash2", num_layers=1, markov_rank=8, **{"selector_candidates": CANDIDATES,
                                                                             **overrides})


def test_one_shot_pairs_equal_teacher_forced_readout(tiny_target):
    d = _drafter(tiny_target)
    gamma, h = d.max_speculative_tokens, d.sizes.hidden_size
    torch.manual_seed(1)
    z = torch.randn(1, gamma, h)
    with torch.no_grad():
        base = d.lm_head(z)
        cand = base.topk(CANDIDATES, dim=-1).indices
        last = torch.tensor([7])
        first, pairs = pair_scores(d.selector, base, z, cand, d.to_target(cand), last)
        path = cand[0, :, 3]  # any path through the candidates: the 4th of each
        prev = torch.cat([last, path[:-1]])[None]  # [1, γ]
        logits, _, _ = d.train_readout_base(z, prev)
        torch.testing.assert_close(first[0], logits[0, 0, cand[0, 0]])
        for k in range(1, gamma):
            torch.testing.assert_close(pairs[0, k - 1, 3], logits[0, k, cand[0, k]], rtol=1e-5, atol=1e-5)


def test_drafts_walk_the_candidates_and_q_is_what_they_were_drawn_from(tiny_target, ids):
    d = _drafter(tiny_target)
    run = run_target(tiny_target, d, ids)
    state = d.consume(d.init_state(1), ids[:1, :9], run.hidden[:1, :9])
    with torch.no_grad():
        greedy = d.propose(state, ids[:1, 9], GREEDY)
        assert greedy.logits.isfinite().sum(-1).eq(CANDIDATES).all()  # scores on C_k only
        assert torch.equal(greedy.tokens, greedy.logits.argmax(-1))
        sampling = SamplingParams(temperature=1.0, top_k=4)
        gen = torch.Generator().manual_seed(0)
        counts: dict[int, int] = {}
        q0 = None
        for i in range(300):
            prop = d.propose(state, ids[:1, 9], sampling, gen)
            counts[int(prop.tokens[0, 0])] = counts.get(int(prop.tokens[0, 0]), 0) + 1
            q0 = prop.probs[0, 0] if q0 is None else q0
            if i < 5:  # each slot's q: the selector's scores given the token drawn before it
                torch.testing.assert_close(prop.probs, probs_from_logits(prop.logits, sampling))
                prev = torch.cat([ids[:1, 9], prop.tokens[0, :-1]])[None]
                tf, _, _ = d.train_readout_base(prop.states, prev)
                drafted = prop.logits.isfinite()
                torch.testing.assert_close(prop.logits[drafted], tf[drafted], rtol=1e-5, atol=1e-5)
    support = q0.nonzero().view(-1).tolist()
    assert set(counts) <= set(support) and len(support) == 4
    n = sum(counts.values())
    stat = sum((counts.get(t, 0) - n * float(q0[t])) ** 2 / (n * float(q0[t])) for t in support)
    assert float(torch.special.gammaincc(torch.tensor(1.5), torch.tensor(stat / 2))) > 1e-3


def test_whole_readout_walk_is_the_teacher_forced_readout(tiny_target, ids):
    """``selector_candidates: 0``: every slot scores the whole readout, S_k(x_{k−1}, ·) with the
    slot before's draw, exactly the training readout; greedy drafts are its argmax, sampled q
    is what each draft was drawn from; the candidate walk at the same weights drafts within it."""
    full, top = _drafter(tiny_target, selector_candidates=0), _drafter(tiny_target)
    assert full.cfg.selector_candidates == 0 and top.cfg.selector_candidates == CANDIDATES
    run = run_target(tiny_target, full, ids)
    state = full.consume(full.init_state(1), ids[:1, :9], run.hidden[:1, :9])
    sampling = SamplingParams(temperature=1.0)
    with torch.no_grad():
        for how, gen in ((GREEDY, None), (sampling, torch.Generator().manual_seed(0))):
            prop = full.propose(state, ids[:1, 9], how, gen)
            assert prop.logits.isfinite().all()
            prev = torch.cat([ids[:1, 9], prop.tokens[0, :-1]])[None]
            tf, _, _ = full.train_readout_base(prop.states, prev)
            torch.testing.assert_close(prop.logits, tf, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(prop.probs, probs_from_logits(prop.logits, how))
        greedy = full.propose(state, ids[:1, 9], GREEDY)
        assert torch.equal(greedy.tokens, greedy.logits.argmax(-1))
        walked = top.propose(state, ids[:1, 9], GREEDY)  # the same weights, restricted to C_k
        inside = greedy.tokens == walked.tokens
        assert bool(inside[0, 0]) == bool(walked.logits[0, 0].isfinite()[greedy.tokens[0, 0]])


def test_negative_candidates_refused(tiny_target):
    with pytest.raises(DrafterError, match="selector_candidates"):
        _drafter(tiny_target, selector_candidates=-1)
