"""The carryover objective in-process (no Ray): first draft, verification, re-draft, E_carry, export."""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch

from components.config import DrafterConfig, TrainConfig
from components.drafters import build_drafter
from components.drafters.base import DrafterError
from components.drafters.checkpoint import load_drafter, save_drafter
from components.export import vllm_export
from components.losses import build_loss
from components.spec.sampling import GREEDY
from components.training import collate, new_train_state, train_step
from components.training.objectives import ObjectiveContext, build_objective
from components.training.objectives.carryover import (
    CarryoverObjective,
    first_drafts_at_sampled_anchors,
    tree_masks,
)
from tests.components.training.test_training_steps import _record, first_step_descends

DRAFTERS = {
    "dspark": DrafterConfig(name="dspark", block_size=4, num_anchors=8, markov_rank=8, num_layers=2),
    "dflash": DrafterConfig(name="dflash", block_size=4, num_anchors=8, num_layers=2),
}
LOSSES = {"dspark": "tv_ce_confidence", "dflash": "kl"}  # each drafter's usual loss (DFlash has no confidence head)
ANCHORS = [4, 9, 12, 6]  # the first two are planted (see _planted_batch)


def _drafter(target, name: str, carryover: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    return build_drafter(dataclasses.replace(DRAFTERS[name], carryover=carryover), target)


def _objective(target, drafter, **params) -> CarryoverObjective:
    loss = build_loss(LOSSES.get(drafter.cfg.name, "kl"))
    return build_objective("carryover", drafter, loss, params, ObjectiveContext(target))


def _planted_batch(drafter, records):
    """Records whose tokens copy the drafter's first 2 greedy drafts at anchors 4 and 9 (m >= 2 there)."""
    batch = collate(records)
    for row in range(batch.input_ids.shape[0]):
        for a in ANCHORS[:2]:
            state = drafter.consume(drafter.init_state(1), batch.input_ids[row:row + 1, :a], batch.hidden[row:row + 1, :a])
            prop = drafter.propose(state, batch.input_ids[row:row + 1, a], GREEDY)
            batch.input_ids[row, a + 1:a + 3] = prop.tokens[0, :2]
    batch.anchors = torch.tensor([ANCHORS] * batch.input_ids.shape[0])
    return batch


@pytest.fixture(scope="module")
def records(tiny_target):
    torch.manual_seed(0)
    ids = _drafter(tiny_target, "dspark").layer_ids
    return [_record(tiny_target, ids, n, 3, i, "float16") for i, n in enumerate([20, 16, 18])]


@pytest.mark.parametrize("name,verify", [("dspark", "tree"), ("dspark", "branches"), ("dflash", "auto")])
def test_first_draft_is_free_running_and_verification_is_the_target_on_the_branch(name, verify, tiny_target, records):
    """Either way of verifying (every branch of a record in one masked pass, or each branch as its
    own sequence) gives each rejected branch the states of the target's own pass over it."""
    drafter = _drafter(tiny_target, name).eval()
    obj = _objective(tiny_target, drafter, chunk=3, verify_chunk=2, verify=verify)
    assert obj.tree == (verify != "branches")  # the fixture is a Qwen3: a declared tree-mask family
    batch = _planted_batch(drafter, records)
    first = first_drafts_at_sampled_anchors(drafter, batch, 0, obj.params.chunk, None)  # the planted anchors
    gamma = drafter.max_speculative_tokens
    for row in range(batch.input_ids.shape[0]):
        for i, a in enumerate(ANCHORS):  # the drafts are what the engine protocol proposes
            state = drafter.consume(drafter.init_state(1), batch.input_ids[row:row + 1, :a], batch.hidden[row:row + 1, :a])
            prop = drafter.propose(state, batch.input_ids[row:row + 1, a], GREEDY)
            assert first.drafts[row, i].tolist() == prop.tokens[0].tolist(), (row, a)
    assert (first.accepted[:, :2] >= 2).all()
    assert ((first.second == first.anchors + first.accepted + 1) | (first.second == -1)).all()
    rejected = (first.accepted < first.checkable) & (first.second >= 0)
    assert torch.equal(first.rows, torch.where(rejected, gamma - first.accepted, 0)) and bool(rejected.any())
    assert bool((first.rows[:, :2] > 0).any())  # some branch after accepted drafts is verified

    h_rej = obj.verify(batch, first)
    checked = 0
    for row, i in first.rows.nonzero().tolist():
        a, m = int(first.anchors[row, i]), int(first.accepted[row, i])
        branch = torch.cat([batch.input_ids[row, :a + m + 1], first.drafts[row, i, m:]]).unsqueeze(0)
        direct = tiny_target.forward(branch, layer_ids=drafter.layer_ids).hidden[0, a + m + 1:]
        assert direct.shape[0] == gamma - m
        torch.testing.assert_close(h_rej[row, i, :gamma - m], direct, rtol=1e-4, atol=1e-4)
        assert not h_rej[row, i, gamma - m:].any()
        checked += 1
    assert checked == int((first.rows > 0).sum()) >= 2
    assert not h_rej[first.rows == 0].any()


@pytest.mark.parametrize("name", ["dspark", "dflash"])
def test_masked_carryover_rows_change_nothing_and_real_rows_only_their_own_block(name, tiny_target, records):
    """With every carryover row masked out, the second blocks equal plain blocks at a2 (any E_carry,
    any rejected states); a real row changes the logits of its own block and of no other block."""
    drafter = _drafter(tiny_target, name).eval()
    obj = _objective(tiny_target, drafter)
    with torch.no_grad():
        drafter.carry_embed.normal_()
    batch = collate(records)
    anchors2 = torch.tensor([[5, 8, 11], [4, 9, -1], [6, 7, 13]])
    b, a = anchors2.shape
    width, n, h = drafter.max_speculative_tokens, len(drafter.layer_ids), batch.hidden.shape[-1]
    carry = torch.randn(b, a, width, n, h)
    rows = torch.zeros(b, a, dtype=torch.long)
    with torch.no_grad():
        plain = drafter.training_forward(dataclasses.replace(batch, anchors=anchors2))
        masked = obj.second_draft(batch, anchors2, carry, anchors2, rows)
        torch.testing.assert_close(masked.draft_logits, plain.draft_logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(masked.valid, plain.valid)
        rows[0, 1] = 2  # block (0, 1) reads two carryover rows
        carried = obj.second_draft(batch, anchors2, carry, anchors2, rows)
    diff = (carried.draft_logits - plain.draft_logits).abs().amax(dim=(1, 2)).view(b, a)
    assert diff[0, 1] > 1e-3
    diff[0, 1] = 0
    assert diff.max() < 1e-5, diff


@pytest.mark.parametrize("name", ["dspark", "dflash"])
def test_objective_trains_descends_its_loss_and_reaches_carry_embed(name, tiny_target, records):
    drafter = _drafter(tiny_target, name)
    obj = _objective(tiny_target, drafter, max_anchors=4, verify_chunk=4)
    batch = collate(records)
    batch.anchors = torch.tensor([[3, 6, 9, 12]] * 3)
    loss, out = obj(batch)
    loss.backward()
    assert drafter.carry_embed.grad is not None and drafter.carry_embed.grad.abs().sum() > 0
    assert drafter.backbone.fc.weight.grad.abs().sum() > 0
    assert {"carry_first_accepted", "carry_fraction", "carry_rows", "carry_blocks"} <= set(out.terms)
    assert 0 < float(out.terms["carry_fraction"]) <= 1 and 1 <= float(out.terms["carry_rows"]) <= drafter.max_speculative_tokens
    drafter.zero_grad()

    state = new_train_state(drafter, TrainConfig(lr=3e-3, warmup_steps=1), 10, seed=1, objective=obj)
    metrics = [first_step_descends(state, batch, seed=0)] + [train_step(state, batch) for _ in range(5)]
    losses = [m["train/loss"] for m in metrics]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert metrics[0]["train/carry_blocks"] > 0
    assert drafter.carry_embed.abs().sum() > 0  # E_carry is trained


def test_random_anchors_without_batch_anchors(tiny_target, records):
    drafter = _drafter(tiny_target, "dspark")
    obj = _objective(tiny_target, drafter, max_anchors=3)
    loss, out = obj(collate(records), torch.Generator().manual_seed(0))
    assert torch.isfinite(loss) and float(out.terms["carry_blocks"]) <= 3
    batch = collate(records)
    batch.anchors = torch.tensor([[-1, 19]] * 3)  # unused, and past every row's last prediction
    loss, out = obj(batch)
    assert float(loss.detach()) == 0.0 and float(out.terms["carry_blocks"]) == 0


def test_refuses_drafters_without_block_states_or_carry_embed(tiny_target):
    torch.manual_seed(0)
    eagle = build_drafter(DrafterConfig(name="eagle3", ttt_steps=2), tiny_target)
    with pytest.raises(DrafterError, match=r"objective 'carryover' needs capability block_internals; "
                                           r"drafter 'eagle3' \(Eagle3Drafter\)"):
        _objective(tiny_target, eagle)
    with pytest.raises(DrafterError, match=r"objective 'carryover' needs capability carryover; drafter 'dflash' "
                                           r".*drafter\.carryover=true"):
        _objective(tiny_target, _drafter(tiny_target, "dflash", carryover=False))
    with pytest.raises(DrafterError, match="ObjectiveContext.target is None"):
        build_objective("carryover", _drafter(tiny_target, "dflash"), build_loss("kl"))
    assert CarryoverObjective.drafter_overrides == {"carryover": True}


def test_verify_setting_is_checked_and_tree_only_for_declared_families(tiny_target):
    drafter = _drafter(tiny_target, "dflash")
    with pytest.raises(DrafterError, match=r"verify must be one of \['auto', 'tree', 'branches'\], got 'trie'"):
        _objective(tiny_target, drafter, verify="trie")
    other = copy.copy(tiny_target)  # the same target, as if its model were of an undeclared family
    other.model = copy.copy(tiny_target.model)
    other.model.config = copy.deepcopy(tiny_target.model.config)
    other.model.config.model_type = "gpt_neox"
    assert not tree_masks(other) and tree_masks(tiny_target)
    with pytest.raises(DrafterError, match=r"verify: tree needs a target whose attention takes a branch mask"):
        _objective(other, drafter, verify="tree")
    assert not _objective(other, drafter).tree and _objective(tiny_target, drafter).tree  # auto


def test_load_offline_checkpoint_with_carryover_override(tiny_target, tmp_path, records):
    offline = _drafter(tiny_target, "dspark", carryover=False)
    assert not hasattr(offline, "carry_embed")
    path = save_drafter(offline, tmp_path / "offline")
    drafter = load_drafter(path, tiny_target, overrides=dict(CarryoverObjective.drafter_overrides))
    assert drafter.cfg.carryover and drafter.carry_embed.shape == (len(drafter.layer_ids) * tiny_target.hidden_size,)
    assert not drafter.carry_embed.any()
    mine = drafter.state_dict()
    for key, value in offline.state_dict().items():
        assert torch.equal(mine[key], value), key
    _objective(tiny_target, drafter)  # usable by the objective
    with torch.no_grad():
        drafter.carry_embed.fill_(0.5)
    again = load_drafter(save_drafter(drafter, tmp_path / "carry"), tiny_target)  # round trip keeps E_carry
    assert again.cfg.carryover and torch.equal(again.carry_embed, drafter.carry_embed)


@pytest.mark.parametrize("layout", ["speculators", "native"])
def test_vllm_export_leaves_carry_embed_out_with_a_warning(tiny_target, layout, caplog):
    plain = _drafter(tiny_target, "dspark", carryover=False)
    carry = _drafter(tiny_target, "dspark")
    with torch.no_grad():
        carry.carry_embed.fill_(1.0)
    with caplog.at_level(logging.WARNING, logger="components.export.vllm"):
        config, tensors = vllm_export(carry, tiny_target, layout)
    assert "carry_embed" not in tensors and any("carry_embed" in r.getMessage() for r in caplog.records)
    plain_config, plain_tensors = vllm_export(plain, tiny_target, layout)
    assert set(tensors) == set(plain_tensors) and config == plain_config
    for key, value in plain_tensors.items():
        assert torch.equal(tensors[key], value), key
