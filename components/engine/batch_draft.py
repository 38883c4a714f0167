"""The batch engine's drafting step: this round's draft cap, deferred drafter updates, and the
drafts of every speculating row.

The cap is asked of the draft-length policy with each row's survival estimate: its latest
proposal's confidences, scaled by the row's own record of accepted against predicted drafts
(when the policy calibrates), else the acceptance seen over all rows scaled the same way; and,
when no request waits to join, each row's tokens left (the batch is draining).

Rows whose drafter has ``propose_many`` (block drafters; EAGLE-3, one pass per draft step) and
that draft in one stage share padded, masked drafter passes; each row's readout then draws from that row's own sampling
parameters and generator, exactly as ``SpeculativeEngine.draft`` would for the row alone (so
sampled output still does not depend on the rest of the batch). Rows drafting in DLoop stages,
and drafters without ``propose_many``, propose one by one.

A mixin of ``batch.BatchEngine`` (it reads the engine's batch, policy and per-rule engines);
knows nothing about verification or the target cache.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from components.engine.batch_state import _Running
from components.engine.engine import sync_device
from components.engine.schedule import FixedDraftLength, survival_from_confidences


class DraftStep:
    """``_draft`` and its helpers, for ``BatchEngine``."""

    def _draft(self) -> float:
        """Drafts for every speculating row under this round's cap; returns the seconds spent."""
        self._count_row_hits()
        cap = self._cap()
        spent = self._flush([r for r in self.batch.rows if r.pending and cap and r.seq.draft_state is not None])
        together: list[tuple[_Running, int]] = []
        for run in self.batch.rows:
            run.carried = run.seq.carry_rows
            # as SpeculativeEngine.round: at least one draft, overshoot cut (same randomness use)
            gamma = max(1, min(cap, run.remaining - 1)) if run.seq.draft_state is not None and cap else 0
            run.proposal, run.drafts = None, None
            if gamma == 0:
                continue
            if self._batchable(run):
                together.append((run, gamma))
                continue
            t0 = time.perf_counter()
            run.proposal, run.drafts = self._engines[run.request.rule].draft(run.seq, gamma, run.rnd)
            sync_device(run.drafts.device)
            run.result.draft_seconds += time.perf_counter() - t0
            spent += time.perf_counter() - t0
        spent += self._draft_together(together)
        for run in self.batch.rows:
            conf = survival_from_confidences(run.proposal.confidences) if run.proposal is not None else None
            # no proposal this round (a plain round): no fresh estimate, so the next cap reads the
            # acceptance seen so far; a stale low confidence would keep the row plain for good
            run.raw_survival = conf[0] if conf is not None else None
            run.survival = _row_calibrated(run.raw_survival, run.hits) if self._per_row else run.raw_survival
        return spent

    @property
    def _per_row(self) -> bool:
        """Rows' survival calibrated by their own record: when the policy calibrates at all."""
        return bool(self.draft_length.calibrate)

    def _count_row_hits(self) -> None:
        """Each row that drafted last round adds what its confidences predicted and what it got
        (decayed), for ``_row_calibrated``: the head's error is not the same on every request."""
        for run in self.batch.rows:
            if run.drafts is None or run.raw_survival is None or not run.result.accepted:
                continue
            drafted = run.drafts.shape[1]
            run.hits[0] = ROW_DECAY * run.hits[0] + float(run.raw_survival[:drafted].sum())
            run.hits[1] = ROW_DECAY * run.hits[1] + float(run.result.accepted[-1])

    def _batchable(self, run: _Running) -> bool:
        return hasattr(self.drafter, "propose_many") and self._engines[run.request.rule].loop_stages == 1

    def _draft_together(self, rows: list[tuple[_Running, int]]) -> float:
        """Drafts of ``rows`` (run, γ) in one drafter pass, each of its own γ, picked by its own
        rule with its own randomness."""
        if not rows:
            return 0.0
        t0 = time.perf_counter()
        last = torch.cat([run.seq.last_token for run, _ in rows])  # [R]
        samplings = [self._engines[run.request.rule].rule.draft_sampling(run.rnd) for run, _ in rows]
        props = self.drafter.propose_many([run.seq.draft_state for run, _ in rows], last, samplings,
                                          [g for _, g in rows], generators=[run.rnd.generator for run, _ in rows])
        for (run, g), prop in zip(rows, props):  # each proposal already cut to its row's γ
            positions = torch.arange(run.seq.length, run.seq.length + g, device=last.device)[None, :]
            run.proposal, run.drafts = prop, run.rule.pick_drafts(prop, positions, run.rnd)
        sync_device(last.device)
        seconds = time.perf_counter() - t0
        for run, _ in rows:
            run.result.draft_seconds += seconds / len(rows)
        return seconds

    def _flush(self, rows: list[_Running]) -> float:
        """Rows about to draft consume what their plain rounds deferred, in one call; seconds."""
        if not rows:
            return 0.0
        t0 = time.perf_counter()
        olds = [r.seq.draft_state for r in rows]
        tokens = [torch.cat([t for t, _ in r.pending], dim=1) for r in rows]  # each [1, k]
        hidden = [torch.cat([h for _, h in r.pending], dim=1) for r in rows]  # each [1, k, n, H]
        news = self._consume_each(olds, tokens, hidden)
        for run, new in zip(rows, news):
            run.seq.draft_state, run.pending = new, []
        return time.perf_counter() - t0

    def _cap(self) -> int:
        """This round's draft cap from the policy, over the rows that speculate."""
        rows = [r for r in self.batch.rows if r.seq.draft_state is not None]
        if not rows or self.max_drafts == 0:
            return 0
        if isinstance(self.draft_length, FixedDraftLength):
            return self.max_drafts
        fallback = self.draft_length.empirical_survival(self.max_drafts)
        survival = torch.stack([self._row_estimate(r, fallback) for r in rows])  # [B', max_drafts]
        # no request waiting: the batch is draining, and its time is that of its last row
        remaining = None if self.waiting else [r.remaining for r in rows]
        cap = self.draft_length.cap(survival, self.max_drafts, remaining=remaining)
        self.caps.append(cap)
        return cap

    def _row_estimate(self, run: _Running, fallback: Tensor) -> Tensor:  # → [max_drafts] float64
        """A row's survival: its latest confidences (already scaled by its record), extended
        past their length by the acceptance seen over all rows; without fresh confidences
        (after a plain round), that acceptance alone, scaled by the row's own record."""
        if run.survival is None and self._per_row:
            return _row_calibrated(fallback, run.hits)
        return _fill(run.survival, fallback)

    # provided by BatchEngine
    batch: Any
    waiting: Any
    drafter: Any
    draft_length: Any
    max_drafts: int
    caps: list[int]
    _engines: dict[str, Any]
    _consume_each: Any


ROW_DECAY = 0.8  # per round, on a row's predicted/accepted sums
ROW_PRIOR = 4.0  # pseudo-tokens on both sides of a row's ratio: about one round's worth of evidence


def _row_calibrated(survival: Tensor | None, hits: list[float]) -> Tensor | None:
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
