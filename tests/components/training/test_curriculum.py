"""The base-anchored curriculum (Domino): β's schedule, the loss it forms at both ends and in
between, where its gradient goes, the step hook the trainer calls, and who it refuses."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from components.config import DrafterConfig, TrainConfig
from components.drafters import build_drafter
from components.drafters.capabilities import CapabilityError
from components.losses import build_loss
from components.training import collate, new_train_state, train_step
from components.training.objectives import build_objective
from components.training.objectives.curriculum import curriculum_beta
from tests.components.training.test_training_steps import _record, first_step_descends

DOMINO = DrafterConfig(name="domino", block_size=4, num_anchors=8, markov_rank=8, num_layers=1)


@pytest.fixture(scope="module")
def batch(tiny_target):
    torch.manual_seed(0)
    ids = build_drafter(DOMINO, tiny_target).layer_ids
    return collate([_record(tiny_target, ids, n, 3, i, "float16") for i, n in enumerate([20, 16, 18])])


def domino(target):
    torch.manual_seed(0)
    d = build_drafter(DOMINO, target)
    with torch.no_grad():
        d.markov_head.w2.weight.normal_(0, 0.5)  # a correction that is on
    return d


def test_beta_falls_linearly_then_stays_zero():
    assert [curriculum_beta(s, 100, 0.5) for s in (0, 25, 50, 80)] == [1.0, 0.5, 0.0, 0.0]
    assert curriculum_beta(0, 100, 0.0) == 0.0 and curriculum_beta(99, 100, 1.0) == pytest.approx(0.01)


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_loss_mixes_the_drafts_and_the_backbone(tiny_target, batch, beta):
    d = domino(tiny_target)
    loss = build_loss("tv_ce_confidence")
    obj = build_objective("base_anchored", d, loss)
    obj.beta = beta
    got, out = obj(batch, torch.Generator().manual_seed(4))
    fwd = d.training_forward(batch, torch.Generator().manual_seed(4))  # same anchors
    main, base = loss(fwd.loss_inputs()).loss, loss(fwd.loss_inputs(base=True)).loss
    assert not torch.allclose(main, base)
    torch.testing.assert_close(got, (1 - beta) * main + beta * base)
    assert float(out.terms["curriculum_beta"]) == pytest.approx(beta) and ("base_loss" in out.terms) == (beta > 0)


def test_at_full_beta_the_head_gets_no_gradient(tiny_target, batch):
    """β = 1 trains the backbone alone: the correction (GRU, W1, W2) and the confidence head
    (which predicts the drafts' acceptance, q's, weighted 1 − β) get no gradient, the backbone does."""
    d = domino(tiny_target)
    obj = build_objective("base_anchored", d, build_loss("tv_ce_confidence"))
    obj.at_step(0, 10)
    loss, _ = obj(batch, torch.Generator().manual_seed(0))
    loss.backward()
    heads = [p.grad for p in [*d.markov_head.parameters(), *d.confidence_head.parameters()]]
    assert all(g is None or not g.any() for g in heads)
    assert d.backbone.fc.weight.grad.abs().sum() > 0


def test_trainer_moves_beta_with_the_steps(tiny_target, batch):
    d = domino(tiny_target)
    cfg = TrainConfig(lr=1e-3, weight_decay=0.0, warmup_steps=0)
    obj = build_objective("base_anchored", d, build_loss("tv_ce_confidence"), {"anneal_fraction": 0.5})
    state = new_train_state(d, cfg, 4, seed=0, objective=obj)
    first_step_descends(state, batch, seed=0)  # the first step descends the curriculum's loss
    betas = [train_step(state, batch)["train/curriculum_beta"] for _ in range(3)]
    assert betas == [0.5, 0.0, 0.0]  # steps 1, 2, 3 of 4, over the first 2


def test_refuses_a_drafter_without_base_logits(tiny_target):
    plain = build_drafter(dataclasses.replace(DOMINO, name="dflash"), tiny_target)
    with pytest.raises(CapabilityError, match=r"base_anchored.*base_logits.*dflash"):
        build_objective("base_anchored", plain, build_loss("kl"))
    with pytest.raises(ValueError, match="anneal_fraction"):
        build_objective("base_anchored", domino(tiny_target), build_loss("kl"), {"anneal_fraction": 2.0})
