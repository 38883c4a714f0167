"""Draft length per round for a batch: fixed γ, or DSpark-style adaptive under load.

The batch engine verifies every row in one pass; the adaptive policy picks one cap G per round,
before drafting, maximising expected tokens per second (the objective of DSpark's scheduler,
Cheng et al. 2026, Algorithm 1: one cap for the round, and on a ragged pass a length of its
own per row under it, as DSpark admits a length per request; "Per row" below)::

    E[tokens](G) = Σ_b (1 + Σ_{k≤G} a_{b,k})            a_{b,k}: P(first k drafts of b accepted)
    time(G)      = s·T(B·(1+w(G))) + o + [G > 0]·t_draft  T: profiled target forward time
    G*           = argmax_G E[tokens](G) / time(G)        G = 0 is plain decoding

w(G) is the pass's width in drafts per row. A row drafts min(G, L_b), L_b the length of the
draft it will make where its drafter previews it (suffix decoding, the hybrid: its survival is
0 past that draft), else G. A padded pass (a ragged HF cache) is as wide as its longest row,
w(G) = max_b min(G, L_b); a pass of ragged rows (``ragged``: a slot cache, whose rows verify their
own tokens only) costs its rows' mean, w(G) = mean_b min(G, L_b). A round profile prices (B, G)
with every row drafting G, so a fractional width is read between the profiled caps. Pricing a
cap at B·G drafts where most rows have no draft would keep a batch of suffix-decoding rows plain
in nearly every round.

G = 0 skips the drafter altogether, so when the batch is large enough that a wider pass costs
more than the accepted tokens are worth, speculation switches itself off instead of slowing the
batch. Survival a_{b,k} comes from the drafter's confidence head (DSpark: σ(c_k), cumulated) of
the request's proposal in the round before (none after a plain round), else from the acceptance
seen so far (per draft position, over all requests). Draft time t_draft, the table's scale s
(measured forward / T) and the per-round overhead o (cache bookkeeping, the drafter consuming
the verified states, Python) are running means of what the engine measured; o matters because
plain decoding pays it once per token.

Per row. A pass of ragged rows (``ragged``) charges each row for its own drafts, so a row
drafts only what pays on its own: its k-th draft costs (T(B, k) − T(B, k−1)) / B seconds, the
tokens a plain round would have made in that time are its price, and the row drafts the length
ℓ_b ≤ L_b maximising Σ_{k≤ℓ} (a_{b,k} − price_k) — none where no length gains. In a large
batch, where a draft's slot costs a good share of a plain token, a row whose suffix match is
unsure stays plain while a confident one drafts; the cap is then chosen over those
lengths (``row_lengths`` after ``cap``: min(G, ℓ_b)). A try of the drafting side (below)
drafts every row as far as it can, so its time and tokens are learnt as the model prices them.

Draining (``remaining`` given: no request waits to join the batch) the batch's time is that of
its row to finish last, not its tokens per second: plain rounds take every row forward by one
token and finish them together, while speculative rounds finish rows unevenly; the rows that
finish early leave, and the rounds after them are cheaper. So the policy then minimises the
expected time to finish every row if the cap stayed G: row b needs left_b / E_b[tokens](G)
rounds, and between two rows' expected ends the rows still running pay time(rows left, G)::

    drain(G) = Σ_i (r_(i) - r_(i-1)) · time(B - i + 1, G)      r_(1) ≤ … ≤ r_(B): rows' rounds

(drafts past a row's last token count for nothing). At batch 1 it is the same choice as tokens
per second. Maximising the share of its work the slowest row gets done per second instead
would ignore that the batch shrinks as rows finish.

Better than T(n) and those means, where it can be afforded: ``round_time``, the engine's whole
round profiled per (B, G) before serving (``profile.profile_round_times``); time(G) is then
read from it, and what drafting and bookkeeping really cost at each width is known from the
first round instead of learned at a loss in every batch size.

The model can be wrong where it matters (an over-confident head, a width whose real cost the
profile misses), so with ``calibrate`` (default) the policy checks itself in two ways:

* survival calibration: per draft position k, the conditional acceptance it predicted,
  a_k / a_{k-1} (summed over the rows that drafted k and reached it: their first k-1 drafts
  accepted), against how many of those rows accepted draft k; each row's conditionals are
  scaled by the ratio and multiplied back into survival. Conditional, because a position is
  only seen in rounds that drafted that deep, and which rows those are depends on the cap the
  policy chose: calibrating P(first k accepted) itself would carry the acceptance of the rows
  that happened to draft deep over to every row;
* measured time: a (batch size, width) already played is priced at its measured round seconds
  (running mean); one not played yet at the model's seconds times its side's measured/model
  ratio in the batch-size bucket (one ratio for plain rounds, one for all drafting caps, each
  taken against the model as updated by the round, so terms the model was still learning do
  not inflate it). Time and tokens are corrected apart because one round's acceptance is far
  noisier than its time. The side not chosen is tried once early, so a model that misprices
  plain rounds (or drafting) learns their real cost, and then again with exponential back-off:
  ``min_recheck`` rounds of the bucket later, doubling while a try loses (the round after it
  goes back to the other side) up to ``recheck``, and back to ``min_recheck`` when one wins.
  A plain round yields no confidences, so a request that went plain on one bad round sees only
  the acceptance seen so far; the early tries keep one bad round from keeping it plain, while a
  side that keeps losing costs a try in ``recheck`` rounds. Plain rounds themselves: where the
  rounds were profiled, they are tried only until their time at that batch size has been
  measured once (the profile is timed once per host, and the host may have run at another speed
  then: a plain round priced at the profile's time, while drafting rounds are priced at their
  measured time, makes drafting look cheap); without a profile, once measured, they are re-tried
  only every ``recheck`` rounds. Their tokens are certain, so a try could only refresh the time.

Knows timings and acceptance numbers only (a forward-time table, ``times.RoundTimes``); nothing
about models, rules or caches: what times them is ``profile.py``, what feeds them per row
``rows.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor

from components.engine.adaptive.times import RoundTimes
from components.spec.cost import ProfileTable


class DraftLengthPolicy(Protocol):
    """What the batch engine asks of a draft-length policy, once per round: ``cap`` before
    drafting (survival [B, ≥max_cap] per speculating row; ``remaining`` tokens per row when
    nothing waits to join), ``observe`` after the round; ``empirical_survival`` for rows
    without fresh confidences. Declared: ``adapts`` (False: the cap is always the largest, and
    no survival estimate is wanted), ``calibrate`` (rows' estimates scaled by their own record of
    accepted against predicted drafts, ``rows.RowSurvival``)."""

    adapts: bool
    calibrate: bool
    row_lengths: list[int] | None  # after ``cap``: each row's drafts this round (None: the cap for every row)

    def empirical_survival(self, max_cap: int) -> NDArray: ...

    def cap(self, survival: Tensor | NDArray, max_cap: int, remaining: list[int] | None = None) -> int: ...

    def observe(self, accepted: list[int], drafted: list[int], draft_seconds: float, forward_seconds: float,
                round_seconds: float, verify_tokens: int) -> None: ...


class FixedDraftLength:
    """Always the engine's γ (times its DLoop stages)."""

    adapts = False  # the batch engine asks for no estimate: the cap is max_cap
    calibrate = False  # no per-request survival estimates wanted
    row_lengths = None  # every row drafts the cap

    def empirical_survival(self, max_cap: int) -> NDArray:  # [max_cap] unused: the cap is always max_cap
        return np.ones(max_cap)

    def cap(self, survival: Tensor | NDArray, max_cap: int, remaining: list[int] | None = None) -> int:  # survival [B, max_cap]
        return max_cap

    def observe(self, accepted: list[int], drafted: list[int], draft_seconds: float, forward_seconds: float,
                round_seconds: float, verify_tokens: int) -> None:
        pass


@dataclass
class AdaptiveDraftLength:
    """Per-round cap G on the drafts, from survival estimates and a forward-time table, checked
    against the clock (module docstring)."""

    forward_time: ProfileTable | None = None  # seconds of a target pass over n tokens
    round_time: RoundTimes | None = None  # profiled seconds of a whole round, (B, G) -> s
    draft_seconds: float = 0.0  # running mean per drafting round (learned from observe)
    scale: float = 1.0  # measured forward seconds / T(n) (running mean)
    overhead: float = 0.0  # seconds per round outside drafting and the target forward (running mean)
    ema: float = 0.1
    # acceptance per draft before any is seen: optimistic, so a fresh policy drafts at once and
    # learns (one round at a loss for a poor drafter, after which two pseudo-rounds are outweighed)
    # instead of ramping up from plain rounds while it learns (½: a closed batch of 16 began plain)
    first_guess: float = 0.8
    accept_counts: list[float] = field(default_factory=list)  # per position: accepted
    reach_counts: list[float] = field(default_factory=list)  # per position: drafted and reached
    last_choice: int = -1
    row_lengths: list[int] | None = None  # drafts per row of the last cap's round (``cap``)
    rounds_seen: int = 0
    adapts = True  # a class attribute: the cap is chosen per round
    calibrate: bool = True  # survival calibration and measured round times (module docstring)
    ragged: bool = False  # rows verify only their own drafts (a slot cache): width = the rows' mean
    calibration_ema: float = 0.3
    # a round's measured seconds count at most this times their running mean: a pass that stalls
    # now and then (the OS, a page fault) at several times its seconds would otherwise move a
    # plain round's price for dozens of rounds, and the policy would draft as long as it lasted
    spike: float = 1.5
    recheck: int = 32  # most rounds per batch-size bucket between re-tries of the side not chosen
    min_recheck: int = 2  # fewest (back-off: doubles while tries lose)
    backoff: dict[tuple[int, bool], int] = field(default_factory=dict)  # (bucket, G > 0) -> rounds between tries
    decay: float = 0.97  # per round, on the survival calibration's running sums
    corrections: dict[tuple[int, bool], float] = field(default_factory=dict)  # (bucket, G > 0) -> time ratio
    round_times: dict[tuple[int, int], float] = field(default_factory=dict)  # (B, G) -> measured seconds
    tried: dict[tuple[int, bool], int] = field(default_factory=dict)  # (bucket, G > 0) -> round last tried
    bucket_rounds: dict[int, int] = field(default_factory=dict)  # rounds played per bucket
    predicted_hits: list[float] = field(default_factory=list)  # per position: Σ predicted survival
    observed_hits: list[float] = field(default_factory=list)  # per position: rows that got that far
    _last: tuple[tuple[int, int], NDArray] | None = None  # (B, G) chosen, survival it read
    _probe: tuple[int, bool] | None = None  # (bucket, side) tried against the model's choice last round

    def __post_init__(self) -> None:
        if self.forward_time is None and self.round_time is None:
            raise ValueError("AdaptiveDraftLength needs a forward_time table or a round_time profile")

    def empirical_survival(self, max_cap: int, prior: float = 2.0) -> NDArray:  # [max_cap] float64
        """P(first k drafts accepted) from the acceptance seen so far: per position k,
        α_k = (accepted_k + m·α_{k-1}) / (reached_k + m), m = ``prior`` pseudo-rounds, α_0's prior
        ``first_guess``. A position never reached (capped below it so far) inherits the one before, so a
        drafter accepting well at the first positions is expected to go on doing so, and caps
        above those played so far stay worth trying."""
        alphas, prev = [], self.first_guess
        for k in range(max_cap):
            acc, reach = (self.accept_counts[k], self.reach_counts[k]) if k < len(self.reach_counts) else (0.0, 0.0)
            prev = (acc + prior * prev) / (reach + prior)
            alphas.append(prev)
        return np.cumprod(alphas)

    def calibrated(self, survival: Tensor | NDArray) -> NDArray:
        """survival [B, G] → the same with each position's conditional acceptance
        a_k / a_{k-1} scaled by observed / predicted hits (``_count_hits``), at most 1."""
        a = _survival(survival)
        if not (self.calibrate and self.predicted_hits):
            return a
        k = min(a.shape[1], len(self.predicted_hits))
        ratio = np.array([(self.observed_hits[j] + 0.5) / (self.predicted_hits[j] + 0.5) for j in range(k)])
        cond = _conditional(a)
        cond[:, :k] = np.clip(cond[:, :k] * ratio, 0, 1)
        return np.cumprod(cond, axis=-1)

    def cap(self, survival: Tensor | NDArray, max_cap: int, remaining: list[int] | None = None) -> int:
        """survival [B, ≥max_cap] → the cap G in 0..max_cap with the best tokens/second;
        with ``remaining`` (tokens left per row, given when no request waits to join), the
        shortest expected time to finish every row instead (module docstring: draining).
        Computed in numpy: a round's cap is a few hundred float64s, on which torch's per-op
        cost outweighs the arithmetic (it is paid every round, between two target passes)."""
        raw = _survival(survival[:, :max_cap])
        a = self.calibrated(raw)
        bsz = a.shape[0]
        seconds = self._priced(bsz, max_cap)  # [G+1] every row drafting G
        previewed = (raw > 0).sum(axis=1)  # [B] L_b: the drafts each row can make
        lengths = np.minimum(previewed, self._worth(a, seconds))  # [B]
        a = a * (np.arange(max_cap)[None, :] < lengths[:, None])  # no tokens from drafts not made
        width = self._width(lengths, max_cap)
        if remaining is None or bsz == 1:  # one row draining: the same choice, its drafts past its end cut
            at_width = np.interp(width, np.arange(max_cap + 1, dtype=np.float64), seconds)  # as ``_priced``
            if remaining is None:
                tokens = bsz + np.concatenate([[0.0], np.cumsum(a.sum(axis=0))])  # [G+1]
            else:
                tokens = _row_tokens(a, np.maximum(np.asarray(remaining, dtype=np.float64), 1.0))[0]
            rates = tokens / at_width  # [G+1] tokens per second
        else:
            rates = 1.0 / self._drain_seconds(a, remaining, max_cap, width)  # [G+1] batches finished per second
        choice = self._explore(bsz, rates) if self.calibrate else int(rates.argmax())
        probing = self._probe is not None and choice > 0 and int(rates.argmax()) == 0
        # a try of drafting drafts what the rows can, so that its time and tokens are learnt
        self.row_lengths = [min(choice, int(n)) for n in (previewed if probing else lengths)]
        self.last_choice = choice
        self._last = ((bsz, choice), raw)
        return choice

    def _worth(self, a: NDArray, priced: NDArray) -> NDArray:
        """Calibrated survival [B, G], a round's seconds per cap with every row drafting it
        [G+1] → [B] the drafts worth their slots in each row (module docstring: per row). On a
        ragged pass, a row's k-th draft costs its own slot, (T(B, k) − T(B, k−1)) / B seconds,
        which a plain round would spend on B / T(B, 0) tokens per second; the row drafts the
        length ℓ that maximises Σ_{k≤ℓ} a_k − that cost in plain tokens (0 where none gains).
        A padded pass is as wide as its longest row: a shorter row saves nothing, so it drafts
        what it can."""
        bsz, cap = a.shape
        if not self.ragged or cap == 0:
            return np.full(bsz, cap)
        # (T(B, k) − T(B, k−1)) / B seconds at B / T(B, 0) tokens per second, in tokens
        cost = np.maximum(np.diff(priced[:cap + 1]), 0.0) / max(float(priced[0]), 1e-12)  # [G]
        net = np.cumsum(a - cost[None, :], axis=1)  # [B, G] tokens gained over plain decoding's
        return np.where(net.max(axis=1) > 0, net.argmax(axis=1) + 1, 0)

    def _width(self, lengths: NDArray, max_cap: int) -> NDArray:
        """Drafts per row [B] → [max_cap + 1] the pass's width w(G) in drafts per row (module
        docstring): each row drafts min(G, its length)."""
        drafted = np.minimum(np.arange(max_cap + 1)[None, :], lengths[:, None]).astype(np.float64)  # [B, G+1]
        return drafted.mean(axis=0) if self.ragged else drafted.max(axis=0)

    def _priced(self, bsz: int, max_cap: int, width: NDArray | None = None) -> NDArray:
        """[max_cap + 1] a round's seconds at batch ``bsz`` per cap, as the policy believes
        them: the model's at the pass's ``width`` per cap (default: every row drafting the cap),
        checked against the clock when calibrating (``_seconds``)."""
        seconds = self._round_model(bsz, max_cap)
        if self.calibrate:
            seconds = self._seconds(bsz, seconds)
        return seconds if width is None else np.interp(width, np.arange(max_cap + 1, dtype=np.float64), seconds)

    def _drain_seconds(self, survival: Tensor | NDArray, remaining: list[int], max_cap: int,
                       width: NDArray | None = None) -> NDArray:
        """survival [B, G], tokens left per row → [G+1] expected seconds until every row is
        done if the cap stayed G (module docstring: draining; the batch's ``width`` per cap
        read for every batch size it shrinks through)."""
        a = _survival(survival)
        left = np.maximum(np.asarray(remaining, dtype=np.float64), 1.0)  # [B]
        rounds = left[:, None] / _row_tokens(a, left)  # [B, G+1]
        ordered = np.sort(rounds, axis=0)  # each column: rows' expected ends, soonest first
        steps = np.diff(ordered, axis=0, prepend=np.zeros((1, ordered.shape[1])))
        bsz = a.shape[0]
        running = np.stack([self._priced(b, max_cap, width) for b in range(bsz, 0, -1)])  # [B, G+1]
        return (steps * running).sum(axis=0)

    def _round_model(self, bsz: int, max_cap: int) -> NDArray:
        """[max_cap + 1] the model's round seconds at batch ``bsz`` per cap: the profiled
        round times when given, else s·T(B·(G+1)) + o + [G > 0]·t_draft."""
        if self.round_time is not None:
            return self.round_time.row_array(bsz, max_cap)
        caps = torch.arange(max_cap + 1, dtype=torch.float64)
        return self._model_seconds(self.forward_time(bsz * (caps + 1)), (caps > 0).double()).numpy()

    def _model_seconds(self, forward: Any, drafting: Any) -> Any:
        """The model's round seconds: s·T(n) + o + [drafting]·t_draft (floats or tensors)."""
        return self.scale * forward + self.overhead + drafting * self.draft_seconds

    def _seconds(self, bsz: int, model: NDArray) -> NDArray:
        """model [G+1] → [G+1] a round's seconds at this batch size per cap: as measured, if it
        was played; else the model's, times its side's (plain or drafting) measured/model ratio
        in this bucket."""
        bucket = batch_bucket(bsz)
        seconds = model.copy()
        seconds[0] *= self.corrections.get((bucket, False), 1.0)
        seconds[1:] *= self.corrections.get((bucket, True), 1.0)
        for g in range(seconds.shape[0]):
            measured = self.round_times.get((bsz, g))
            if measured is not None:
                seconds[g] = measured
        return seconds

    def _explore(self, bsz: int, rates: NDArray) -> int:
        """The best cap by ``rates`` [G+1], or the other side's best when a try of it is due;
        settles last round's try first (won: tries as often as ``min_recheck``; lost: half as
        often, down to one in ``recheck``). A plain round teaches nothing but its time (its
        tokens are certain): with a profile (``round_time``) plain is tried until its time at
        this batch size is measured once (the profile may come from an hour when the host ran
        at another speed), then only chosen; without one, once measured, it is re-tried only
        every ``recheck`` rounds."""
        bucket, best = batch_bucket(bsz), int(rates.argmax())
        if self._probe is not None and self._probe[0] == bucket:
            won = self._probe[1] == (best > 0)
            wait = self.backoff.get(self._probe, self.min_recheck)
            self.backoff[self._probe] = self.min_recheck if won else min(2 * wait, self.recheck)
        self._probe = None
        side = not best > 0
        known = not side and (bsz, 0) in self.round_times
        if not side and self.round_time is not None and known:
            return best  # plain rounds' time measured here, and their tokens are certain
        if not self._recheck_due(bucket, side, self.recheck if known else None):
            return best
        self._probe = (bucket, side)
        return 1 + int(rates[1:].argmax()) if side else 0

    def _recheck_due(self, bucket: int, side: bool, wait: int | None = None) -> bool:
        """Whether the side not chosen is due a try: never tried (after one measured round of
        this bucket; after ``wait`` when given, its time being known), or not tried for ``wait``
        (default: its back-off's) rounds of it."""
        now = self.bucket_rounds.get(bucket, 0)
        last = self.tried.get((bucket, side))
        if last is None:  # never tried: early, unless its time is known (``wait`` given)
            return now >= (1 if wait is None else wait)
        wait = wait if wait is not None else self.backoff.get((bucket, side), self.min_recheck)
        return now - last >= wait

    def observe(self, accepted: list[int], drafted: list[int], draft_seconds: float, forward_seconds: float,
                round_seconds: float, verify_tokens: int) -> None:
        """One round's outcome: accepted/drafted per drafting row and its measured seconds."""
        table = float(self.forward_time(float(verify_tokens))) if self.forward_time is not None else 0.0
        first = self.rounds_seen == 0  # the first measurement replaces the priors outright
        self.rounds_seen += 1
        if self.forward_time is not None:
            self.scale = self._mean(self.scale, forward_seconds / max(table, 1e-9), first)
        self.overhead = self._mean(self.overhead, max(0.0, round_seconds - forward_seconds - draft_seconds), first)
        if drafted:
            self.draft_seconds = draft_seconds if self.draft_seconds == 0 else self._mean(self.draft_seconds,
                                                                                         draft_seconds)
        for a, d in zip(accepted, drafted):
            while len(self.reach_counts) < d:
                self.reach_counts.append(0.0)
                self.accept_counts.append(0.0)
            for k in range(min(a + 1, d)):  # positions 0..a reached; 0..a-1 accepted
                self.reach_counts[k] += 1
                self.accept_counts[k] += float(k < a)
        if self.calibrate and self._last is not None:
            # against the model as updated by this round: the correction keeps only what the
            # shared terms (scale, overhead, draft time) cannot explain for this bucket and cap
            (bsz, _), _ = self._last
            # the pass's width in drafts per row, as played (ragged: the rows' own drafts)
            width = sum(drafted) / max(bsz, 1) if self.ragged else max(0.0, verify_tokens / max(bsz, 1) - 1)
            if self.round_time is not None:
                row = self.round_time.row_array(bsz)
                predicted = float(np.interp(width, np.arange(row.shape[0], dtype=np.float64), row))
            else:
                predicted = self._model_seconds(table, float(bool(drafted)))
            self._correct(round_seconds, predicted, width)
            self._count_hits(accepted, drafted)
        self._last = None

    def _correct(self, round_seconds: float, predicted: float, width: float) -> None:
        """Records the round's measured seconds at its width (drafts per row) where that is a
        whole number (the widths the model is priced at; a ragged round between them teaches
        only its side's ratio) and moves its side's (plain or drafting) measured/model ratio
        (tokens are calibrated by ``_count_hits``: a round's acceptance is far noisier than
        its time, so the two are corrected apart), each at most ``spike`` times its mean."""
        (bsz, cap), _ = self._last
        bucket = batch_bucket(bsz)
        side = (bucket, cap > 0)
        self.bucket_rounds[bucket] = self.bucket_rounds.get(bucket, 0) + 1
        self.tried[side] = self.bucket_rounds[bucket]
        if round_seconds <= 0:
            return
        # (table, key, value, the model's value): a stall (the OS, a page fault) counts as a slow
        # round, ``spike`` times the running mean (the model's before the first measurement)
        updates = [(self.corrections, side, round_seconds / max(predicted, 1e-12), 1.0)]
        if width == int(width):
            updates.append((self.round_times, (bsz, int(width)), round_seconds, predicted))
        for table, key, value, model in updates:
            old = table.get(key)
            value = min(value, self.spike * (model if old is None else old))
            table[key] = value if old is None else (1 - self.calibration_ema) * old + self.calibration_ema * value

    def _count_hits(self, accepted: list[int], drafted: list[int]) -> None:
        """Survival calibration: per position k, the predicted P(draft k accepted | drafts before
        it accepted) summed over the rows that drafted k and reached it, against how many of them
        accepted it (decayed running sums). Conditional, so the deep positions are learned from
        the rows that got there, whichever rows were in the rounds that drafted that deep."""
        _, raw = self._last
        if not drafted or len(drafted) != raw.shape[0]:
            return  # rows changed between cap and observe: skip rather than misalign
        cond = _conditional(raw)  # raw: clamped and non-increasing already (``cap``)
        deepest = max(drafted)
        while len(self.predicted_hits) < deepest:
            self.predicted_hits.append(0.0)
            self.observed_hits.append(0.0)
        for j in range(len(self.predicted_hits)):
            self.predicted_hits[j] *= self.decay
            self.observed_hits[j] *= self.decay
        for b, (a, d) in enumerate(zip(accepted, drafted)):
            for j in range(min(d, cond.shape[1], a + 1)):  # positions reached: 0..a
                self.predicted_hits[j] += float(cond[b, j])
                self.observed_hits[j] += float(a > j)

    def _mean(self, old: float, new: float, replace: bool = False) -> float:
        return new if replace else (1 - self.ema) * old + self.ema * new


def _survival(survival: Tensor | NDArray) -> NDArray:
    """Survival estimates [B, G] as float64 numpy, clamped to [0, 1] and made non-increasing."""
    a = survival.detach().cpu().double().numpy() if isinstance(survival, Tensor) else np.asarray(survival, np.float64)
    return np.minimum.accumulate(np.clip(a, 0.0, 1.0), axis=-1)


def _row_tokens(survival: NDArray, left: NDArray) -> NDArray:
    """survival [B, G], tokens left per row [B] → [B, G+1]: per cap G, each row's expected
    tokens in one round, 1 + Σ_{k ≤ min(G, left-1)} a_k (drafts past its end are cut)."""
    width = survival.shape[1]
    ks = np.arange(1, width + 1, dtype=np.float64)  # [G]
    usable = survival * (ks[None, :] <= (left[:, None] - 1))
    return np.concatenate([np.ones((survival.shape[0], 1)), 1 + np.cumsum(usable, axis=1)], axis=1)


def _conditional(survival: NDArray) -> NDArray:
    """survival [B, G] (non-increasing) → [B, G] P(draft k accepted | the ones before were):
    a_k / a_{k-1}, a_0 = 1 (0 where a_{k-1} is 0)."""
    prev = np.concatenate([np.ones_like(survival[:, :1]), survival[:, :-1]], axis=1)
    return np.where(prev > 0, survival / np.maximum(prev, 1e-12), 0.0)


def batch_bucket(batch_size: int) -> int:
    """Batch sizes share corrections by power of two: 1, 2, 3-4, 5-8, ..."""
    return 1 << max(0, int(batch_size) - 1).bit_length()
