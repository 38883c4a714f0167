"""Exact offline simulation of greedy draft–verify rounds over recorded target rollouts.

A round anchored at position a (the last verified token) drafts x_{a+1..a+γ}; verification
accepts draft j while the drafter's greedy token equals the recorded token, then the target
supplies the correction (or bonus) token, so the next round is anchored at a + m + 1. Because a
drafter's teacher-forced draft j only reads tokens up to x_{a+j} and those equal the drafter's
own tokens for as long as it matches, the teacher-forced argmax gives exactly the accepted
count m of free-running greedy drafting. Rollouts recorded greedily make this the engine's
greedy τ; rollouts recorded with sampling make it the τ of greedy drafts verified against the
target's recorded samples (as with Gumbel-coupled verification, the target's draw is fixed).

The first round is anchored at the first response token (the prefill produced it).
Used by Draft-OPD (where rounds start) and by the held-out evaluation (simulated τ).
Knows the drafter training interface; nothing about Ray or files.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from components.drafters.base import DraftBatch, Drafter
from components.losses.onpolicy import greedy_accepted


@dataclass
class Rounds:
    """Simulated rounds of one batch: per row, the anchors and accepted counts in order."""

    anchors: list[list[int]]  # [B][R_b] positions where rounds start
    accepted: list[list[int]]  # [B][R_b] accepted drafts per round
    reachable: list[list[int]]  # [B][R_b] drafts that could be checked (γ, less at the end)

    def extend(self, other: Rounds) -> Rounds:
        """Appends ``other``'s rows (e.g. the next batch's) to these; returns self."""
        self.anchors.extend(other.anchors)
        self.accepted.extend(other.accepted)
        self.reachable.extend(other.reachable)
        return self

    def tau(self) -> float:
        """Mean tokens per round (accepted + 1) over all rounds; NaN without rounds."""
        n = sum(len(a) for a in self.accepted)
        return (sum(map(sum, self.accepted)) + n) / n if n else float("nan")

    def position_acceptance(self, gamma: int) -> list[float]:
        """Fraction of rounds reaching draft k (1-based) that accept it."""
        reach, acc = [0] * gamma, [0] * gamma
        for row_m, row_r in zip(self.accepted, self.reachable):
            for m, r in zip(row_m, row_r):
                for k in range(min(r, m + 1)):
                    reach[k] += 1
                    acc[k] += int(k < m)
        return [a / r if r else float("nan") for a, r in zip(acc, reach)]


@torch.no_grad()
def accepted_at(drafter: Drafter, batch: DraftBatch, anchors: Tensor) -> tuple[Tensor, Tensor]:
    """Greedy accepted count and checkable drafts [B, A] of the blocks at anchors [B, A] (-1 unused)."""
    out = drafter.training_forward(dataclasses.replace(batch, anchors=anchors), targets=False)  # no target head
    m = greedy_accepted(out.draft_logits, out.target_tokens, out.valid)
    return m.view(anchors.shape), out.checkable().sum(1).view(anchors.shape)  # a draft-vocab miss is checked


def _first_response(loss_mask: Tensor) -> list[int]:  # [B, T] -> per row, -1 without response
    has = loss_mask.any(1)
    first = loss_mask.int().argmax(1)
    return [int(f) if bool(h) else -1 for f, h in zip(first, has)]


@torch.no_grad()
def simulate_rounds(drafter: Drafter, batch: DraftBatch, chunk: int = 32) -> Rounds:
    """Greedy rounds over every row of ``batch``; blocks at all response positions, ``chunk`` at a time."""
    was_training = drafter.training
    drafter.eval()
    b, t = batch.input_ids.shape
    mask = batch.loss_mask if batch.loss_mask is not None else torch.ones_like(batch.input_ids, dtype=torch.bool)
    m_all = torch.zeros(b, t, dtype=torch.long)
    r_all = torch.zeros(b, t, dtype=torch.long)
    for lo in range(0, t - 1, chunk):
        pos = torch.arange(lo, min(t - 1, lo + chunk)).expand(b, -1)
        pos = torch.where(mask.gather(1, pos + 1).bool(), pos, torch.full_like(pos, -1))
        if bool((pos >= 0).any()):
            m, r = accepted_at(drafter, batch, pos.to(batch.input_ids.device))
            valid = pos >= 0
            m_all[:, lo:lo + pos.shape[1]] = torch.where(valid, m.cpu(), 0)
            r_all[:, lo:lo + pos.shape[1]] = torch.where(valid, r.cpu(), 0)
    drafter.train(was_training)
    rounds = Rounds([], [], [])
    for row, start in enumerate(_first_response(mask.cpu())):
        anchors, accepted, reach = [], [], []
        a = start
        while 0 <= a < t - 1 and int(r_all[row, a]) > 0:
            anchors.append(a)
            accepted.append(int(m_all[row, a]))
            reach.append(int(r_all[row, a]))
            a += accepted[-1] + 1
        rounds.anchors.append(anchors)
        rounds.accepted.append(accepted)
        rounds.reachable.append(reach)
    return rounds


def anchor_tensor(anchors: list[list[int]], limit: int, generator: torch.Generator | None = None) -> Tensor:
    """Per-row anchor lists → [B, A] long, -1 padded; rows with more than ``limit`` keep a random subset."""
    kept = []
    for row in anchors:
        if len(row) > limit:
            idx = torch.randperm(len(row), generator=generator)[:limit].sort().values
            row = [row[i] for i in idx.tolist()]
        kept.append(row)
    width = max(1, max(len(r) for r in kept))
    out = torch.full((len(kept), width), -1, dtype=torch.long)
    for i, row in enumerate(kept):
        out[i, :len(row)] = torch.tensor(row, dtype=torch.long)
    return out
