"""Confidence head and DSpark mix: BCE target and gradient, the loss mix, required inputs."""

import pytest
import torch

import components.losses as L


def test_confidence_gradient_pulls_sigmoid_towards_acceptance(batch):
    """∂/∂c of the weighted-mean BCE is w·(σ(c) − (1 − TV)) / Σ w; nothing reaches the draft."""
    out = L.confidence_loss(
        batch.target,
        batch.draft,
        confidence_logits=batch.conf,
        valid=batch.valid,
        weights=batch.weights,
    )
    (g_conf,) = torch.autograd.grad(out.loss, batch.conf, retain_graph=True)
    alpha = L.acceptance_rate(batch.target, batch.draft).detach()
    w = batch.weights.expand_as(alpha) * batch.valid
    expected = w * (torch.sigmoid(batch.conf.detach()) - alpha) / w.sum()
    torch.testing.assert_close(g_conf, expected)
    assert not out.loss.grad_fn is None
    assert torch.autograd.grad(out.loss, batch.draft, allow_unused=True)[0] is None


def test_confidence_target_is_detached_inside_dspark(batch):
    """The BCE term alone must send no gradient into the draft logits."""
    only_conf = L.tv_ce_confidence_loss(
        batch.target,
        batch.draft,
        target_tokens=batch.tokens,
        confidence_logits=batch.conf,
        ce_weight=0.0,
        tv_weight=0.0,
    )
    g = torch.autograd.grad(only_conf.loss, batch.draft, allow_unused=True)[0]
    assert g is None or (g == 0).all()


def test_dspark_is_the_weighted_sum_of_its_terms(batch):
    kw = {"valid": batch.valid, "weights": batch.weights}
    out = L.tv_ce_confidence_loss(
        batch.target, batch.draft, target_tokens=batch.tokens, confidence_logits=batch.conf, **kw
    )
    ce = L.ce_loss(batch.target, batch.draft, target_tokens=batch.tokens, **kw).loss
    tv = L.tv_loss(batch.target, batch.draft, **kw).loss
    conf = L.confidence_loss(batch.target, batch.draft, confidence_logits=batch.conf, **kw).loss
    torch.testing.assert_close(out.loss, 0.1 * ce + 0.9 * tv + 1.0 * conf)
    torch.testing.assert_close(out.terms["ce"], ce.detach())
    torch.testing.assert_close(out.terms["tv"], tv.detach())
    torch.testing.assert_close(out.terms["confidence"], conf.detach())
    l1 = L.tv_ce_confidence_loss(
        batch.target,
        batch.draft,
        target_tokens=batch.tokens,
        confidence_logits=batch.conf,
        tv_as_l1=True,
        **kw,
    )
    torch.testing.assert_close(l1.loss - out.loss, 0.9 * tv)


def test_dspark_required_inputs():
    b_target, b_draft = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match="confidence_logits"):
        L.tv_ce_confidence_loss(b_target, b_draft, target_tokens=torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="target_tokens"):
        L.tv_ce_confidence_loss(b_target, b_draft, confidence_weight=0.0)
    out = L.tv_ce_confidence_loss(b_target, b_draft, ce_weight=0.0, confidence_weight=0.0)
    torch.testing.assert_close(out.loss, 0.9 * L.tv_loss(b_target, b_draft).loss)
    with pytest.raises(ValueError, match="confidence logits"):
        L.tv_ce_confidence_loss(b_target, b_draft, ce_weight=0.0, confidence_logits=torch.zeros(2, 4))


def test_dspark_masked_positions_contribute_nothing(batch):
    out = L.tv_ce_confidence_loss(
        batch.target,
        batch.draft,
        target_tokens=batch.tokens,
        confidence_logits=batch.conf,
        valid=batch.valid,
    )
    g_draft, g_conf = torch.autograd.grad(out.loss, (batch.draft, batch.conf))
    assert (g_draft[~batch.valid] == 0).all() and (g_conf[~batch.valid] == 0).all()
    assert (g_conf[batch.valid] != 0).all()
