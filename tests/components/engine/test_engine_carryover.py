"""Carryover at inference: the target's states of a round's rejected drafts become the drafter's
context for the next round's first block. Greedy output stays the target's own, token for token
(float32), with and without DLoop; the next round's proposal states equal the carryover
objective's second-block states for the same anchor, rejected states and weights."""

from __future__ import annotations

import pytest
import torch

from components.config import DrafterConfig
from components.drafters.base import DraftBatch, DrafterError
from components.drafters.capabilities import CapabilityError
from components.drafters.registry import build_drafter
from components.engine import OracleDrafter, SpeculativeEngine, chain
from components.losses import build_loss
from components.spec.sampling import GREEDY
from components.training.objectives import ObjectiveContext, build_objective
from components.training.objectives.carryover import FirstDraft
from tests.components.engine.test_engine_greedy import MAX_NEW, prompts


def carry_drafter(target, name: str, carryover: bool = True, **cfg):
    """A random drafter; with carryover, a random non-zero E_carry."""
    torch.manual_seed(0)
    config = DrafterConfig(name=name, num_layers=1, block_size=4, carryover=carryover, **cfg)
    drafter = build_drafter(config, target).eval()
    if carryover:
        with torch.no_grad():
            drafter.carry_embed.normal_()
    return drafter


def expected_carried(out, gamma: int) -> list[int]:
    """Rows each round's first block reads: the previous round's rejected drafts, at most γ."""
    return [0] + [min(d - a, gamma) for d, a in zip(out.drafted[:-1], out.accepted[:-1])]


@pytest.mark.parametrize("name", ["dspark", "dflash"])
def test_carryover_greedy_lossless(tiny_target, references, name):
    drafter = carry_drafter(tiny_target, name)
    engine = SpeculativeEngine(tiny_target, drafter, rule="greedy", carryover=True)
    carried = 0
    for prompt, ref in zip(prompts(tiny_target), references):
        out = engine.generate(prompt, MAX_NEW)
        assert out.tokens == ref and out.target_forwards == out.rounds + 1
        assert out.carried == expected_carried(out, drafter.num_speculative_tokens)
        carried += sum(out.carried)
    assert carried > 0  # carry rows were read


@pytest.mark.parametrize("name", ["dspark", "dflash"])
def test_carryover_with_dloop_greedy_lossless(tiny_target, references, name):
    """DLoop's later stages drop the carry rows (consume_own); the first stage reads them."""
    drafter = carry_drafter(tiny_target, name)
    engine = SpeculativeEngine(tiny_target, drafter, rule="greedy", loop_stages=3, loop_gate=float("-inf"),
                               carryover=True)
    looped, carried = False, 0
    for prompt, ref in zip(prompts(tiny_target), references):
        out = engine.generate(prompt, MAX_NEW)
        assert out.tokens == ref and out.target_forwards == out.rounds + 1
        assert out.carried == expected_carried(out, drafter.num_speculative_tokens)  # capped at one block
        looped |= max(out.drafted) > drafter.num_speculative_tokens
        carried += sum(out.carried)
    assert looped and carried > 0


def _reference_second_block(obj, batch: DraftBatch, anchor: int, drafts, m: int, monkeypatch):
    """The objective's rejected states H_rej [γ-m, n, H] and second-block draft states [γ, H]."""
    d, gamma = obj.drafter, obj.drafter.max_speculative_tokens
    first = FirstDraft(torch.tensor([[anchor]]), drafts.view(1, 1, gamma), torch.tensor([[m]]),
                       torch.tensor([[gamma]]), torch.tensor([[anchor + m + 1]]), torch.tensor([[gamma - m]]))
    h_rej = obj.verify(batch, first)  # [1, 1, γ, n, H]
    with monkeypatch.context() as patch:
        patch.setattr(d, "block_output", lambda batch, anchors, z: z)  # second_draft returns z
        z = obj.second_draft(batch, first.second, h_rej[:, :, :gamma - m], first.second, first.rows)
    return h_rej[0, 0, :gamma - m], d.draft_states(z)[0, 0]


@pytest.mark.parametrize("name", ["dspark", "dflash"])
def test_next_proposal_equals_the_objectives_second_block(tiny_target, name, monkeypatch):
    """Rows at a+m+1..a+γ (verify-hidden m+1..γ), re-draft anchored at a+m+1, as trained."""
    drafter = carry_drafter(tiny_target, name, markov_rank=8)
    loss = build_loss("tv_ce_confidence" if name == "dspark" else "kl")
    obj = build_objective("carryover", drafter, loss, {}, ObjectiveContext(tiny_target))
    engine = SpeculativeEngine(tiny_target, drafter, rule="greedy", carryover=True)
    gamma, rounds = drafter.max_speculative_tokens, []

    def recording_accept(drafter_, settings, seq, drafts, result, hidden, cache, res, proposal=None,
                         accept=chain.accept_chain):
        new = accept(drafter_, settings, seq, drafts, result, hidden, cache, res, proposal)
        rounds.append((seq.length - 1, drafts[0].clone(), int(result.num_accepted[0]), hidden.clone(), new))
        return new

    monkeypatch.setattr(chain, "accept_chain", recording_accept)  # the batch-1 round's accept step
    checked = 0
    for prompt in prompts(tiny_target)[:2]:
        rounds.clear()
        full = torch.tensor([prompt + engine.generate(prompt, MAX_NEW).tokens])
        t_out = tiny_target.forward(full, layer_ids=drafter.layer_ids)
        batch = DraftBatch(full, t_out.hidden, t_out.last_hidden)
        for anchor, drafts, m, hidden, new in rounds:
            if drafts.shape[0] < gamma or m == gamma:
                continue  # a shortened last round, or a full accept (no carry)
            assert new.carry_rows == gamma - m and new.draft_state.carry_rows == gamma - m
            assert new.draft_state.length == anchor + m + 1 and int(new.last_token) == int(full[0, anchor + m + 1])
            h_rej, z_ref = _reference_second_block(obj, batch, anchor, drafts, m, monkeypatch)
            torch.testing.assert_close(hidden[0, m + 1:], h_rej, rtol=1e-4, atol=1e-4)
            states = drafter.propose(new.draft_state, new.last_token, GREEDY).states[0]
            torch.testing.assert_close(states, z_ref, rtol=1e-4, atol=1e-4)
            plain = drafter.propose(drafter.rollback(new.draft_state, new.draft_state.length), new.last_token, GREEDY)
            assert (plain.states[0] - states).abs().max() > 1e-3  # the carry rows matter
            checked += 1
    assert checked >= 3


def test_carry_lasts_one_round(tiny_target):
    """consume, consume_own and rollback drop the carry rows; k = 0 clears them."""
    drafter = carry_drafter(tiny_target, "dspark")
    n, h = len(drafter.layer_ids), tiny_target.hidden_size
    ids = torch.tensor([prompts(tiny_target)[0]])
    hidden = tiny_target.forward(ids, layer_ids=drafter.layer_ids).hidden
    state = drafter.consume(drafter.init_state(1), ids[:, :-1], hidden[:, :-1])
    carried = drafter.with_carry(state, torch.randn(1, 2, n, h), state.length)
    assert carried.length == state.length and carried.carry_rows == 2 and carried.kv is state.kv
    assert all(k.shape[2] == 2 for k, _ in carried.carry)
    own = drafter.propose(carried, ids[:, -1], GREEDY).states
    for dropped in (drafter.consume(carried, ids[:, -1:], hidden[:, -1:]), drafter.consume_own(carried, own),
                    drafter.rollback(carried, state.length),
                    drafter.with_carry(carried, torch.zeros(1, 0, n, h), state.length)):
        assert dropped.carry is None and dropped.carry_rows == 0
    with pytest.raises(DrafterError, match="bounded by one block"):
        drafter.with_carry(state, torch.randn(1, drafter.max_speculative_tokens + 1, n, h), state.length)


def test_refuses_drafters_without_carryover(tiny_target):
    plain = carry_drafter(tiny_target, "dflash", carryover=False)
    eagle = build_drafter(DrafterConfig(name="eagle3", ttt_steps=2), tiny_target)
    oracle = OracleDrafter([1, 2, 3], tiny_target.vocab_size, 2)
    for drafter, name in ((plain, "dflash"), (eagle, "eagle3"), (oracle, "OracleDrafter")):
        with pytest.raises(CapabilityError, match=f"carryover=True needs capability carryover; drafter '{name}'"
                                                  ".*drafter.carryover=true"):
            SpeculativeEngine(tiny_target, drafter, carryover=True)
    SpeculativeEngine(tiny_target, plain)  # carryover off: fine
    n, h = len(plain.layer_ids), tiny_target.hidden_size
    with pytest.raises(DrafterError, match="drafter 'dflash' has no carryover embedding.*drafter.carryover=true"):
        plain.with_carry(plain.init_state(1), torch.zeros(1, 1, n, h), 0)
    with pytest.raises(DrafterError, match=r"drafter 'eagle3' \(Eagle3Drafter\) cannot read rejected"):
        eagle.with_carry(eagle.init_state(1), torch.zeros(1, 1, n, h), 0)
