"""Statistical losslessness: emitted tokens follow the (processed) target distribution.

Chi-square tests with a seeded generator and a strict critical value (z = 4 in the
Wilson-Hilferty approximation, p ≈ 3e-5), plus a negative control that a broken rule fails.
Single-round tests check the first emitted token over vocabularies and sampling settings;
multi-round tests run a Markov target/drafter pair and check the joint of the first three
tokens, which covers recovered and bonus tokens and the stitching of rounds.
"""

import math

import pytest
import torch

from components.spec.gumbel import gumbel_argmax, gumbel_noise
from components.spec.sampling import SamplingParams, probs_from_logits
from components.spec.tree_verify import verify_tree_sampling
from components.spec.verify import (
    emitted_tokens,
    verify_block,
    verify_speculative,
    verify_speculative_core,
)


def chi_square_ok(samples: torch.Tensor, probs: torch.Tensor, z: float = 4.0) -> tuple[bool, float, float]:
    """Goodness of fit of integer samples [n] to probs [K]; cells with expected < 5 are merged.

    Returns (passes, statistic, critical value). A sample in a zero-probability cell fails.
    """
    k = probs.numel()
    counts = torch.bincount(samples, minlength=k).double()
    expected = probs.double() * samples.numel()
    if counts[expected == 0].sum() > 0:
        return False, math.inf, 0.0
    small = (expected > 0) & (expected < 5)
    big = expected >= 5
    obs = torch.cat([counts[big], counts[small].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[small].sum().reshape(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    if df == 0:  # a single cell: every sample landed there (zero-probability cells checked above)
        return True, stat, 0.0
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat <= crit, stat, crit


def _random_pq(bsz, gamma, vocab, params_p, params_q, gen):
    """Processed target p [B, γ+1, V] (one shared distribution per slot) and drafter q [B, γ, V]."""
    lp = torch.randn(1, gamma + 1, vocab, generator=gen) * 1.5
    lq = lp[:, :gamma] + torch.randn(1, gamma, vocab, generator=gen)
    p = probs_from_logits(lp, params_p).expand(bsz, -1, -1)
    q = probs_from_logits(lq, params_q).expand(bsz, -1, -1)
    return p, q


def _sample_drafts(q: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    bsz, gamma, vocab = q.shape
    return torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).view(bsz, gamma)


SETTINGS = [
    (SamplingParams(1.0), SamplingParams(1.0)),
    (SamplingParams(0.6), SamplingParams(1.3)),
    (SamplingParams(1.7, top_k=3), SamplingParams(1.0, top_p=0.8)),
    (SamplingParams(1.0, top_p=0.7), SamplingParams(0.5, top_k=2)),
]


@pytest.mark.parametrize("rule", [verify_speculative, verify_block])
@pytest.mark.parametrize("vocab", [4, 16, 64])
@pytest.mark.parametrize("setting", range(len(SETTINGS)))
def test_chain_first_token_follows_processed_target(rule, vocab, setting):
    gen = torch.Generator().manual_seed(1000 * vocab + setting)
    bsz, gamma = 10000, 3
    p, q = _random_pq(bsz, gamma, vocab, *SETTINGS[setting], gen)
    drafts = _sample_drafts(q, gen)
    lens = torch.randint(0, gamma + 1, (bsz,), generator=gen)
    res = rule(drafts, lens, p, q, gen)
    first = emitted_tokens(res, drafts)[:, 0]
    ok, stat, crit = chi_square_ok(first, p[0, 0])
    assert ok, (stat, crit)


def test_negative_control_wrong_residual_is_detected():
    """Sampling the recovered token from p instead of (p - q)+ must fail the same test."""
    gen = torch.Generator().manual_seed(7)
    bsz, gamma, vocab = 10000, 2, 16
    p, q = _random_pq(bsz, gamma, vocab, SamplingParams(), SamplingParams(), gen)
    drafts = _sample_drafts(q, gen)
    lens = torch.full((bsz,), gamma)
    coins = torch.rand(bsz, gamma, generator=gen)
    race = torch.empty(bsz, vocab).exponential_(generator=gen)
    res = verify_speculative_core(drafts, lens, p, q, coins, race)
    wrong_next = (p[:, 0] / race).argmax(-1)  # p instead of the residual
    first = torch.where(res.num_accepted > 0, drafts[:, 0], wrong_next)
    assert not chi_square_ok(first, p[0, 0])[0]


def _tree_shape():
    """Root with two children, each with two children: N = 6, parents in topological order."""
    return torch.tensor([-1, -1, 0, 0, 1, 1])


@pytest.mark.parametrize("vocab", [4, 16, 64])
@pytest.mark.parametrize("deterministic", [False, True])
def test_tree_first_token_follows_target(vocab, deterministic):
    gen = torch.Generator().manual_seed(vocab + 17 * deterministic)
    bsz = 10000
    parents = _tree_shape().expand(bsz, -1)
    n = parents.shape[1]
    p = torch.randn(1, n + 1, vocab, generator=gen).mul(1.5).softmax(-1).expand(bsz, -1, -1)
    q = torch.randn(1, n + 1, vocab, generator=gen).mul(1.5).softmax(-1).expand(bsz, -1, -1)
    if deterministic:  # fixed candidates: the drafter's top tokens, same in every row
        top = q[0].topk(2, dim=-1).indices  # [N+1, 2]
        tokens = torch.cat([top[0], top[1], top[2]]).expand(bsz, -1)
        draft_probs = None
    else:  # children of slot s are i.i.d. samples of q[:, s]
        slot = parents + 1
        rows = q[torch.arange(bsz)[:, None], slot].reshape(-1, vocab)
        tokens = torch.multinomial(rows, 1, generator=gen).view(bsz, n)
        draft_probs = q
    res = verify_tree_sampling(tokens, parents, p, draft_probs, generator=gen)
    first_node = res.path[:, 0].clamp_min(0)
    first = torch.where(res.num_accepted > 0, tokens.gather(1, first_node[:, None]).squeeze(1),
                        res.next_token)
    ok, stat, crit = chi_square_ok(first, p[0, 0])
    assert ok, (stat, crit)


def test_hashed_gumbel_max_samples_follow_p_jointly_over_positions():
    """argmax(log p + g(seed, t)) ~ p, independently at neighbouring positions."""
    gen = torch.Generator().manual_seed(11)
    vocab, bsz = 6, 12000
    log_p = torch.randn(vocab, generator=gen).log_softmax(-1)
    seeds = torch.randint(0, 2**40, (bsz,), generator=gen)
    x = gumbel_argmax(log_p, gumbel_noise(seeds, torch.tensor([[7, 8]]).expand(bsz, -1), vocab))
    p = log_p.exp()
    ok, stat, crit = chi_square_ok(x[:, 0] * vocab + x[:, 1], (p[:, None] * p[None, :]).reshape(-1))
    assert ok, (stat, crit)


# ---------- multi-round: Markov target P[prev] and drafter Q[prev] ----------------------------

V_MARKOV = 5


def _markov_pair(gen):
    """Transition matrices mixed with uniform, so every 3-token path has a visible probability."""
    P = 0.7 * torch.randn(V_MARKOV, V_MARKOV, generator=gen).mul(2).softmax(-1) + 0.3 / V_MARKOV
    Q = torch.randn(V_MARKOV, V_MARKOV, generator=gen).mul(2).softmax(-1)
    return P, Q


def _chain_round(rule):
    def round_fn(last, P, Q, gen):
        bsz, gamma = last.shape[0], 3
        lens = torch.randint(0, gamma + 1, (bsz,), generator=gen)
        prev, drafts, qs, ps = last, [], [], [P[last]]
        for _ in range(gamma):
            x = torch.multinomial(Q[prev], 1, generator=gen).squeeze(1)
            drafts.append(x)
            qs.append(Q[prev])
            ps.append(P[x])
            prev = x
        d = torch.stack(drafts, 1)
        res = rule(d, lens, torch.stack(ps, 1), torch.stack(qs, 1), gen)
        return emitted_tokens(res, d), res.num_accepted + 1

    return round_fn


def _tree_round(deterministic):
    def round_fn(last, P, Q, gen):
        bsz = last.shape[0]
        parents = _tree_shape().expand(bsz, -1)
        if deterministic:
            kids = Q[last].topk(2, dim=-1).indices
            grand = Q[kids.reshape(-1)].topk(2, dim=-1).indices.view(bsz, 4)
        else:
            kids = torch.multinomial(Q[last], 2, replacement=True, generator=gen)
            grand = torch.multinomial(Q[kids.reshape(-1)], 2, replacement=True, generator=gen)
            grand = grand.view(bsz, 4)
        tokens = torch.cat([kids, grand], 1)
        slots = torch.cat([last[:, None], tokens], 1)  # token whose successor each slot predicts
        q = None if deterministic else Q[slots]
        res = verify_tree_sampling(tokens, parents, P[slots], q, generator=gen)
        out = torch.full((bsz, 4), -1, dtype=torch.long)
        on_path = torch.arange(3)[None, :] < res.num_accepted[:, None]
        out[:, :3] = torch.where(on_path, tokens.gather(1, res.path[:, :3].clamp_min(0)), -1)
        out = out.scatter(1, res.num_accepted[:, None], res.next_token[:, None])
        return out, res.num_accepted + 1

    return round_fn


def _run_rounds(round_fn, P, Q, bsz, num_tokens, gen):
    last = torch.zeros(bsz, dtype=torch.long)
    width = num_tokens + 8
    out = torch.full((bsz, width + 1), -1, dtype=torch.long)
    count = torch.zeros(bsz, dtype=torch.long)
    while int(count.min()) < num_tokens:
        emitted, n = round_fn(last, P, Q, gen)
        cols = count[:, None] + torch.arange(emitted.shape[1])[None, :]
        ok = (torch.arange(emitted.shape[1])[None, :] < n[:, None]) & (cols < width)
        out.scatter_(1, torch.where(ok, cols, width), emitted)
        last = emitted.gather(1, (n - 1)[:, None]).squeeze(1)
        count += n
    return out[:, :num_tokens]


@pytest.mark.parametrize("name,round_fn", [
    ("speculative", _chain_round(verify_speculative)),
    ("block", _chain_round(verify_block)),
    ("tree_rrs", _tree_round(deterministic=False)),
    ("tree_deterministic", _tree_round(deterministic=True)),
])
def test_multi_round_joint_of_three_tokens(name, round_fn):
    gen = torch.Generator().manual_seed(len(name))
    P, Q = _markov_pair(gen)
    seq = _run_rounds(round_fn, P, Q, 20000, 3, gen)
    v = V_MARKOV
    index = seq[:, 0] * v * v + seq[:, 1] * v + seq[:, 2]
    joint = (P[0][:, None, None] * P[:, :, None] * P[None, :, :]).reshape(-1)
    ok, stat, crit = chi_square_ok(index, joint)
    assert ok, (name, stat, crit)
