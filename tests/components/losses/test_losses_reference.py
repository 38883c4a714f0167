"""Every loss against a plainly written float64 reference: values and gradients w.r.t. the
draft logits (and the confidence logits for DSpark), with masks, position weights and a
temperature."""

import pytest
import torch

import components.losses as L

PER_TOKEN = {
    "ce": L.ce_loss,
    "kl": L.kl_loss,
    "tv": L.tv_loss,
    "lk_hybrid": L.lk_hybrid_loss,
    "lk_likelihood": L.lk_likelihood_loss,
}


def impl_and_ref(name, b, ref, weights, temperature):
    """(our loss, reference loss) for one registered loss name."""
    kw = {"valid": b.valid, "weights": weights, "temperature": temperature}
    if name in PER_TOKEN:
        extra = {"target_tokens": b.tokens} if name == "ce" else {}
        ours = PER_TOKEN[name](b.target, b.draft, **kw, **extra).loss
        return ours, ref.per_token(name, b.target, b.draft, b.tokens, b.valid, weights, temperature)
    if name == "lk_hybrid_block":
        ours = L.lk_hybrid_loss(b.target, b.draft, per_block=True, **kw).loss
        return ours, ref.per_token(name, b.target, b.draft, b.tokens, b.valid, weights, temperature)
    if name == "e2e_tv":
        ours = L.e2e_tv_loss(b.target, b.draft, **kw).loss
        return ours, ref.e2e_tv(b.target, b.draft, b.valid, weights, temperature)
    if name == "bv":
        ours = L.bv_loss(b.target, b.draft, target_tokens=b.tokens, **kw).loss
        return ours, ref.bv(b.target, b.draft, b.tokens, b.valid, weights, temperature)
    assert name == "tv_ce_confidence"
    ours = L.tv_ce_confidence_loss(
        b.target,
        b.draft,
        target_tokens=b.tokens,
        confidence_logits=b.conf,
        valid=b.valid,
        weights=weights,
    ).loss
    return ours, ref.dspark(b.target, b.draft, b.tokens, b.conf, b.valid, weights)


NAMES = [*PER_TOKEN, "lk_hybrid_block", "e2e_tv", "bv", "tv_ce_confidence"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("use_weights,temperature", [(False, 1.0), (True, 0.7)])
def test_value_and_gradient_match_reference(name, use_weights, temperature, batch, ref):
    if name == "tv_ce_confidence":
        temperature = 1.0
    weights = batch.weights if use_weights else None
    ours, theirs = impl_and_ref(name, batch, ref, weights, temperature)
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    inputs = (batch.draft, batch.conf) if name == "tv_ce_confidence" else (batch.draft,)
    g_ours = torch.autograd.grad(ours, inputs)
    g_ref = torch.autograd.grad(theirs, inputs)
    for a, b in zip(g_ours, g_ref, strict=True):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_float32_close_to_float64_reference(name, make, ref):
    b32 = make(seed=1, dtype=torch.float32)
    b64 = make(seed=1)
    ours, _ = impl_and_ref(name, b32, ref, b32.weights.float(), 1.0)
    _, theirs = impl_and_ref(name, b64, ref, b64.weights, 1.0)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours.double(), theirs.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_per_block_weights_match_reference_when_rows_are_equal(name, batch, ref):
    """[N, γ] weights with identical rows must equal [γ] weights."""
    rows = batch.weights.expand(batch.valid.shape[0], -1)
    a, _ = impl_and_ref(name, batch, ref, rows, 1.0)
    b, _ = impl_and_ref(name, batch, ref, batch.weights, 1.0)
    torch.testing.assert_close(a, b)
