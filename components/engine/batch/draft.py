"""The drafter's side of the batch engine's rounds: this round's draft cap, the drafts of every
speculating row, and the drafter's updates after verification (``Drafting``).

The cap is the policy's (``adaptive.round_cap``) over the rows' survival estimates
(``adaptive.RowSurvival``), given, when no request waits to join, each row's tokens left (the
batch is draining); a policy that does not adapt (``FixedDraftLength``) leaves it at γ·stages.

A drafter declaring ``Capability.BATCHED_PROPOSE`` (block drafters; EAGLE-3, MTP: one pass per
draft step) drafts the rows that draft in one stage together, in padded, masked drafter
passes; each row's readout then draws from that row's own sampling parameters and generator,
exactly as ``chain.draft_chain`` would for the row alone (so sampled output does not depend on
the rest of the batch). Rows whose cap this round needs more than one DLoop stage, and
drafters without it, draft one by one (``chain.draft_chain``, by the row's own rule). Likewise
``Capability.BATCHED_CONSUME`` turns the per-row ``consume`` calls into one ``consume_many``
(``consume_rows``). Either way the output is the same.

A row whose drafter proposes nothing this round (an empty ``Proposal``: prompt lookup without
a match, batched or not) is a plain row of the round: one token in the verify pass, the
rule's own target sample, a plain round in its record. A speculating row's plain round (cap 0,
or nothing proposed) only records its token and hidden state (``pending``);
the drafter consumes them when the row drafts again (``flush``), so cap-0 rounds cost what
plain decoding costs. A drafter declaring ``Capability.PREVIEWS`` (suffix decoding, the hybrid)
tells, before the cap is picked, the confidences of the draft it will make (a lookup over the
row's ids, deferred ones included), so an adaptive cap is priced on this round's own draft
(draft-then-decide) rather than on the last round's; while the previews keep offering drafts
that are not worth their slots (a large batch), they back off (``PreviewBackoff``). A drafter
without previews asks the cap every round, and while the cap keeps answering 0 the asking backs
off the same way (the cap's arithmetic costs a few percent of a step at batch 1): those rounds
are plain.

A drafter declaring ``Capability.TARGET_KV`` reads the target's own K/V: each drafting row's
state is handed views of its row of the batch's cache (``core.attach_target_kv``; ``RaggedCache``
rows with their holes masked, ``SlotCache`` rows as their committed slots) right before the
batched or the per-row draft, after ``flush`` (whose ``consume`` would drop them). At that point
the cache holds exactly each row's committed context, n-1 positions: last round's verified slots
were committed after its verify pass, and the rows admitted this round joined the cache with
their prompts before any drafting. Knows the drafter's engine protocol, the chain's drafting
step and the draft-length policy; of the target cache only its rows' order (batch row b is
cache row b) and how to hand views of it over; nothing about verification.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import numpy as np
import torch
from torch import Tensor

from components.drafters.base import Proposal
from components.drafters.capabilities import Capability, has
from components.engine.adaptive.policy import DraftLengthPolicy, batch_bucket
from components.engine.adaptive.rows import round_cap
from components.engine.batch.state import Row
from components.engine.chain import draft_chain, num_drafts_for
from components.engine.core import attach_target_kv, sync_device
from components.engine.settings import EngineSettings

CAPS_KEPT = 4096  # caps a long-running engine remembers (for dashboards and benchmarks)


def consume_rows(drafter: Any, states: list[Any], tokens: list[Tensor], hidden: list[Tensor | None]) -> list[Any]:
    """``consume`` per row (tokens each [1, T_i], hidden each [1, T_i, n, H] or None), in one
    ``consume_many`` call when the drafter declares ``BATCHED_CONSUME`` and every row has states."""
    if has(drafter, Capability.BATCHED_CONSUME) and all(h is not None for h in hidden):
        return drafter.consume_many(states, tokens, hidden)
    return [drafter.consume(s, t, h) for s, t, h in zip(states, tokens, hidden)]


class Drafting:
    """Caps, drafts and drafter updates of the batch's rows, for ``BatchEngine``."""

    def __init__(self, drafter: Any, settings: EngineSettings, policy: DraftLengthPolicy):
        self.drafter, self.settings, self.policy = drafter, settings, policy
        self.batched = drafter is not None and has(drafter, Capability.BATCHED_PROPOSE)
        self.previews = drafter is not None and has(drafter, Capability.PREVIEWS) and policy.adapts
        self.caps: deque[int] = deque(maxlen=CAPS_KEPT)  # the cap chosen each of the last rounds
        self.capped_rounds = 0  # rounds that chose a cap, since the engine started
        self.defer_plain_updates = True  # plain rounds of speculating rows defer the drafter's update
        self.backoff = PreviewBackoff()  # previews skipped while none is worth drafting
        self.quiet_caps = PreviewBackoff()  # no previews: caps not asked while they keep answering 0

    # ------------------------------------------------------------------ drafting
    def draft(self, rows: list[Row], draining: bool, cache: Any = None) -> float:
        """Drafts for every speculating row under this round's cap; returns the seconds spent.
        ``draining``: no request waits to join. ``cache``: the batch's target cache (row b of it
        is ``rows[b]``'s), read by a drafter declaring ``Capability.TARGET_KV``."""
        for row in rows:  # last round's outcome, for the rows' own records
            if row.drafts is not None and row.result.accepted:
                row.estimate.settle(row.num_drafts, row.result.accepted[-1])
        looks = self.previews and self.backoff.due(len(rows))
        offered, blind = self._preview(rows) if looks else (0, 0)
        # a previewed round where no row has a draft to make needs no cap
        asks = looks and (offered or blind) if self.previews else self.quiet_caps.due(len(rows))
        cap = self._cap(rows, draining) if asks else 0
        lengths = self._lengths(rows, cap)  # [B] this round's drafts per row
        if looks:
            self.backoff.saw(len(rows), offered, any(lengths))
        elif asks and self.policy.adapts:  # a cap asked without previews: 0 is its "not worth it"
            self.quiet_caps.saw(len(rows), 1, any(lengths))
        spent = self.flush([r for r, n in zip(rows, lengths) if r.pending and n])
        together: list[tuple[Row, int]] = []
        for b, row in enumerate(rows):
            # as the batch-1 round: at least one draft, overshoot cut (same randomness use)
            num_drafts = num_drafts_for(lengths[b], row.remaining) if lengths[b] else 0
            row.proposal, row.drafts = None, None
            if num_drafts == 0:
                continue
            if self.batched and num_drafts <= self.settings.num_speculative_tokens:  # one stage
                row.seq.draft_state = attach_target_kv(self.drafter, row.seq.draft_state, cache, b)
                together.append((row, num_drafts))
                continue
            t0 = time.perf_counter()
            _keep(row, *draft_chain(self.drafter, self.settings, row.rule, row.seq, num_drafts, row.rnd, cache, b))
            sync_device(row.seq.last_token.device)
            row.result.draft_seconds += time.perf_counter() - t0
            spent += time.perf_counter() - t0
        spent += self._draft_together(together)
        for row in rows:
            row.estimate.refresh(row.proposal.confidences if row.proposal is not None else None, self.policy.calibrate)
        return spent

    def _preview(self, rows: list[Row]) -> tuple[int, int]:
        """Draft-then-decide: each speculating row's estimate from the confidences of the draft
        its drafter will make this round (``preview``, over the ids its plain rounds deferred and
        the last token), zero past that draft's length; a row it cannot preview keeps its own.
        Returns how many rows previewed a draft, and how many could not be previewed."""
        max_cap, offered, blind = self.settings.max_cap, 0, 0
        for row in rows:
            if not row.speculates:
                continue
            last = row.seq.last_token[:, None]  # [1, 1]
            recent = torch.cat([t for t, _ in row.pending] + [last], dim=1) if row.pending else last  # [1, k+1]
            conf = self.drafter.preview(row.seq.draft_state, recent)  # [1, g] or None
            blind += conf is None
            if conf is not None:
                conf = conf.detach()
                padded = np.zeros((1, max_cap))
                padded[0, :min(conf.shape[1], max_cap)] = (conf if conf.device.type == "cpu" else conf.cpu()).numpy()[0, :max_cap]
                row.estimate.refresh(padded, self.policy.calibrate)
                offered += conf.shape[1] > 0
        return offered, blind

    def _draft_together(self, rows: list[tuple[Row, int]]) -> float:
        """Drafts of ``rows`` (row, num_drafts) in one ``propose_many`` call, each of its own
        length, picked by its own rule with its own randomness."""
        if not rows:
            return 0.0
        t0 = time.perf_counter()
        last = torch.cat([row.seq.last_token for row, _ in rows])  # [R]
        samplings = [row.rule.draft_sampling(row.rnd) for row, _ in rows]
        props = self.drafter.propose_many([row.seq.draft_state for row, _ in rows], last, samplings,
                                          [g for _, g in rows], generators=[row.rnd.generator for row, _ in rows])
        for (row, _), prop in zip(rows, props):  # each cut to at most its row's length
            g = prop.tokens.shape[1]  # 0: nothing proposed for this row
            positions = torch.arange(row.seq.length, row.seq.length + g, device=last.device)[None, :]
            _keep(row, prop, row.rule.pick_drafts(prop, positions, row.rnd))
        sync_device(last.device)
        seconds = time.perf_counter() - t0
        for row, _ in rows:
            row.result.draft_seconds += seconds / len(rows)
        return seconds

    def _cap(self, rows: list[Row], draining: bool) -> int:
        """This round's draft cap from the policy, over the rows that speculate."""
        rows = [r for r in rows if r.speculates]
        max_cap = self.settings.max_cap
        if not rows or max_cap == 0:
            return 0
        if not self.policy.adapts:
            return max_cap
        # draining: the batch's time is that of its last row
        cap = round_cap(self.policy, [r.estimate for r in rows], max_cap,
                        [r.remaining for r in rows] if draining else None)
        self.caps.append(cap)
        self.capped_rounds += 1
        return cap

    def _lengths(self, rows: list[Row], cap: int) -> list[int]:
        """Each row's drafts this round: the cap for a speculating row, or the policy's own
        length for it where it gives one (``row_lengths``, over the speculating rows); 0 for
        the others."""
        per_row = iter(self.policy.row_lengths or [])  # set by the policy's ``cap`` this round
        return [min(cap, next(per_row, cap)) if row.speculates and cap else 0 for row in rows]

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


class PreviewBackoff:
    """When previews keep offering drafts that are not worth their slots (a large batch, where a
    draft's slot costs most of what a plain token does), previewing every row every round costs
    more than it finds: after ``quiet`` such rounds in a row, the next previews wait 1, 2, 4, …
    rounds, at most ``longest``, and a round that drafts again resets it. Per batch-size bucket
    (1, 2, 3-4, 5-8, ...). Rounds whose previews offer nothing (no match anywhere: prompt lookup
    or suffix decoding between repeats) leave it as it was, so a small batch whose drafts pay
    whenever there is one keeps looking every round. Skipped rounds are plain rounds."""

    def __init__(self, quiet: int = 4, longest: int = 16):
        self.quiet, self.longest = quiet, longest
        self.streak: dict[int, int] = {}  # bucket -> rounds in a row offering drafts not worth drafting
        self.wait: dict[int, int] = {}  # bucket -> rounds the last back-off skipped
        self.skip: dict[int, int] = {}  # bucket -> rounds still to skip

    def due(self, batch_size: int) -> bool:
        """Whether this round previews (else it is skipped, and counted)."""
        b = batch_bucket(batch_size)
        if self.skip.get(b, 0) > 0:
            self.skip[b] -= 1
            return False
        return True

    def saw(self, batch_size: int, offered: int, drafts: bool) -> None:
        """A previewing round: ``offered`` rows previewed a draft, ``drafts`` whether any drafts."""
        b = batch_bucket(batch_size)
        if drafts:
            self.streak[b] = self.wait[b] = 0
        elif offered:
            self.streak[b] = self.streak.get(b, 0) + 1
            if self.streak[b] >= self.quiet:
                self.wait[b] = min(max(1, 2 * self.wait.get(b, 0)), self.longest)
                self.skip[b] = self.wait[b]


def _keep(row: Row, proposal: Proposal, drafts: Tensor) -> None:
    """This round's proposal and drafts [1, G] for ``row``; G = 0 makes it a plain row."""
    row.proposal, row.drafts = (proposal, drafts) if drafts.shape[1] > 0 else (None, None)
