"""Tree verification: accept one root-to-node path of a flattened token tree, batched.

Inputs follow ``trees.FlatTree``: ``tokens [B, N]``, ``parents [B, N]`` (-1 = child of the root,
i.e. of the last verified token), ``num_nodes [B]`` (nodes past it are padding). Target (and
draft) distributions come per *slot* ``[B, N+1, V]``: slot 0 is the root's distribution (it
predicts the root's children), slot ``j+1`` is the distribution after node ``j`` (it predicts
node ``j``'s children, or the bonus token if ``j`` is the last accepted node).

The walk, shared by all rules: starting at the root, move to the first child (lowest index)
that passes the rule's test; stop when none does. The nodes walked are the accepted tokens,
and ``next_token`` is drawn at the last accepted slot: the target's own choice (greedy /
Gumbel / deterministic-tree sampling), or the residual of rejection sampling.

Rules:

* ``verify_tree_greedy``   -- test = token equals the target's argmax at the parent slot;
  the output equals the target's greedy decoding.
* ``verify_tree_gumbel``   -- test = token equals argmax(log p + g) with shared noise per slot;
  drafter-invariant (use ``tree_noise_positions`` to key noise by absolute position).
* ``verify_tree_sampling`` -- lossless sampling.
  - With ``draft_probs`` (SpecInfer-style multi-draft recursive rejection sampling): the
    children of a slot must be i.i.d. samples from ``draft_probs`` at that slot. Children are
    tried in index order with r_0 = p: accept child c_i w.p. min(1, r_{i-1}(c_i)/q(c_i)),
    else r_i = normalise((r_{i-1} - q)+); if every child is rejected the recovered token is
    sampled from r_k. Each step is a speculative-sampling step of target r_{i-1} against
    proposal q, so by induction the emitted token follows p. r_i does not depend on which
    tokens were drafted, so all r_i are computed for all slots at once (loop over sibling rank).
  - Without ``draft_probs`` (deterministic trees, e.g. best-first): every child is treated as
    a point-mass proposal; recursive rejection with point masses is exactly "sample x ~ p at the
    slot, follow the child whose token is x, else emit x", implemented as a walk on
    argmax(p / E) with fresh exponential races. Its acceptance at a slot is the target mass on
    the children, the best any lossless rule can do for a fixed candidate set.

What this module does not know: how trees were built, models, temperatures. Distributions must
already be processed (``sampling.py``). Any node order works (the builders emit parents before
children); siblings are tried in index order. Host syncs: one ``max`` over child counts and one
``nonzero`` per sibling rank in recursive rejection sampling; none in the other rules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from components.spec.argmax import argmax_last
from components.spec.trees import ancestor_mask
from components.spec.verify import draw_coins, draw_race, sample_from_weights

__all__ = [
    "TreeVerifyResult",
    "tree_noise_positions",
    "verify_tree_greedy",
    "verify_tree_gumbel",
    "verify_tree_rrs_core",
    "verify_tree_sampling",
    "walk_tree",
]


@dataclass
class TreeVerifyResult:
    """Outcome of verifying one tree per request."""

    num_accepted: Tensor  # [B] long, accepted nodes (= depth of the last accepted node)
    next_token: Tensor    # [B] long, recovered token, or bonus token after a leaf
    accepted: Tensor      # [B, N] bool, node lies on the accepted path
    path: Tensor          # [B, N] long, accepted node indices by depth, then -1


def _valid_nodes(tokens: Tensor, num_nodes: Tensor | None) -> Tensor:
    """[B, N] bool of real (non-padding) nodes."""
    bsz, n = tokens.shape
    if num_nodes is None:
        return torch.ones(bsz, n, dtype=torch.bool, device=tokens.device)
    return torch.arange(n, device=tokens.device)[None, :] < num_nodes[:, None]


def _first_among_siblings(flag: Tensor, parents: Tensor) -> Tensor:
    """flag [B, N] restricted to the lowest-index flagged child of each parent."""
    n = parents.shape[1]
    idx = torch.arange(n, device=parents.device)
    earlier = (parents[:, :, None] == parents[:, None, :]) & (idx[None, None, :] < idx[None, :, None])
    return flag & ~(earlier & flag[:, None, :]).any(dim=-1)


def _sibling_rank(parents: Tensor, valid: Tensor) -> Tensor:
    """[B, N] long: number of earlier real siblings of each node."""
    n = parents.shape[1]
    idx = torch.arange(n, device=parents.device)
    earlier = (parents[:, :, None] == parents[:, None, :]) & (idx[None, None, :] < idx[None, :, None])
    return (earlier & valid[:, None, :]).sum(dim=-1)


def _accepted_path(selected: Tensor, parents: Tensor, valid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """From per-node pass flags [B, N]: (accepted [B, N], num_accepted [B], path [B, N])."""
    bsz, n = selected.shape
    anc = ancestor_mask(parents)                        # [B, N, N]
    accepted = ~(anc & ~selected[:, None, :]).any(dim=-1) & valid
    depth = anc.sum(dim=-1)                             # [B, N], 1 = root child
    column = torch.where(accepted, depth - 1, torch.full_like(depth, n))
    nodes = torch.arange(n, device=parents.device).expand(bsz, n)
    path = torch.full((bsz, n + 1), -1, dtype=torch.long, device=parents.device)
    path = path.scatter(1, column, nodes)[:, :n]
    return accepted, accepted.sum(dim=-1), path


def _last_slot(path: Tensor, num_accepted: Tensor) -> Tensor:
    """Slot [B] long of the last accepted node (0 = root)."""
    last = path.gather(1, (num_accepted - 1).clamp_min(0)[:, None]).squeeze(1)
    return torch.where(num_accepted > 0, last + 1, torch.zeros_like(last))


def walk_tree(
    tokens: Tensor,         # [B, N] long
    parents: Tensor,        # [B, N] long
    target_tokens: Tensor,  # [B, N+1] long, the target's choice at each slot
    num_nodes: Tensor | None = None,  # [B] long
) -> TreeVerifyResult:
    """Exact-matching walk: follow the first child equal to the target's choice at each slot."""
    valid = _valid_nodes(tokens, num_nodes)
    match = (tokens == target_tokens.gather(1, parents + 1)) & valid
    accepted, n, path = _accepted_path(_first_among_siblings(match, parents), parents, valid)
    next_token = target_tokens.gather(1, _last_slot(path, n)[:, None]).squeeze(1)
    return TreeVerifyResult(n, next_token, accepted, path)


def verify_tree_greedy(
    tokens: Tensor,   # [B, N] long
    parents: Tensor,  # [B, N] long
    target: Tensor,   # [B, N+1, V] target logits, log-probs or probs per slot
    num_nodes: Tensor | None = None,  # [B] long
) -> TreeVerifyResult:
    """Greedy tree verification: the longest root-to-node path the target's argmax agrees with."""
    return walk_tree(tokens, parents, argmax_last(target), num_nodes)


def tree_noise_positions(next_position: Tensor, depths: Tensor) -> Tensor:
    """Absolute positions [B, N+1] each slot predicts: slot 0 -> next_position, node at depth d
    -> next_position + d. next_position: [B] long; depths: [B, N] long (FlatTree.position_ids)."""
    return next_position[:, None] + torch.cat([torch.zeros_like(depths[:, :1]), depths], dim=1)


def verify_tree_gumbel(
    tokens: Tensor,            # [B, N] long
    parents: Tensor,           # [B, N] long
    target_log_probs: Tensor,  # [B, N+1, V] processed target log-probs per slot
    noise: Tensor,             # [B, N+1, V] Gumbel noise per slot, shared with the drafter
    num_nodes: Tensor | None = None,  # [B] long
) -> TreeVerifyResult:
    """Gumbel-coupled tree verification: output = the target's Gumbel-max samples."""
    return walk_tree(tokens, parents, argmax_last(target_log_probs + noise), num_nodes)


def _gather_slot_token(probs: Tensor, slot: Tensor, tokens: Tensor) -> Tensor:
    """probs [B, S, V] at (slot [B, N], tokens [B, N]) -> [B, N]."""
    vocab = probs.shape[-1]
    return probs.reshape(probs.shape[0], -1).gather(1, slot * vocab + tokens)


def _rrs_residuals(
    target_probs: Tensor,  # [B, S, V]
    draft_probs: Tensor,   # [B, S, V]
    slot: Tensor,          # [B, N] long, parent slot of each node
    tokens: Tensor,        # [B, N] long
    rank: Tensor,          # [B, N] long, sibling rank of each node
    child_count: Tensor,   # [B, S] long
) -> tuple[Tensor, Tensor]:
    """(r_{rank} at each node's token [B, N], final residual r_{child_count} per slot [B, S, V]).

    Step i tests the rank-i children against r_i, then advances r only at the slots that had a
    rank-i child, so the work is proportional to the number of nodes, not slots x max width.
    """
    r = target_probs.clone()
    r_at = torch.zeros_like(tokens, dtype=target_probs.dtype)
    for i in range(int(child_count.max()) if child_count.numel() else 0):
        r_at = torch.where(rank == i, _gather_slot_token(r, slot, tokens), r_at)
        b, s = (child_count > i).nonzero(as_tuple=True)
        res = (r[b, s] - draft_probs[b, s]).clamp_min_(0)
        mass = res.sum(dim=-1, keepdim=True)
        r[b, s] = torch.where(mass > 0, res / mass.clamp_min(1e-30), r[b, s])
    return r_at, r


def verify_tree_rrs_core(
    tokens: Tensor,        # [B, N] long, children of slot s are i.i.d. samples of draft_probs[:, s]
    parents: Tensor,       # [B, N] long
    target_probs: Tensor,  # [B, N+1, V] processed target probabilities per slot
    draft_probs: Tensor,   # [B, N+1, V] drafter distribution each slot's children came from
    coins: Tensor,         # [B, N] uniform [0, 1), one per node
    race: Tensor,          # [B, V] Exponential(1), for the recovered / bonus token
    num_nodes: Tensor | None = None,  # [B] long
) -> TreeVerifyResult:
    """Multi-draft recursive rejection sampling with explicit randomness."""
    valid = _valid_nodes(tokens, num_nodes)
    slot = parents + 1
    rank = _sibling_rank(parents, valid)
    child_count = torch.zeros(slot.shape[0], slot.shape[1] + 1, dtype=torch.long,
                              device=slot.device).scatter_add(1, slot, valid.long())
    r_at, final = _rrs_residuals(target_probs, draft_probs, slot, tokens, rank, child_count)
    q_at = _gather_slot_token(draft_probs, slot, tokens)
    passed = (coins * q_at < r_at) & valid
    accepted, n, path = _accepted_path(_first_among_siblings(passed, parents), parents, valid)
    last = _last_slot(path, n)
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    weights, p_row = final[rows, last], target_probs[rows, last]
    weights = torch.where(weights.sum(-1, keepdim=True) > 0, weights, p_row)
    return TreeVerifyResult(n, sample_from_weights(weights, race), accepted, path)


def verify_tree_sampling(
    tokens: Tensor,        # [B, N] long
    parents: Tensor,       # [B, N] long
    target_probs: Tensor,  # [B, N+1, V] processed target probabilities per slot
    draft_probs: Tensor | None = None,  # [B, N+1, V] or None for deterministic trees
    num_nodes: Tensor | None = None,    # [B] long
    generator: torch.Generator | None = None,
) -> TreeVerifyResult:
    """Lossless tree sampling: recursive rejection sampling if the children were sampled from
    ``draft_probs``; the target-sample walk if the tree is deterministic (``draft_probs=None``)."""
    bsz, n = tokens.shape
    dev = target_probs.device
    if draft_probs is None:
        race = draw_race(tuple(target_probs.shape), dev, generator)
        return walk_tree(tokens, parents, (target_probs / race).argmax(dim=-1), num_nodes)
    coins = draw_coins((bsz, n), dev, generator)
    race = draw_race((bsz, target_probs.shape[-1]), dev, generator)
    return verify_tree_rrs_core(tokens, parents, target_probs, draft_probs, coins, race, num_nodes)
