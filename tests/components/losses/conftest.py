"""Reference formulas for the loss tests, written plainly: float64, explicit loops over blocks
and positions, probabilities instead of log-probabilities, Σ min(p, q) instead of ½ Σ |p − q|.

They share no code with components.losses, so a test that compares the two can fail."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor


def softmax(x: Tensor) -> Tensor:  # [V] -> [V]
    e = torch.exp(x - x.max())
    return e / e.sum()


def overlap(p: Tensor, q: Tensor) -> Tensor:  # [V], [V] -> []  α = Σ min(p, q)
    return torch.minimum(p, q).sum()


def dists(target: Tensor, draft: Tensor, n: int, k: int, temperature: float):
    return softmax(target[n, k].detach() / temperature), softmax(draft[n, k])


def weight(weights: Tensor | None, n: int, k: int) -> float:
    if weights is None:
        return 1.0
    return float(weights[k] if weights.dim() == 1 else weights[n, k])


def reduce(values: dict, weights: Tensor | None) -> Tensor:
    """Σ w_k l_nk / Σ w_k over the (n, k) keys of `values` (the valid positions)."""
    num, den = 0.0, 0.0
    for (n, k), v in values.items():
        w = weight(weights, n, k)
        num, den = num + w * v, den + w
    return num / den


def per_token(kind: str, target, draft, tokens, valid, weights, temperature=1.0, eta=3.0):
    """CE, KL, TV, LK hybrid (λ from the batch mean α, or per block for "lk_hybrid_block")
    or LK likelihood, weighted mean over valid positions."""
    N, G, _ = draft.shape
    alpha_bar = []  # mean α per position over valid blocks, as a python float (stop-grad)
    for k in range(G):
        a = [
            float(overlap(*dists(target, draft.detach(), n, k, temperature)))
            for n in range(N)
            if valid[n, k]
        ]
        alpha_bar.append(sum(a) / len(a) if a else 0.0)
    values = {}
    for n in range(N):
        for k in range(G):
            if not valid[n, k]:
                continue
            p, q = dists(target, draft, n, k, temperature)
            kl = (p * torch.log(p / q)).sum()
            tv = 1.0 - overlap(p, q)
            lam = math.exp(-eta * alpha_bar[k])
            lam_block = math.exp(-eta * float(overlap(p, q).detach()))
            values[(n, k)] = {
                "ce": -torch.log(q[tokens[n, k]]),
                "kl": kl,
                "tv": tv,
                "lk_hybrid": lam * kl + (1.0 - lam) * tv,
                "lk_hybrid_block": lam_block * kl + (1.0 - lam_block) * tv,
                "lk_likelihood": -torch.log(overlap(p, q)),
            }[kind]
    return reduce(values, weights)


def e2e_tv(target, draft, valid, weights=None, temperature=1.0):
    """−Σ_k Π_{i≤k} (1 − TV_i) per block (stop at the first invalid position), block mean."""
    losses = []
    for n in range(draft.shape[0]):
        prod, total = 1.0, 0.0
        for k in range(draft.shape[1]):
            if not valid[n, k]:
                break
            prod = prod * overlap(*dists(target, draft, n, k, temperature))
            total = total + weight(weights, n, k) * prod
        if valid[n, 0]:
            losses.append(-total)
    return sum(losses) / len(losses)


def bv(target, draft, tokens, valid, weights=None, temperature=1.0):
    """−log Σ_k Σ_x min(m_{k−1} p_k(x), R_{k−1} q_k(x)) with running ratio R and min m."""
    losses = []
    for n in range(draft.shape[0]):
        m, big_r, total = 1.0, 1.0, 0.0
        for k in range(draft.shape[1]):
            if not valid[n, k]:
                break
            p, q = dists(target, draft, n, k, temperature)
            w = weight(weights, n, k)
            total = total + w * torch.minimum(m * p, big_r * q).sum()
            big_r = big_r * q[tokens[n, k]] / p[tokens[n, k]]
            m = torch.minimum(torch.as_tensor(m, dtype=q.dtype), big_r)
        if valid[n, 0]:
            losses.append(-torch.log(total))
    return sum(losses) / len(losses)


def dspark(target, draft, tokens, conf, valid, weights, ce_w=0.1, tv_w=0.9, conf_w=1.0):
    """ce_w·CE + tv_w·TV + conf_w·BCE(σ(c), 1 − TV) per position, weighted mean."""
    values = {}
    for n in range(draft.shape[0]):
        for k in range(draft.shape[1]):
            if not valid[n, k]:
                continue
            p, q = dists(target, draft, n, k, 1.0)
            tv = 1.0 - overlap(p, q)
            c_star = float((1.0 - tv).detach())
            s = torch.sigmoid(conf[n, k])
            bce = -(c_star * torch.log(s) + (1.0 - c_star) * torch.log(1.0 - s))
            values[(n, k)] = ce_w * -torch.log(q[tokens[n, k]]) + tv_w * tv + conf_w * bce
    return reduce(values, weights)


@pytest.fixture
def ref() -> SimpleNamespace:
    return SimpleNamespace(
        softmax=softmax, overlap=overlap, per_token=per_token, e2e_tv=e2e_tv, bv=bv, dspark=dspark
    )


def make_batch(n=3, gamma=4, vocab=6, seed=0, dtype=torch.float64, scale=1.5):
    """Random logits, tokens drawn from the target, a valid mask with holes, weights."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(n, gamma, vocab, generator=g, dtype=torch.float64) * scale
    draft = torch.randn(n, gamma, vocab, generator=g, dtype=torch.float64) * scale
    tokens = torch.multinomial(torch.softmax(target.reshape(-1, vocab), -1), 1, generator=g)
    valid = torch.rand(n, gamma, generator=g) > 0.25
    valid[0] = True  # at least one full block
    weights = torch.rand(gamma, generator=g, dtype=torch.float64) + 0.5
    conf = torch.randn(n, gamma, generator=g, dtype=torch.float64)
    return SimpleNamespace(
        target=target.to(dtype),
        draft=draft.to(dtype).requires_grad_(True),
        tokens=tokens.reshape(n, gamma),
        valid=valid,
        weights=weights,
        conf=conf.to(dtype).requires_grad_(True),
    )


@pytest.fixture
def batch() -> SimpleNamespace:
    return make_batch()


@pytest.fixture
def make():
    """The batch factory, for tests that need other sizes, seeds or dtypes."""
    return make_batch
