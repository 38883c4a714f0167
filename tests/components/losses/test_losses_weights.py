"""Position weights: fixed decay values, D-PACE weights (definition, detachment, shapes)."""

import math

import pytest
import torch

import components.losses as L


def test_decay_values_and_shape():
    w = L.decay_weights(16, kappa=7.0)
    assert w.shape == (16,) and w.dtype == torch.float32
    assert float(w[0]) == 1.0
    assert math.isclose(float(w[7]), math.exp(-1.0), rel_tol=1e-6)
    expected = torch.tensor([math.exp(-(k - 1) / 7.0) for k in range(1, 17)])
    torch.testing.assert_close(w, expected)
    assert (L.decay_weights(4, kappa=math.inf) == 1).all()
    assert L.decay_weights(3, dtype=torch.float64).dtype == torch.float64


def test_decay_rejects_bad_arguments():
    with pytest.raises(ValueError, match="gamma"):
        L.decay_weights(0)
    with pytest.raises(ValueError, match="kappa"):
        L.decay_weights(4, kappa=0.0)


def tau(alpha):  # [γ] -> []  the surrogate 1 + Σ_k Π_{i≤k} α_i
    return 1.0 + torch.cumprod(alpha, 0).sum()


def test_dpace_tau_grad_is_the_gradient_of_the_tau_surrogate():
    alpha = torch.tensor([0.9, 0.3, 0.8, 0.05, 0.6], dtype=torch.float64, requires_grad=True)
    expected = torch.autograd.grad(tau(alpha), alpha)[0]
    w = L.dpace_weights(alpha, normalize=False)
    torch.testing.assert_close(w, expected)
    assert not w.requires_grad


def test_dpace_survival_is_probability_of_reaching_position():
    alpha = torch.tensor([0.9, 0.5, 0.8, 0.4], dtype=torch.float64)
    w = L.dpace_weights(alpha, mode="survival", normalize=False)
    torch.testing.assert_close(w, torch.tensor([1.0, 0.9, 0.45, 0.36], dtype=torch.float64))


def test_dpace_constant_alpha_decays_like_alpha_power():
    """Survey line 515: for a constant α the weight decays roughly as α^(k−1)."""
    w = L.dpace_weights(torch.full((16,), 0.87), normalize=False)
    assert (w[1:] < w[:-1]).all()
    ratio = w[1:8] / w[:7]
    assert ((ratio > 0.8) & (ratio < 0.87)).all()


def test_dpace_shapes_normalisation_and_masked_mean():
    g = torch.Generator().manual_seed(0)
    alpha = torch.rand(6, 5, generator=g, requires_grad=True)
    valid = torch.rand(6, 5, generator=g) > 0.3
    w = L.dpace_weights(alpha, valid)
    assert w.shape == (5,) and not w.requires_grad
    torch.testing.assert_close(w.mean(), torch.tensor(1.0))
    means = torch.stack([alpha[:, k][valid[:, k]].mean() for k in range(5)]).detach()
    torch.testing.assert_close(w, L.dpace_weights(means))
    per_block = L.dpace_weights(alpha, valid, per_block=True)
    assert per_block.shape == (6, 5)
    torch.testing.assert_close(per_block.mean(-1), torch.ones(6))


def test_dpace_is_finite_for_zero_acceptance_and_rejects_bad_input():
    w = L.dpace_weights(torch.tensor([0.0, 0.0, 1.0]))
    assert torch.isfinite(w).all() and float(w[0]) > float(w[1])
    with pytest.raises(ValueError, match="mode"):
        L.dpace_weights(torch.rand(3), mode="nope")
    with pytest.raises(ValueError, match="per_block"):
        L.dpace_weights(torch.rand(3), per_block=True)


def test_losses_treat_position_weights_as_constants(batch):
    """Weights computed from the draft's own α (with a graph) must act as constants."""
    alpha = L.acceptance_rate(batch.target, batch.draft)
    live = torch.exp(-3.0 * alpha.mean(0))  # [γ], requires grad
    assert live.requires_grad
    kw = {"valid": batch.valid}
    g1 = torch.autograd.grad(
        L.tv_loss(batch.target, batch.draft, weights=live, **kw).loss, batch.draft
    )
    g2 = torch.autograd.grad(
        L.tv_loss(batch.target, batch.draft, weights=live.detach(), **kw).loss, batch.draft
    )
    torch.testing.assert_close(g1[0], g2[0])
