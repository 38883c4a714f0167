"""D-Loop and DEdit: what each pass reads, that training lays the passes out as drafting does,
that ProposalMix mixes by confidence, and that the q handed to verification is what the final
drafts were drawn from (chi-square)."""

from __future__ import annotations

import pytest
import torch

from components.drafters import DrafterError
from components.drafters.multipass import proposal_mix
from components.spec.sampling import GREEDY, SamplingParams, probs_from_logits
from tests.components.drafters.conftest import make_drafter, run_target


def _state(d, target, ids, n=9):
    run = run_target(target, d, ids)
    return d.consume(d.init_state(1), ids[:1, :n], run.hidden[:1, :n]), ids[:1, n]


def test_d_loop_suffix_reads_the_prefix_drafts_and_prefix_is_pass_one(tiny_target, ids):
    d = make_drafter(tiny_target, "d_loop", num_layers=1, block_size=6, loop_prefix=2)
    assert d.prefix == 2 and d.sequential_passes(2) == 1 and d.sequential_passes(5) == 2
    state, last = _state(d, tiny_target, ids)
    with torch.no_grad():
        prop = d.propose(state, last, GREEDY)
        run = d.block_runner(state, 1)
        block = d.mask_block(last)
        z1 = run(block)
        torch.testing.assert_close(prop.logits[:, :2], d.lm_head(z1[:, 1:3]))  # the prefix: DFlash's pass
        block[:, 1:3] = prop.tokens[:, :2]
        torch.testing.assert_close(prop.logits[:, 2:], d.lm_head(run(block)[:, 3:]))  # the suffix: given it
        block[:, 1:3] = (prop.tokens[:, :2] + 1) % tiny_target.vocab_size  # another prefix, another suffix
        assert not torch.allclose(prop.logits[:, 2:], d.lm_head(run(block)[:, 3:]))
        short = d.propose(state, last, GREEDY, num_speculative_tokens=2)  # γ within the prefix: one pass
        assert torch.equal(short.tokens, prop.tokens[:, :2])


@pytest.mark.parametrize("prefix", [0, 5])
def test_d_loop_prefix_out_of_range_is_named(tiny_target, prefix):
    with pytest.raises(DrafterError, match="loop_prefix"):
        make_drafter(tiny_target, "d_loop", num_layers=1, block_size=6, loop_prefix=prefix)


@pytest.mark.parametrize("name", ["d_loop", "dedit"])
def test_multipass_needs_dflash_layout(tiny_target, name):
    with pytest.raises(DrafterError, match="sample_from_anchor"):
        make_drafter(tiny_target, name, num_layers=1, sample_from_anchor=True)


def test_dedit_editing_passes_feed_the_argmax_drafts_back(tiny_target, ids):
    d = make_drafter(tiny_target, "dedit", num_layers=1, block_size=5, edit_passes=2)
    assert d.sequential_passes(4) == 3
    state, last = _state(d, tiny_target, ids)
    with torch.no_grad():
        prop = d.propose(state, last, GREEDY)
        run, block = d.block_runner(state, 1), d.mask_block(last)
        z = run(block)
        for _ in range(2):
            block = torch.cat([block[:, :1], d.lm_head(z[:, 1:]).argmax(-1)], 1)
            z = run(block)
        torch.testing.assert_close(prop.logits, d.lm_head(z[:, 1:]))
        torch.testing.assert_close(prop.states, z[:, 1:])
        none = make_drafter(tiny_target, "dedit", num_layers=1, block_size=5, edit_passes=0)
        dflash = make_drafter(tiny_target, "dflash", num_layers=1, block_size=5)
        dflash.load_state_dict(none.state_dict())
        torch.testing.assert_close(none.propose(state, last, GREEDY).logits, dflash.propose(state, last, GREEDY).logits)


def test_dedit_sampled_q_is_the_last_pass_and_draws_follow_it(tiny_target, ids):
    d = make_drafter(tiny_target, "dedit", num_layers=1, block_size=4, edit_passes=1)
    state, last = _state(d, tiny_target, ids)
    sampling = SamplingParams(temperature=1.0, top_k=4)
    gen = torch.Generator().manual_seed(0)
    counts: dict[int, int] = {}
    with torch.no_grad():
        greedy = d.propose(state, last, GREEDY)
        q0 = None
        for _ in range(300):
            prop = d.propose(state, last, sampling, gen)
            counts[int(prop.tokens[0, 0])] = counts.get(int(prop.tokens[0, 0]), 0) + 1
            q0 = prop.probs[0, 0] if q0 is None else q0
            torch.testing.assert_close(prop.logits, greedy.logits)  # the editing inputs are argmax: fixed
    torch.testing.assert_close(q0, probs_from_logits(greedy.logits, sampling)[0, 0])
    support = q0.nonzero().view(-1).tolist()
    assert set(counts) <= set(support) and len(support) == 4
    n = sum(counts.values())
    stat = sum((counts.get(t, 0) - n * float(q0[t])) ** 2 / (n * float(q0[t])) for t in support)
    assert float(torch.special.gammaincc(torch.tensor(1.5), torch.tensor(stat / 2))) > 1e-3


def test_proposal_mix_keeps_guesses_by_confidence():
    n = 4000
    guess, recorded = torch.ones(n, 3, dtype=torch.long), torch.full((n, 3), 2)
    conf = torch.tensor([0.0, 0.3, 1.0]).expand(n, 3)
    valid = torch.ones(n, 3, dtype=torch.bool)
    mixed = proposal_mix(guess, recorded, conf, valid, torch.Generator().manual_seed(0))
    kept = (mixed == guess).float().mean(0)
    assert kept[0] == 0 and kept[2] == 1 and abs(float(kept[1]) - 0.3) < 0.03
    valid[:, 0] = False  # no record: the guess
    assert proposal_mix(guess, recorded, conf, valid)[:, 0].eq(1).all()


def test_dedit_training_mode_trains_both_passes(tiny_target, ids):
    d = make_drafter(tiny_target, "dedit", num_layers=1, block_size=5, edit_passes=2)
    batch = run_target(tiny_target, d, ids).batch(anchors=torch.tensor([[3, 9], [5, 11]]))
    evaluated = d.training_forward(batch)
    d.train()
    trained = d.training_forward(batch, torch.Generator().manual_seed(0))
    assert evaluated.draft_logits.shape[0] == 4 and trained.draft_logits.shape[0] == 8
    assert torch.equal(trained.target_tokens[:4], trained.target_tokens[4:])
    loss = trained.draft_logits.logsumexp(-1).mean()
    loss.backward()
    assert all(p.grad is not None for p in d.backbone.parameters() if p.requires_grad)
