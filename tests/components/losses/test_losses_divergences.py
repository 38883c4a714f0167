"""Properties of the per-token losses: LK limits, LK gradient identity, masks, temperature,
zero-probability targets, and the statistics a trainer logs."""

import math

import pytest
import torch

import components.losses as L


def grad(loss, x):
    return torch.autograd.grad(loss, x)[0]


def test_lk_hybrid_at_lambda_one_is_kl(batch):
    """η = 0 gives λ = 1 everywhere: value and gradient equal forward KL."""
    kw = {"valid": batch.valid, "weights": batch.weights}
    lk = L.lk_hybrid_loss(batch.target, batch.draft, eta=0.0, **kw)
    kl = L.kl_loss(batch.target, batch.draft, **kw)
    torch.testing.assert_close(lk.loss, kl.loss, rtol=0, atol=0)
    torch.testing.assert_close(grad(lk.loss, batch.draft), grad(kl.loss, batch.draft))
    assert float(lk.terms["lambda"]) == 1.0


@pytest.mark.parametrize("per_block", [False, True])
def test_lk_hybrid_approaches_tv_for_large_eta(batch, per_block):
    kw = {"valid": batch.valid, "weights": batch.weights}
    tv = L.tv_loss(batch.target, batch.draft, **kw)
    gaps = []
    for eta in (1.0, 10.0, 100.0, 1000.0):
        lk = L.lk_hybrid_loss(batch.target, batch.draft, eta=eta, per_block=per_block, **kw)
        gaps.append(abs(float(lk.loss.detach() - tv.loss.detach())))
    assert gaps == sorted(gaps, reverse=True) and gaps[0] > 1e-3
    assert gaps[-1] < 1e-12
    lk = L.lk_hybrid_loss(batch.target, batch.draft, eta=1000.0, per_block=per_block, **kw)
    torch.testing.assert_close(grad(lk.loss, batch.draft), grad(tv.loss, batch.draft))


def test_lk_lambda_is_per_position_batch_mean_and_detached(batch):
    alpha = L.acceptance_rate(batch.target, batch.draft)  # requires grad
    lam = L.lk_lambda(alpha, batch.valid, eta=2.0)
    assert lam.shape == (alpha.shape[1],) and not lam.requires_grad
    k = 1
    col = alpha[:, k][batch.valid[:, k]].detach()
    assert math.isclose(float(lam[k]), math.exp(-2.0 * float(col.mean())), rel_tol=1e-12)


def test_lk_likelihood_gradient_is_tv_gradient_over_alpha(make):
    """Survey line 486: ∇(−log α) = ∇TV / α, per position."""
    b = make(n=1, gamma=1, vocab=9, seed=3)
    g_lk = grad(L.lk_likelihood_loss(b.target, b.draft).loss, b.draft)
    g_tv = grad(L.tv_loss(b.target, b.draft).loss, b.draft)
    alpha = L.acceptance_rate(b.target, b.draft).detach()
    torch.testing.assert_close(g_lk, g_tv / alpha[..., None])


@pytest.mark.parametrize("fn", [L.kl_loss, L.tv_loss, L.lk_hybrid_loss, L.lk_likelihood_loss])
def test_masked_positions_contribute_nothing(fn, batch):
    invalid = ~batch.valid
    assert invalid.any()
    out = fn(batch.target, batch.draft, valid=batch.valid, weights=batch.weights)
    g = grad(out.loss, batch.draft)
    assert (g[invalid] == 0).all() and (g[batch.valid] != 0).any()
    noisy = batch.draft.detach().clone()
    noisy[invalid] = 50.0 * torch.randn_like(noisy[invalid])
    target = batch.target.clone()
    target[invalid] = -50.0
    again = fn(target, noisy, valid=batch.valid, weights=batch.weights)
    torch.testing.assert_close(again.loss, out.loss.detach(), rtol=1e-12, atol=1e-12)


def test_ce_ignores_padding_token_ids_at_masked_positions(batch):
    tokens = batch.tokens.clone()
    tokens[~batch.valid] = -100
    a = L.ce_loss(None, batch.draft, target_tokens=tokens, valid=batch.valid).loss
    b = L.ce_loss(None, batch.draft, target_tokens=batch.tokens, valid=batch.valid).loss
    torch.testing.assert_close(a, b)


def test_infinite_terms_at_masked_positions_do_not_leak(batch):
    """−inf draft logits at a masked position make its CE +inf for (almost) any label; that
    must not turn the loss or the gradient into NaN (0·inf)."""
    draft = batch.draft.detach().clone()
    n, k = (~batch.valid).nonzero()[0].tolist()
    draft[n, k, :-1] = -torch.inf
    draft.requires_grad_(True)
    out = L.ce_loss(None, draft, target_tokens=batch.tokens, valid=batch.valid)
    clean = L.ce_loss(None, batch.draft, target_tokens=batch.tokens, valid=batch.valid)
    torch.testing.assert_close(out.loss, clean.loss)
    assert torch.isfinite(grad(out.loss, draft)).all()


def test_temperature_divides_target_logits_only(batch):
    hot = L.kl_loss(batch.target, batch.draft, temperature=0.5).loss
    manual = L.kl_loss(batch.target / 0.5, batch.draft).loss
    torch.testing.assert_close(hot, manual)
    with pytest.raises(ValueError, match="temperature"):
        L.kl_loss(batch.target, batch.draft, temperature=0.0)


def test_kl_with_zero_probability_target_tokens_is_finite(batch):
    target = batch.target.clone()
    target[..., :2] = -torch.inf  # p = 0 on two tokens: 0·log 0 must count as 0
    out = L.kl_loss(target, batch.draft)
    g = grad(out.loss, batch.draft)
    assert torch.isfinite(out.loss) and torch.isfinite(g).all()


def test_no_gradient_reaches_target_logits(batch):
    target = batch.target.clone().requires_grad_(True)
    out = L.lk_hybrid_loss(target, batch.draft)
    assert not torch.autograd.grad(out.loss, batch.draft, retain_graph=True)[0].eq(0).all()
    assert target.grad is None
    out.loss.backward()
    assert target.grad is None


def test_logged_alpha_and_tau(batch):
    """α_k = mean over valid blocks of 1 − TV; τ = mean over blocks of 1 + Σ_k Π α (prefix)."""
    out = L.kl_loss(batch.target, batch.draft, valid=batch.valid)
    alpha = L.acceptance_rate(batch.target, batch.draft).detach()
    for k in range(alpha.shape[1]):
        col = alpha[:, k][batch.valid[:, k]]
        assert math.isclose(float(out.alpha[k]), float(col.mean()), rel_tol=1e-9)
    taus = []
    for n in range(alpha.shape[0]):
        prod, tau = 1.0, 1.0
        for k in range(alpha.shape[1]):
            if not batch.valid[n, k]:
                break
            prod *= float(alpha[n, k])
            tau += prod
        if batch.valid[n, 0]:
            taus.append(tau)
    assert math.isclose(float(out.tau), sum(taus) / len(taus), rel_tol=1e-9)
    metrics = out.metrics(prefix="train/")
    assert set(metrics) >= {"train/loss", "train/tau", "train/alpha/1", "train/per_position/4"}
    assert all(isinstance(v, float) for v in metrics.values())


def test_all_invalid_gives_zero_loss_and_no_nan(batch):
    none = torch.zeros_like(batch.valid)
    out = L.lk_likelihood_loss(batch.target, batch.draft, valid=none)
    assert float(out.loss.detach()) == 0.0
    assert (grad(out.loss, batch.draft) == 0).all()
    assert "alpha/1" not in out.metrics() and "tau" not in out.metrics()


def test_shape_errors_are_clear(batch):
    with pytest.raises(ValueError, match="same shape"):
        L.kl_loss(batch.target[:, :2], batch.draft)
    with pytest.raises(ValueError, match="valid mask"):
        L.kl_loss(batch.target, batch.draft, valid=batch.valid[:, :2])
    with pytest.raises(ValueError, match="position weights"):
        L.kl_loss(batch.target, batch.draft, weights=batch.weights[:2])
    with pytest.raises(ValueError, match="target_tokens"):
        L.ce_loss(batch.target, batch.draft)
