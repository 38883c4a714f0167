"""The batch engine's drafting step: each row keeps its own record for the adaptive cap, and the
drafters' batched fast paths it uses (``propose_many``/``consume_many`` equal per-row calls)."""

from __future__ import annotations

import pytest
import torch

from components.engine import target_only_generate
from components.engine.adaptive.policy import AdaptiveDraftLength
from components.engine.batch import BatchEngine, Request
from components.spec.cost import ProfileTable
from tests.components.engine.batch.test_continuous import batch_prompts
from tests.components.engine.doubles import ScriptedDrafter
from tests.components.engine.test_engine_carryover import carry_drafter
from tests.components.engine.test_engine_greedy import random_drafter


def test_rows_keep_their_own_record(tiny_target):
    """A head that predicts acceptance its drafts never get (confidence 0.9, every first draft
    wrong): every drafting row's predicted sum grows past its accepted sum, and its survival is
    scaled down for it."""
    prompts = batch_prompts(tiny_target)[:3]
    refs = [p + target_only_generate(tiny_target, p, 30).tokens for p in prompts]
    drafter = ScriptedDrafter(refs, tiny_target.vocab_size, 4, confidence=0.9, wrong=True)
    engine = BatchEngine(tiny_target, drafter, max_batch_size=3,
                         draft_length=AdaptiveDraftLength(ProfileTable([1, 512], [1.0, 1.0])))
    for p in prompts:
        engine.add(Request(p, 30))
    for _ in range(6):
        engine.step()
    rows = [r.estimate for r in engine.batch.rows if r.estimate.hits[0] > 0]
    assert rows and all(r.hits[0] > r.hits[1] == 0 for r in rows)
    for r in rows:
        if r.raw is not None:
            assert bool((r.survival < r.raw).all())


def test_consume_many_equals_consume_per_row(tiny_target):
    """The batch engine's one-call consume keeps each row's context exactly as ``consume`` would."""
    drafter = random_drafter(tiny_target, "dspark")
    states, tokens, hidden = [], [], []
    for i, p in enumerate(batch_prompts(tiny_target)[:3]):
        out = tiny_target.forward(torch.tensor([p]), layer_ids=drafter.layer_ids)
        cut = len(p) - 1 - i  # different context lengths and new-token counts per row
        states.append(drafter.consume(drafter.init_state(1), torch.tensor([p[:cut]]), out.hidden[:, :cut]))
        tokens.append(torch.tensor([p[cut:]]))
        hidden.append(out.hidden[:, cut:])
    many = drafter.consume_many(states, tokens, hidden)
    for state, t, h, got in zip(states, tokens, hidden, many):
        want = drafter.consume(state, t, h)
        assert got.length == want.length
        for (k1, v1), (k2, v2) in zip(got.kv, want.kv):
            torch.testing.assert_close(k1, k2, atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(v1, v2, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["dspark", "dflash"])
def test_propose_many_equals_propose_per_row(tiny_target, name):
    """One padded, masked drafter pass for all rows gives each row's own proposal."""
    from components.spec.sampling import SamplingParams

    drafter = carry_drafter(tiny_target, name)
    states, last = [], []
    for i, p in enumerate(batch_prompts(tiny_target)[:3]):
        out = tiny_target.forward(torch.tensor([p]), layer_ids=drafter.layer_ids)
        state = drafter.consume(drafter.init_state(1), torch.tensor([p[:-1]]), out.hidden[:, :-1])
        if i == 1:  # one row with carryover context
            state = drafter.with_carry(state, out.hidden[:, -3:], state.length)
        states.append(state)
        last.append(p[-1])
    greedy = SamplingParams(temperature=0.0)
    many = drafter.propose_many(states, torch.tensor(last), greedy, 3)
    for state, tok, got in zip(states, last, many):
        want = drafter.propose(state, torch.tensor([tok]), greedy, num_speculative_tokens=3)
        assert got.tokens.tolist() == want.tokens.tolist()
        torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got.states, want.states, atol=1e-4, rtol=1e-4)
    # sampled rows, each with its own temperature and generator: the draws propose() makes
    samplings = [SamplingParams(temperature=t) for t in (1.0, 0.0, 0.7)]
    many = drafter.propose_many(states, torch.tensor(last), samplings, 3,
                                generators=[torch.Generator().manual_seed(s) for s in (1, 2, 3)])
    for state, tok, sampling, seed, got in zip(states, last, samplings, (1, 2, 3), many):
        want = drafter.propose(state, torch.tensor([tok]), sampling, torch.Generator().manual_seed(seed), 3)
        assert got.tokens.tolist() == want.tokens.tolist()
        torch.testing.assert_close(got.probs, want.probs, atol=1e-4, rtol=1e-4)


def test_previews_back_off_while_their_drafts_are_not_worth_drafting():
    """After ``quiet`` previewing rounds offering drafts none of which was worth drafting, the
    next previews wait 1, 2, 4, ... rounds (at most ``longest``); a round that drafts resets it;
    rounds offering nothing (no match anywhere) leave it as it was; batch-size buckets apart."""
    from components.engine.batch.draft import PreviewBackoff

    backoff = PreviewBackoff(quiet=2, longest=4)

    def play(rounds: int, offered: int, drafts: bool, batch: int = 8) -> str:
        seen = ""
        for _ in range(rounds):
            due = backoff.due(batch)
            seen += "p" if due else "-"
            if due:
                backoff.saw(batch, offered, drafts)
        return seen

    assert play(3, offered=0, drafts=False) == "ppp"  # nothing offered: looks every round
    assert play(12, offered=5, drafts=False) == "pp-p--p----p"  # waits 1, 2, 4, then at most 4
    assert play(1, offered=0, drafts=False, batch=1) == "p"  # another bucket: its own state
    assert play(5, offered=5, drafts=False) == "----p"  # still backing off
    assert play(4, offered=5, drafts=True) == "----"  # the back-off runs out first
    assert play(3, offered=5, drafts=True) == "ppp"  # a round that drafts: every round again
    assert play(3, offered=5, drafts=False) == "pp-"  # and a fresh back-off starts at 1


def test_a_cap_that_keeps_answering_zero_is_asked_less_often(tiny_target):
    """A drafter without previews: while the adaptive cap keeps answering 0, it is asked after
    1, 2, 4, ... plain rounds (at most 16), and the rounds between are plain; a cap that
    drafts asks every round again. Output is the target's either way."""
    from tests.components.engine.batch.test_continuous import ScriptedCap

    prompt = batch_prompts(tiny_target)[0]
    ref = target_only_generate(tiny_target, prompt, 60).tokens
    quiet = ScriptedCap([0])
    engine = BatchEngine(tiny_target, random_drafter(tiny_target, "dspark"), max_batch_size=1, draft_length=quiet)
    assert engine.generate([Request(prompt, 60)])[0].tokens == ref
    assert quiet.i < 20  # 4 rounds asked, then after 1, 2, 4, 8, 16, 16 plain rounds: about 10 of 59
    drafting = ScriptedCap([1])
    engine = BatchEngine(tiny_target, random_drafter(tiny_target, "dspark"), max_batch_size=1, draft_length=drafting)
    out = engine.generate([Request(prompt, 60)])[0]
    assert out.tokens == ref and drafting.i == out.rounds  # asked every round
