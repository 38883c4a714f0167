"""Token trees: best-first builders and the flattened layout a decoding engine verifies.

A tree continues the last verified token (the *root*, which is not a node). Nodes are stored
in topological order (every parent before its children), which both builders guarantee:

* ``tokens [N]``  -- the drafted token of each node;
* ``parents [N]`` -- index of the parent node, ``-1`` for children of the root;
* ``depths [N]``  -- 1 for children of the root; also the node's position id relative to the
  root (the engine adds the root's absolute position);
* ``scores [N]``  -- the drafter's log-probability of the root-to-node path.

Builders:

* ``build_best_first_tree`` -- DDTree (Ringel & Romano, 2026): per-depth marginals of a parallel
  drafter, path score = sum of marginal log-probs, best-first expansion up to a node budget;
* ``build_causal_trees`` -- DominoTree-style (Lin & Jang, 2026): the same best-first search, but
  each node's children are scored by a causal head evaluated on that node's own path,
  restricted to the top-M candidates of the backbone at the child depth.

Flattening (``flatten_trees``) pads a batch of trees to one node count and adds the
ancestor-only attention mask ``[B, N, N]`` (a node attends to itself and its ancestors; the
engine lets every node also attend to the root and the context).

What this module does not know: models, the verification rule (see ``tree_verify.py``) and
how the engine lays out the root and the KV cache. The builders are host-side best-first
searches (a heap over at most ``budget`` nodes, never over the vocabulary).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "CausalHead",
    "FlatTree",
    "TokenTree",
    "ancestor_mask",
    "build_best_first_tree",
    "build_best_first_trees",
    "build_causal_trees",
    "flatten_trees",
]

# (paths [n, γ+1] long: root token then the node's path, zero padded;
#  depth [n] long: number of path tokens after the root;
#  candidates [n, M] long: candidate tokens for the child at depth+1)
# -> [n, M] log-probabilities of each candidate as that child (≤ 0).
CausalHead = Callable[[Tensor, Tensor, Tensor], Tensor]


@dataclass
class TokenTree:
    """One request's token tree, nodes in topological order."""

    tokens: Tensor   # [N] long, drafted token per node
    parents: Tensor  # [N] long, parent node index, -1 for children of the root
    depths: Tensor   # [N] long, 1 for children of the root
    scores: Tensor   # [N] float, drafter log-probability of the root-to-node path


@dataclass
class FlatTree:
    """A batch of trees padded to N nodes, as the target's verification pass consumes it."""

    tokens: Tensor          # [B, N] long, padding 0
    parents: Tensor         # [B, N] long, -1 for root children and padding
    position_ids: Tensor    # [B, N] long, depth relative to the root (padding 0)
    attention_mask: Tensor  # [B, N, N] bool, [b, i, j] = j is i or an ancestor of i
    num_nodes: Tensor       # [B] long, real nodes per tree (the first num_nodes[b])
    scores: Tensor          # [B, N] float, path log-probabilities (padding -inf)


def ancestor_mask(parents: Tensor) -> Tensor:
    """Ancestor-or-self mask [..., N, N] bool from parents [..., N] (-1 = root child).

    Reachability by repeated squaring of (I | parent edges): ceil(log2 N) boolean matmuls,
    no data-dependent loop, works for any node order.
    """
    n = parents.shape[-1]
    edge = torch.nn.functional.one_hot(parents.clamp_min(0), n).bool() & (parents >= 0)[..., None]
    reach = edge | torch.eye(n, dtype=torch.bool, device=parents.device)
    for _ in range(max(1, math.ceil(math.log2(max(n, 2))))):
        r = reach.float()
        reach = (r @ r) > 0
    return reach


def flatten_trees(trees: Sequence[TokenTree], num_nodes: int | None = None) -> FlatTree:
    """Pad trees to a common node count (default: the largest) and build their masks."""
    n = num_nodes if num_nodes is not None else max(int(t.tokens.numel()) for t in trees)
    bsz = len(trees)
    device = trees[0].tokens.device
    tokens = torch.zeros(bsz, n, dtype=torch.long, device=device)
    parents = torch.full((bsz, n), -1, dtype=torch.long, device=device)
    depths = torch.zeros(bsz, n, dtype=torch.long, device=device)
    scores = torch.full((bsz, n), float("-inf"), device=device)
    counts = torch.tensor([int(t.tokens.numel()) for t in trees], device=device)
    for b, t in enumerate(trees):
        k = int(t.tokens.numel())
        tokens[b, :k], parents[b, :k], depths[b, :k] = t.tokens, t.parents, t.depths
        scores[b, :k] = t.scores.float()
    return FlatTree(tokens, parents, depths, ancestor_mask(parents), counts, scores)


class _BestFirst:
    """Best-first search state for one request: pops nodes in non-increasing path score.

    Children of an expanded node are given as (log-probs sorted descending, tokens). Popping a
    node pushes its next sibling; expanding it pushes its best child. Since log-probs are ≤ 0
    and siblings are sorted, no node can score above its parent or its previous sibling, so
    nodes leave the heap in order and every parent leaves before its children.
    """

    def __init__(self, budget: int, max_depth: int) -> None:
        self.budget, self.max_depth = budget, max_depth
        self.heap: list[tuple[float, int, int, int]] = []  # (-score, tiebreak, parent, rank)
        self.children: dict[int, tuple[list[float], list[int]]] = {}
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.scores: list[float] = []
        self._tick = 0

    def score(self, node: int) -> float:
        return 0.0 if node < 0 else self.scores[node]

    def depth(self, node: int) -> int:
        return 0 if node < 0 else self.depths[node]

    def _push(self, parent: int, rank: int) -> None:
        logps, _ = self.children[parent]
        if rank < len(logps) and logps[rank] > float("-inf"):
            self._tick += 1
            heapq.heappush(self.heap, (-(self.score(parent) + logps[rank]), self._tick, parent, rank))

    def expand(self, node: int, logps: list[float], tokens: list[int]) -> None:
        self.children[node] = (logps, tokens)
        self._push(node, 0)

    def done(self) -> bool:
        return len(self.tokens) >= self.budget or not self.heap

    def pop(self) -> int:
        """Take the best frontier node into the tree; returns its index."""
        neg, _, parent, rank = heapq.heappop(self.heap)
        self.tokens.append(self.children[parent][1][rank])
        self.parents.append(parent)
        self.depths.append(self.depth(parent) + 1)
        self.scores.append(-neg)
        self._push(parent, rank + 1)
        return len(self.tokens) - 1

    def wants_children(self, node: int) -> bool:
        return self.depths[node] < self.max_depth and len(self.tokens) < self.budget

    def path(self, node: int) -> list[int]:
        out: list[int] = []
        while node >= 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return out[::-1]

    def to_tree(self, device: torch.device) -> TokenTree:
        def t(x: list, dtype: torch.dtype) -> Tensor:
            return torch.tensor(x, dtype=dtype, device=device)

        return TokenTree(t(self.tokens, torch.long), t(self.parents, torch.long),
                         t(self.depths, torch.long), t(self.scores, torch.float64))


def build_best_first_tree(
    log_q: Tensor,  # [γ, V] per-depth marginal log-probs of a parallel drafter
    budget: int,
) -> TokenTree:
    """DDTree: the `budget` highest-scoring paths, score = sum of per-depth marginal log-probs."""
    gamma, vocab = log_q.shape
    top = log_q.float().topk(min(budget, vocab), dim=-1)
    logps, toks = top.values.tolist(), top.indices.tolist()
    search = _BestFirst(budget, gamma)
    if gamma > 0:
        search.expand(-1, logps[0], toks[0])
    while not search.done():
        node = search.pop()
        if search.wants_children(node):
            d = search.depth(node)
            search.expand(node, logps[d], toks[d])
    return search.to_tree(log_q.device)


def build_best_first_trees(log_q: Tensor, budget: int) -> list[TokenTree]:
    """DDTree for a batch: log_q [B, γ, V] -> one tree per request."""
    return [build_best_first_tree(row, budget) for row in log_q]


def _head_children(
    head: CausalHead,
    requests: list[tuple[int, int]],  # (request b, node) pairs to expand
    searches: list[_BestFirst],
    root_tokens: list[int],
    candidates: Tensor,               # [B, γ, M] long
) -> None:
    """One batched head call that expands the given nodes of several requests."""
    gamma = candidates.shape[1]
    paths = torch.zeros(len(requests), gamma + 1, dtype=torch.long)
    depth = torch.zeros(len(requests), dtype=torch.long)
    for i, (b, node) in enumerate(requests):
        path = [root_tokens[b]] + searches[b].path(node)
        paths[i, : len(path)] = torch.tensor(path)
        depth[i] = len(path) - 1
    rows = torch.tensor([b for b, _ in requests])
    cand = candidates[rows.to(candidates.device), depth.to(candidates.device)]  # [n, M]
    logps = head(paths.to(candidates.device), depth.to(candidates.device), cand)
    logps, order = logps.float().sort(dim=-1, descending=True)
    toks = cand.gather(1, order)
    for (b, node), lp, tk in zip(requests, logps.tolist(), toks.tolist()):
        searches[b].expand(node, lp, tk)


def build_causal_trees(
    base_log_probs: Tensor,  # [B, γ, V] backbone (marginal) log-probs per depth
    root_tokens: Tensor,     # [B] long, last verified token of each request
    head: CausalHead,
    budget: int,
    top_m: int,
) -> list[TokenTree]:
    """DominoTree-style best-first trees with path-dependent scores from a causal head.

    Candidates at depth d are the backbone's top-M tokens there; a node's children are scored
    by ``head`` on that node's own root-to-node path. All requests advance in lockstep, so the
    head is called once per step with up to B nodes (at most ``budget`` + 1 calls in all).
    """
    bsz, gamma, vocab = base_log_probs.shape
    candidates = base_log_probs.topk(min(top_m, vocab), dim=-1).indices
    searches = [_BestFirst(budget, gamma) for _ in range(bsz)]
    roots = root_tokens.tolist()
    if gamma > 0 and budget > 0:
        _head_children(head, [(b, -1) for b in range(bsz)], searches, roots, candidates)
    while True:
        active = [b for b in range(bsz) if not searches[b].done()]
        if not active:
            break
        popped = [(b, searches[b].pop()) for b in active]
        grow = [(b, node) for b, node in popped if searches[b].wants_children(node)]
        if grow:
            _head_children(head, grow, searches, roots, candidates)
    return [s.to_tree(base_log_probs.device) for s in searches]
