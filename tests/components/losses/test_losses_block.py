"""E2E-TV and BV loss: single-position limits, the verifier's own definition by enumeration,
the E2E gradient identity with τ-gradient weights, and block truncation at masks."""

import itertools

import torch

import components.losses as L


def grad(loss, x):
    return torch.autograd.grad(loss, x)[0]


def test_bv_for_one_position_is_lk_likelihood(make):
    b = make(n=5, gamma=1, vocab=8, seed=4)
    bv = L.bv_loss(b.target, b.draft, target_tokens=b.tokens).loss
    lk = L.lk_likelihood_loss(b.target, b.draft).loss
    torch.testing.assert_close(bv, lk)
    torch.testing.assert_close(grad(bv, b.draft), grad(lk, b.draft))


def test_e2e_for_one_position_is_tv_minus_one(make):
    b = make(n=5, gamma=1, vocab=8, seed=5)
    e2e = L.e2e_tv_loss(b.target, b.draft).loss
    tv = L.tv_loss(b.target, b.draft).loss
    torch.testing.assert_close(e2e, tv - 1.0)
    torch.testing.assert_close(grad(e2e, b.draft), grad(tv, b.draft))


def block_verification_expected_accepted(p, q):
    """Σ_k E_{x~q}[w_k] by enumerating every draft, with w_k = min(1, w_{k−1} p_k/q_k)
    (survey lines 145–147): the verifier's own definition of the BV objective."""
    gamma, vocab = p.shape
    total = 0.0
    for x in itertools.product(range(vocab), repeat=gamma):
        prob_q, w, acc = 1.0, 1.0, 0.0
        for k, tok in enumerate(x):
            prob_q *= float(q[k, tok])
            w = min(1.0, w * float(p[k, tok] / q[k, tok]))
            acc += w
        total += prob_q * acc
    return total


def test_bv_prefix_terms_match_block_verification_by_enumeration(make):
    """E_{x~p}[Σ_k integrated term_k] over target blocks = Σ_k E_{x~q}[w_k] (survey line 525)."""
    gamma, vocab = 3, 4
    b = make(n=1, gamma=gamma, vocab=vocab, seed=6)
    log_p = torch.log_softmax(b.target[0], -1)  # [γ, V], same p, q for every enumerated block
    log_q = torch.log_softmax(b.draft[0].detach(), -1)
    seqs = torch.tensor(list(itertools.product(range(vocab), repeat=gamma)))  # [V^γ, γ]
    k = torch.arange(gamma)
    log_ratio = log_q[k, seqs] - log_p[k, seqs]
    n = seqs.shape[0]
    terms = L.bv_prefix_terms(log_p.expand(n, -1, -1), log_q.expand(n, -1, -1), log_ratio)
    prob_p = log_p[k, seqs].sum(1).exp()  # probability of each block under the target
    ours = float((prob_p * terms.exp().sum(1)).sum())
    expected = block_verification_expected_accepted(log_p.exp(), log_q.exp())
    assert abs(ours - expected) < 1e-12


def test_e2e_gradient_equals_tau_gradient_weighted_tv(make):
    """With detached ∂τ/∂α_k weights, Σ w·TV has exactly the E2E gradient (weights.py)."""
    b = make(n=4, gamma=5, vocab=7, seed=7)
    e2e = L.e2e_tv_loss(b.target, b.draft).loss
    alpha = L.acceptance_rate(b.target, b.draft)
    w = L.dpace_weights(alpha, per_block=True, normalize=False)
    tv = L.tv_terms(*(torch.softmax(x, -1) for x in (b.target, b.draft)))
    linear = (w * tv).sum() / alpha.shape[0]
    torch.testing.assert_close(grad(e2e, b.draft), grad(linear, b.draft))


def test_blocks_truncate_at_first_invalid_position(make):
    b = make(n=3, gamma=5, vocab=6, seed=8)
    valid = torch.ones(3, 5, dtype=torch.bool)
    valid[1, 2] = False  # a hole: positions 2.. of block 1 are out
    valid[2] = False  # an empty block: left out of the mean
    for fn in (L.e2e_tv_loss, L.bv_loss):
        kw = {"target_tokens": b.tokens} if fn is L.bv_loss else {}
        out = fn(b.target, b.draft, valid=valid, **kw)
        g = grad(out.loss, b.draft)
        assert (g[1, 2:] == 0).all() and (g[2] == 0).all()
        assert (g[1, :2] != 0).any() and (g[0] != 0).any()
        # same value as the two kept blocks with block 1 cut to its prefix
        cut = valid.clone()
        cut[1, 3:] = True  # holes after the first one change nothing
        again = fn(b.target, b.draft, valid=cut, **kw).loss
        torch.testing.assert_close(again, out.loss)
        two = fn(
            b.target[:2],
            b.draft[:2],
            valid=valid[:2],
            **({"target_tokens": b.tokens[:2]} if kw else {}),
        ).loss
        torch.testing.assert_close(two, out.loss)


def test_bv_is_finite_when_ratios_are_extreme(make):
    """Tokens the target finds unlikely give huge or tiny ratios; log space keeps it finite."""
    b = make(n=2, gamma=6, vocab=5, seed=9, scale=30.0)
    tokens = torch.zeros_like(b.tokens)  # arbitrary, often near-zero-probability tokens
    out = L.bv_loss(b.target, b.draft, target_tokens=tokens)
    g = grad(out.loss, b.draft)
    assert torch.isfinite(out.loss) and torch.isfinite(g).all()
    assert "bv_accepted" in out.terms and float(out.terms["bv_accepted"]) >= 0


def test_block_losses_count_every_position_when_draft_equals_target(make):
    """p = q: every α = 1 and every ratio = 1, so both count γ accepted tokens."""
    b = make(n=2, gamma=4, vocab=5, seed=10)
    same = b.target.clone().requires_grad_(True)
    e2e = L.e2e_tv_loss(b.target, same).loss
    bv = L.bv_loss(b.target, same, target_tokens=b.tokens).loss
    torch.testing.assert_close(e2e, torch.tensor(-4.0, dtype=e2e.dtype))
    torch.testing.assert_close(bv, -torch.log(torch.tensor(4.0, dtype=bv.dtype)))
