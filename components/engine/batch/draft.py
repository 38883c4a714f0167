"""The drafter's side of the batch engine's rounds: this round's draft cap, the drafts of every
speculating row, and the drafter's updates after verification (``Drafting``).

The cap is asked of the draft-length policy with each row's survival estimate: its latest
proposal's confidences, scaled by the row's own record of accepted against predicted drafts
(when the policy calibrates), else the acceptance seen over all rows scaled the same way; and,
when no request waits to join, each row's tokens left (the batch is draining).

A drafter declaring ``Capability.BATCHED_PROPOSE`` (block drafters; EAGLE-3, MTP: one pass per
draft step) drafts the rows that draft in one stage together, in padded, masked drafter
passes; each row's readout then draws from that row's own sampling parameters and generator,
exactly as ``SpeculativeEngine.draft`` would for the row alone (so sampled output does not
depend on the rest of the batch). Rows whose cap this round needs more than one DLoop stage,
and drafters without it, propose one by one. Likewise ``Capability.BATCHED_CONSUME`` turns the per-row ``consume`` calls
into one ``consume_many`` (``consume_rows``). Either way the output is the same.

A speculating row's plain round (cap 0) only records its token and hidden state (``pending``);
the drafter consumes them when the row drafts again (``flush``), so cap-0 rounds cost what
plain decoding costs. Knows the drafter's engine protocol and the draft-length policy; nothing
about verification or the target cache.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch
from torch import Tensor

from components.drafters.capabilities import Capability, has
from components.engine.batch.state import Row
from components.engine.engine import SpeculativeEngine, sync_device
from components.engine.schedule import (
    DraftLengthPolicy,
    FixedDraftLength,
    survival_from_confidences,
)

ROW_DECAY = 0.8  # per round, on a row's predicted/accepted sums
ROW_PRIOR = 4.0  # pseudo-tokens on both sides of a row's ratio: about one round's worth of evidence


def consume_rows(drafter: Any, states: list[Any], tokens: list[Tensor], hidden: list[Tensor | None]) -> list[Any]:
    """``consume`` per row (tokens each [1, T_i], hidden each [1, T_i, n, H] or None), in one
    ``consume_many`` call when the drafter declares ``BATCHED_CONSUME`` and every row has states."""
    if has(drafter, Capability.BATCHED_CONSUME) and all(h is not None for h in hidden):
        return drafter.consume_many(states, tokens, hidden)
    return [drafter.consume(s, t, h) for s, t, h in zip(states, tokens, hidden)]


CAPS_KEPT = 4096  # caps a long-running engine remembers (for dashboards and benchmarks)


class Drafting:
    """Caps, drafts and drafter updates of the batch's rows, for ``BatchEngine``."""

    def __init__(self, drafter: Any, engines: dict[str, SpeculativeEngine], policy: DraftLengthPolicy,
                 max_cap: int):
        """``engines``: a chain engine per rule (drafting as the rule picks its tokens)."""
        self.drafter, self.engines, self.policy = drafter, engines, policy
        self.max_cap = max_cap
        self.batched = drafter is not None and has(drafter, Capability.BATCHED_PROPOSE)
        self.caps: deque[int] = deque(maxlen=CAPS_KEPT)  # the cap chosen each of the last rounds
        self.capped_rounds = 0  # rounds that chose a cap, since the engine started
        self.defer_plain_updates = True  # plain rounds of speculating rows defer the drafter's update

    # ------------------------------------------------------------------ drafting
    def draft(self, rows: list[Row], draining: bool) -> float:
        """Drafts for every speculating row under this round's cap; returns the seconds spent.
        ``draining``: no request waits to join."""
        self._count_row_hits(rows)
        cap = self._cap(rows, draining)
        spent = self.flush([r for r in rows if r.pending and cap and r.speculates])
        together: list[tuple[Row, int]] = []
        for row in rows:
            row.carried = row.seq.carry_rows
            # as SpeculativeEngine.round: at least one draft, overshoot cut (same randomness use)
            gamma = max(1, min(cap, row.remaining - 1)) if row.speculates and cap else 0
            row.proposal, row.drafts = None, None
            if gamma == 0:
                continue
            if self.batched and gamma <= self.engines[row.request.rule].num_speculative_tokens:  # one stage
                together.append((row, gamma))
                continue
            t0 = time.perf_counter()
            row.proposal, row.drafts = self.engines[row.request.rule].draft(row.seq, gamma, row.rnd)
            sync_device(row.drafts.device)
            row.result.draft_seconds += time.perf_counter() - t0
            spent += time.perf_counter() - t0
        spent += self._draft_together(together)
        for row in rows:
            conf = survival_from_confidences(row.proposal.confidences) if row.proposal is not None else None
            # no proposal this round (a plain round): no fresh estimate, so the next cap reads the
            # acceptance seen so far; a stale low confidence would keep the row plain for good
            row.raw_survival = conf[0] if conf is not None else None
            row.survival = row_calibrated(row.raw_survival, row.hits) if self._per_row else row.raw_survival
        return spent

    def _draft_together(self, rows: list[tuple[Row, int]]) -> float:
        """Drafts of ``rows`` (row, γ) in one ``propose_many`` call, each of its own γ, picked by
        its own rule with its own randomness."""
        if not rows:
            return 0.0
        t0 = time.perf_counter()
        last = torch.cat([row.seq.last_token for row, _ in rows])  # [R]
        samplings = [self.engines[row.request.rule].rule.draft_sampling(row.rnd) for row, _ in rows]
        props = self.drafter.propose_many([row.seq.draft_state for row, _ in rows], last, samplings,
                                          [g for _, g in rows], generators=[row.rnd.generator for row, _ in rows])
        for (row, g), prop in zip(rows, props):  # each proposal already cut to its row's γ
            positions = torch.arange(row.seq.length, row.seq.length + g, device=last.device)[None, :]
            row.proposal, row.drafts = prop, row.rule.pick_drafts(prop, positions, row.rnd)
        sync_device(last.device)
        seconds = time.perf_counter() - t0
        for row, _ in rows:
            row.result.draft_seconds += seconds / len(rows)
        return seconds

    # ------------------------------------------------------------------ drafter updates
    def flush(self, rows: list[Row]) -> float:
        """Rows about to draft consume what their plain rounds deferred, in one call; seconds."""
        if not rows:
            return 0.0
        t0 = time.perf_counter()
        olds = [r.seq.draft_state for r in rows]
        tokens = [torch.cat([t for t, _ in r.pending], dim=1) for r in rows]  # each [1, k]
        hidden = [torch.cat([h for _, h in r.pending], dim=1) for r in rows]  # each [1, k, n, H]
        news = consume_rows(self.drafter, olds, tokens, hidden)
        for row, new in zip(rows, news):
            row.seq.draft_state, row.pending = new, []
        return time.perf_counter() - t0

    def consume_verified(self, rows: list[Row], accepted: list[int], hidden: Tensor | None) -> list[Any]:
        """Every row's drafter state after consuming x_{n-1} + its accepted drafts (their
        verify-pass hidden states, hidden [B, G+1, n, H]); None for plain rows. A speculating
        row's plain round is deferred (``pending``) when ``defer_plain_updates``."""
        states: list[Any] = [r.seq.draft_state for r in rows]
        idx = []
        for b, r in enumerate(rows):
            if not r.speculates:
                continue
            if r.drafts is None and hidden is not None and self.defer_plain_updates:
                r.pending.append((r.seq.last_token[:, None], hidden[b:b + 1, :1]))
            else:
                idx.append(b)
        if not idx:
            return states
        tokens = [rows[b].seq.last_token[:, None] if rows[b].drafts is None else
                  torch.cat([rows[b].seq.last_token[:, None], rows[b].drafts[:, :accepted[b]]], dim=1)
                  for b in idx]  # each [1, a_b+1]
        kept = [hidden[b:b + 1, :accepted[b] + 1] if hidden is not None else None for b in idx]
        news = consume_rows(self.drafter, [rows[b].seq.draft_state for b in idx], tokens, kept)
        for b, new in zip(idx, news):
            states[b] = new
        return states

    # ------------------------------------------------------------------ the cap
    @property
    def _per_row(self) -> bool:
        """Rows' survival calibrated by their own record: when the policy calibrates at all."""
        return bool(self.policy.calibrate)

    def _count_row_hits(self, rows: list[Row]) -> None:
        """Each row that drafted last round adds what its confidences predicted and what it got
        (decayed), for ``row_calibrated``: the head's error is not the same on every request."""
        for row in rows:
            if row.drafts is None or row.raw_survival is None or not row.result.accepted:
                continue
            drafted = row.drafts.shape[1]
            row.hits[0] = ROW_DECAY * row.hits[0] + float(row.raw_survival[:drafted].sum())
            row.hits[1] = ROW_DECAY * row.hits[1] + float(row.result.accepted[-1])

    def _cap(self, rows: list[Row], draining: bool) -> int:
        """This round's draft cap from the policy, over the rows that speculate."""
        rows = [r for r in rows if r.speculates]
        if not rows or self.max_cap == 0:
            return 0
        if isinstance(self.policy, FixedDraftLength):
            return self.max_cap
        fallback = self.policy.empirical_survival(self.max_cap)
        survival = torch.stack([self._row_estimate(r, fallback) for r in rows])  # [B', max_cap]
        # draining: the batch's time is that of its last row
        remaining = [r.remaining for r in rows] if draining else None
        cap = self.policy.cap(survival, self.max_cap, remaining=remaining)
        self.caps.append(cap)
        self.capped_rounds += 1
        return cap

    def _row_estimate(self, row: Row, fallback: Tensor) -> Tensor:  # → [max_cap] float64
        """A row's survival: its latest confidences (already scaled by its record), extended
        past their length by the acceptance seen over all rows; without fresh confidences
        (after a plain round), that acceptance alone, scaled by the row's own record."""
        if row.survival is None and self._per_row:
            return row_calibrated(fallback, row.hits)
        return _fill(row.survival, fallback)


def row_calibrated(survival: Tensor | None, hits: list[float]) -> Tensor | None:
    """A row's survival [γ'] scaled by what its own past rounds got against what its
    confidences predicted, (accepted + m) / (predicted + m), monotone and at most 1. The
    policy's per-position calibration works over all rows; this one catches the request the
    head is steadily wrong about (a hard continuation in a batch of easy ones)."""
    if survival is None:
        return None
    ratio = (hits[1] + ROW_PRIOR) / (hits[0] + ROW_PRIOR)
    return (survival.double() * ratio).clamp(0, 1).cummin(dim=-1).values


def _fill(survival: Tensor | None, fallback: Tensor) -> Tensor:  # → [len(fallback)] float64
    if survival is None:
        return fallback
    s, n = survival.double().cpu()[: fallback.shape[0]], min(survival.shape[0], fallback.shape[0])
    if n == 0:
        return fallback
    return torch.cat([s, fallback[n:] / fallback[n - 1].clamp_min(1e-9) * s[-1]])  # extend by empirical α
