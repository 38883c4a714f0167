"""Plain-Python reference implementations of every verification rule, one request at a time.

These are literal transcriptions of the algorithms (left-to-right loops over draft positions,
walks down the tree, the backward survival loop of block verification), with no batching
tricks (no cumprod / cummax / ancestor matrices). They consume the same explicit randomness
as the ``*_core`` fast paths (uniform coins, exponential races), so tests can check that the
fast paths agree with them sample for sample. Rows over the vocabulary use torch vector ops.

What this module does not know: batching, padding or devices beyond what the loops need.
Not for production use: it is slow on purpose.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "block_ref",
    "greedy_ref",
    "speculative_ref",
    "tree_rrs_ref",
    "tree_walk_ref",
]


def _race_sample(weights: Tensor, race: Tensor) -> int:
    """Categorical sample from weights [V] with exponential race [V]."""
    return int((weights / race).argmax())


def greedy_ref(draft: list[int], target_tokens: list[int]) -> tuple[int, int]:
    """Exact matching for one request: (num_accepted, next_token).

    draft: the request's real draft tokens; target_tokens: the target's choice per slot
    (at least len(draft) + 1 entries).
    """
    n = 0
    while n < len(draft) and draft[n] == target_tokens[n]:
        n += 1
    return n, target_tokens[n]


def speculative_ref(
    draft: list[int], p: Tensor, q: Tensor, coins: Tensor, race: Tensor
) -> tuple[int, int]:
    """Token-wise speculative sampling for one request.

    p: [L+1, V] target probs, q: [L, V] draft probs (L = len(draft)), coins [≥L], race [V].
    """
    for k, x in enumerate(draft):
        if not bool(coins[k] * q[k, x] < p[k, x]):  # accept w.p. min(1, p/q)
            residual = (p[k] - q[k]).clamp_min(0)
            if float(residual.sum()) <= 0:
                residual = p[k]
            return k, _race_sample(residual, race)
    return len(draft), _race_sample(p[len(draft)], race)


def block_ref(
    draft: list[int], p: Tensor, q: Tensor, coins: Tensor, race: Tensor
) -> tuple[int, int, list[float]]:
    """Block verification (Sun et al., 2024) for one request: (n, next_token, survival h_1..h_L).

    Running weights w_k = min(1, w_{k-1} p_k(x_k)/q_k(x_k)); survival of prefix length k is
    h_k = m_k / (m_k + 1 - w_k) with m_k = sum (w_k p_{k+1} - q_{k+1})+ (q ≡ 0 after the draft);
    try prefix lengths from longest to shortest, keep the first whose coin succeeds.
    """
    length = len(draft)
    w = [1.0]
    for k, x in enumerate(draft):
        ratio = float(p[k, x]) / max(float(q[k, x]), 1e-30)
        w.append(min(1.0, w[-1] * ratio))
    h = [1.0]
    for k in range(1, length + 1):
        if k == length:
            mass = w[k]
        else:
            mass = float((w[k] * p[k].double() - q[k].double()).clamp_min(0).sum())
        h.append(1.0 if w[k] >= 1.0 else mass / max(mass + 1.0 - w[k], 1e-30))
    n = 0
    for k in range(length, 0, -1):
        if float(coins[k - 1]) < h[k]:
            n = k
            break
    q_n = q[n].double() if n < length else torch.zeros_like(p[n], dtype=torch.float64)
    residual = (w[n] * p[n].double() - q_n).clamp_min(0)
    if float(residual.sum()) <= 0:
        residual = p[n].double()
    return n, _race_sample(residual.float(), race), h[1:]


def _children(parents: list[int], slot_node: int) -> list[int]:
    """Children of slot_node (-1 = root) in index order."""
    return [j for j, par in enumerate(parents) if par == slot_node]


def tree_walk_ref(
    tokens: list[int], parents: list[int], target_tokens: list[int]
) -> tuple[list[int], int]:
    """Exact-matching tree walk for one request: (accepted node path, next_token).

    target_tokens: the target's choice per slot (slot 0 = root, slot j+1 = after node j).
    """
    path: list[int] = []
    node = -1
    while True:
        choice = target_tokens[node + 1]
        nxt = [c for c in _children(parents, node) if tokens[c] == choice]
        if not nxt:
            return path, choice
        node = nxt[0]
        path.append(node)


def tree_rrs_ref(
    tokens: list[int], parents: list[int], p: Tensor, q: Tensor, coins: Tensor, race: Tensor
) -> tuple[list[int], int]:
    """Multi-draft recursive rejection sampling down a tree for one request.

    p, q: [N+1, V] per slot; coins [N] one per node; race [V]. Returns (path, next_token).
    """
    path: list[int] = []
    node = -1
    while True:
        slot = node + 1
        r = p[slot]
        moved = False
        for c in _children(parents, node):
            x = tokens[c]
            if bool(coins[c] * q[slot, x] < r[x]):
                node, moved = c, True
                path.append(c)
                break
            res = (r - q[slot]).clamp_min(0)
            mass = res.sum()
            if float(mass) > 0:
                r = res / mass
        if not moved:
            weights = r if float(r.sum()) > 0 else p[slot]
            return path, _race_sample(weights, race)
