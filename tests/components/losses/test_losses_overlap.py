"""The hand-written α/TV backward against plain autograd and finite differences."""

import torch

from components.losses.overlap import (
    alpha_tv_reference,
    log_overlap,
    log_overlap_reference,
    overlap_tv,
)


def inputs(seed=0, shape=(3, 4, 9)):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(shape, generator=g, dtype=torch.float64) * 2, -1)
    logits = (torch.randn(shape, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    g_alpha = torch.randn(shape[:2], generator=g, dtype=torch.float64)
    g_tv = torch.randn(shape[:2], generator=g, dtype=torch.float64)
    return p, logits, g_alpha, g_tv


def test_values_and_vector_jacobian_products_match_autograd():
    p, logits, g_alpha, g_tv = inputs()
    fast = overlap_tv(p, logits)
    slow = alpha_tv_reference(p, logits)
    for a, b in zip(fast, slow, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(fast[0] + fast[1], torch.ones_like(fast[0]))  # α = 1 − TV
    for ga, gt in [(g_alpha, g_tv), (g_alpha, 0 * g_tv), (0 * g_alpha, g_tv)]:
        (gf,) = torch.autograd.grad(fast, logits, (ga, gt), retain_graph=True)
        (gs,) = torch.autograd.grad(slow, logits, (ga, gt), retain_graph=True)
        torch.testing.assert_close(gf, gs, rtol=1e-10, atol=1e-14)


def test_gradcheck_and_single_output_use():
    p, logits, _, _ = inputs(seed=1, shape=(2, 2, 5))
    assert torch.autograd.gradcheck(lambda x: overlap_tv(p, x), (logits,))
    alpha = overlap_tv(p, logits)[0]  # the TV output unused: its gradient is zero-filled
    (g,) = torch.autograd.grad(alpha.sum(), logits)
    (ref,) = torch.autograd.grad(alpha_tv_reference(p, logits)[0].sum(), logits)
    torch.testing.assert_close(g, ref)


def test_exact_ties_have_zero_gradient_and_backward_can_repeat():
    """p == q bitwise: sign 0 everywhere, as abs' subgradient; min's ½ split cancels."""
    _, logits, g_alpha, g_tv = inputs(seed=2)
    same = logits.detach().clone().requires_grad_(True)
    p = torch.softmax(same.detach(), -1)
    out = overlap_tv(p, same)
    (g1,) = torch.autograd.grad(out, same, (g_alpha, g_tv), retain_graph=True)
    (g2,) = torch.autograd.grad(out, same, (g_alpha, g_tv))
    assert g1.abs().max() < 1e-12
    torch.testing.assert_close(g1, g2)
    (ref,) = torch.autograd.grad(alpha_tv_reference(p, same), same, (g_alpha, g_tv))
    torch.testing.assert_close(g1, ref, rtol=0, atol=1e-12)


def log_inputs(seed=3, shape=(3, 4, 9)):
    g = torch.Generator().manual_seed(seed)
    log_p = torch.log_softmax(torch.randn(shape, generator=g, dtype=torch.float64) * 2, -1)
    logits = torch.randn(shape, generator=g, dtype=torch.float64) * 2
    log_q = torch.log_softmax(logits, -1).detach().requires_grad_(True)
    shift_p = (-torch.rand(shape[:2], generator=g, dtype=torch.float64)).requires_grad_(True)
    shift_q = torch.randn(shape[:2], generator=g, dtype=torch.float64).requires_grad_(True)
    upstream = torch.randn(shape[:2], generator=g, dtype=torch.float64)
    return log_p, log_q, shift_p, shift_q, upstream


def test_log_overlap_matches_autograd_with_and_without_shifts():
    log_p, log_q, shift_p, shift_q, upstream = log_inputs()
    for shifts in [(None, None), (shift_p, shift_q)]:
        fast = log_overlap(log_p, log_q, *shifts)
        slow = log_overlap_reference(log_p, log_q, *shifts)
        torch.testing.assert_close(fast, slow, rtol=1e-12, atol=1e-14)
        wrt = [log_q] + [s for s in shifts if s is not None]
        g_fast = torch.autograd.grad(fast, wrt, upstream)
        g_slow = torch.autograd.grad(slow, wrt, upstream)
        for a, b in zip(g_fast, g_slow, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)


def test_log_overlap_gradcheck_including_log_p():
    log_p, log_q, shift_p, shift_q, _ = log_inputs(seed=4, shape=(2, 2, 5))
    log_p = log_p.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(log_overlap, (log_p, log_q, shift_p, shift_q))


def test_log_overlap_ties_split_like_torch_minimum():
    log_p, _, shift_p, _, upstream = log_inputs(seed=5)
    log_q = log_p.clone().requires_grad_(True)  # a == b everywhere
    shift_q = shift_p.detach().clone().requires_grad_(True)
    fast = log_overlap(log_p, log_q, shift_p, shift_q)
    slow = log_overlap_reference(log_p, log_q, shift_p, shift_q)
    for a, b in zip(
        torch.autograd.grad(fast, (log_q, shift_p, shift_q), upstream),
        torch.autograd.grad(slow, (log_q, shift_p, shift_q), upstream),
        strict=True,
    ):
        torch.testing.assert_close(a, b)
