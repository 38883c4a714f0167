"""Continuous batching: many requests share each target verification pass; requests join and
leave between rounds, each with its own rule, sampling parameters, seed and stop tokens.

One ``step()`` is one round for the whole running batch::

    admit    -- waiting requests (up to ``max_batch_size``) are prefilled together, in one
                right-padded target pass, and their rows appended to the batch's ragged cache;
                each prefill's first token is emitted at once (``admit.Admission``);
    draft    -- per running request, the drafter proposes num_drafts_b ≤ cap tokens on that
                request's own drafter state (DLoop stages as in ``chain.draft_chain``; a
                drafter declaring ``TARGET_KV`` reads the request's row of the batch's cache);
                0 for plain-decoding requests and for those whose drafter proposed nothing
                (``draft.Drafting``): they take part with their one token, a plain round;
    verify   -- ONE target forward over [B, G+1] (row b: x_{n_b-1}, its drafts, padding),
                each row at its own positions over its own valid cache slots (``RaggedCache``);
                then each request's rule decides its accepted prefix and next token;
    accept   -- the accepted slots become committed, rejected and padding slots become holes;
                each drafter state consumes its verified positions' hidden states (never
                recomputed); the round is committed as in the batch-1 engine
                (``chain.commit_round``: carryover rows, emitted tokens, the round's count);
    finish   -- a request ends at ``max_new_tokens``, at one of its stop tokens (included in the
                output) or when cancelled; its cache rows are freed before the next round; a
                drafter declaring ``LEARNS_RESPONSES`` (suffix decoding) is handed each response
                that ended (not cancelled ones), whether or not it speculated.

Per-request randomness (a generator and a Gumbel seed per request) is consumed in the same
order as the batch-1 ``SpeculativeEngine`` would for that request alone, so a request's output
does not depend on what else is in the batch (greedy: equal to the target's own greedy output).

Each request keeps a batch-1 drafter state; drafters declaring the batched capabilities propose
and consume for all rows in one call (``draft.py``). The verify pass and the target cache are
batched. Chains, and a token tree for a lone request (``tree_round.py``). The drafting settings
(γ, DLoop, carryover, trees, preallocation) are one ``EngineSettings``; each row carries its
own rule. This module knows the engine protocol of drafters, the rules and the chain's commit
step; nothing about tokenization, HTTP or asyncio (``stream.py`` streams on top of ``step``).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from components.drafters.capabilities import Capability, has
from components.engine.adaptive.policy import DraftLengthPolicy, FixedDraftLength
from components.engine.batch.admit import Admission
from components.engine.batch.draft import Drafting
from components.engine.batch.state import Batch, Request, Row, StepOutput
from components.engine.batch.stats import EngineStats
from components.engine.batch.tree_round import TreeRounds
from components.engine.cache.prefix import PrefixStore
from components.engine.chain import commit_round
from components.engine.core import EngineDrafter, GenerationResult, sync_device
from components.engine.rules import Rule
from components.engine.settings import EngineSettings, resolve_settings


class BatchEngine:
    """Continuous-batching speculative decoding of ``drafter`` (or plain decoding) on ``target``."""

    def __init__(self, target: Any, drafter: EngineDrafter | None = None, num_speculative_tokens: int | None = None,
                 loop_stages: int = EngineSettings.loop_stages, loop_gate: float = EngineSettings.loop_gate,
                 carryover: bool = EngineSettings.carryover, max_batch_size: int = 16, compact_at: float = 0.5,
                 draft_length: DraftLengthPolicy | None = None, preallocate: bool = EngineSettings.preallocate,
                 tree_budget: int = EngineSettings.tree_budget, tree_builder: str = EngineSettings.tree_builder,
                 settings: EngineSettings | None = None, learn_responses: bool = True, prefix_tokens: int = 0):
        """``drafter=None``: every request decodes plainly. ``settings``: the drafting settings,
        resolved already (``settings.resolve_settings``); else resolved here from γ, DLoop,
        carryover, ``preallocate`` (the batch's KV cache grows in place in a buffer with
        headroom, ``cache.slab``) and ``tree_budget`` > 0 (a lone request of a rule with
        ``coupled`` drafts a token tree of that many nodes, ``tree_builder``: ddtree or
        causal, instead of a chain: ``tree_round.py``). ``compact_at``: the fraction of the
        ragged cache's width that compaction would free, above which it is compacted after a
        round. ``draft_length``: the per-round cap on drafts (default fixed γ·stages;
        ``AdaptiveDraftLength`` shrinks it under load). ``learn_responses``: hand each finished
        response to a drafter declaring ``LEARNS_RESPONSES`` (False: the caller does, e.g. keyed
        by prompt so that a prompt run again is not drafted from its own answer). ``prefix_tokens``
        > 0: a fast-step target's prompts leave their keys and values, up to that many tokens, for
        later prompts that start alike to copy instead of compute (``cache.prefix``)."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.settings = settings or resolve_settings(drafter, num_speculative_tokens, loop_stages, loop_gate, carryover,
                                                     preallocate, tree_budget, tree_builder)
        self.target, self.drafter = target, drafter
        self.max_batch_size, self.compact_at = int(max_batch_size), float(compact_at)
        self.layer_ids: list[int] = list(drafter.layer_ids) if drafter is not None else []
        self.learns = learn_responses and drafter is not None and has(drafter, Capability.LEARNS_RESPONSES)
        self.draft_length = draft_length or FixedDraftLength()
        self.waiting: deque[Request] = deque()
        self.batch = Batch()
        self.stats = EngineStats()
        self._cancelled: set[str] = set()
        # a fast-step target keeps the running batch in rows of one static slab (cache.slots)
        self.pool = target.slot_pool(self.max_batch_size) if target.batch_cache == "slots" else None
        self.prefixes = PrefixStore(prefix_tokens) if self.pool is not None and prefix_tokens > 0 else None
        self.admission = Admission(target, drafter, self.layer_ids, self.settings.preallocate, self.pool, self.prefixes)
        self.drafting = Drafting(drafter, self.settings, self.draft_length)
        self.trees = TreeRounds(target, drafter, self.settings if self.pool is None else
                                dataclasses.replace(self.settings, tree_budget=0))  # trees gather HF cache rows

    @property
    def num_speculative_tokens(self) -> int:
        """γ as configured (0 without a drafter)."""
        return self.settings.num_speculative_tokens

    @property
    def max_cap(self) -> int:
        """The most drafts a round may verify: γ·stages."""
        return self.settings.max_cap

    # ------------------------------------------------------------------ requests
    def add(self, request: Request) -> str:
        """Queues ``request``; it joins the batch at the next ``step``."""
        self.waiting.append(request)
        return request.request_id

    def cancel(self, request_id: str) -> None:
        """Stops ``request_id`` at the next ``step`` and frees its cache rows (no-op if unknown)."""
        self._cancelled.add(request_id)

    @property
    def will_admit(self) -> bool:
        """The next round prefills a waiting request (a long round)."""
        return bool(self.waiting) and len(self.batch.rows) < self.max_batch_size

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.batch.rows)

    @property
    def running(self) -> list[str]:
        return [r.request.request_id for r in self.batch.rows]

    @property
    def caps(self) -> deque[int]:
        """The draft cap chosen each of the last rounds with speculating rows (at most
        ``CAPS_KEPT``; ``capped_rounds`` counts them all)."""
        return self.drafting.caps

    @property
    def capped_rounds(self) -> int:
        return self.drafting.capped_rounds

    # ------------------------------------------------------------------ one round
    @torch.no_grad()
    def step(self) -> list[StepOutput]:
        """One round for every running request (after admitting waiting ones)."""
        outputs = self._round()
        if self.learns:  # e.g. suffix decoding's global tree, on the thread that drafts
            for out in outputs:
                if out.finished and out.result is not None and out.finish_reason != "cancelled":
                    self.drafter.observe(list(out.result.tokens))
        return outputs

    def _round(self) -> list[StepOutput]:
        start = time.perf_counter()
        outputs = self._drop_cancelled()
        free = self.max_batch_size - len(self.batch.rows)
        joining = [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]
        hits = self.prefixes.hits if self.prefixes is not None else 0
        outputs += self.admission.admit(self.batch, joining)
        self.stats.prompt_tokens += sum(len(r.prompt_ids) for r in joining)
        self.stats.prefix_hit_tokens += (self.prefixes.hits if self.prefixes is not None else 0) - hits
        prefill = time.perf_counter() - start  # admission (dropping cancelled rows: next to nothing)
        if not self.batch.rows:
            self._record(outputs, 0, [], [], 0.0, 0.0, start, prefill)
            return outputs
        clock, rows = time.perf_counter(), len(self.batch.rows)
        lone = self.trees.lone_row(self.batch)
        if lone is not None:
            if lone.pending:  # the tree round's drafter reads every committed token
                self.drafting.flush([lone])
            outs, accepted, nodes, draft_seconds, verify_seconds = self.trees.round(self.batch, lone)
            self._record(outputs + outs, 1, accepted, nodes, draft_seconds, verify_seconds, start, prefill)
            return outputs + outs
        draft_seconds = self.drafting.draft(self.batch.rows, draining=not self.waiting, cache=self.batch.cache)
        logits, hidden, forward_seconds = self._verify_forward()
        drafting = [r for r in self.batch.rows if r.drafts is not None]
        outputs += self._accept(logits, hidden, forward_seconds)
        accepted, drafted = [r.result.accepted[-1] for r in drafting], [r.drafts.shape[1] for r in drafting]
        self.draft_length.observe(accepted, drafted, draft_seconds, forward_seconds, time.perf_counter() - clock,
                                  logits.shape[0] * logits.shape[1])
        self._record(outputs, rows, accepted, drafted, draft_seconds, forward_seconds, start, prefill)
        return outputs

    def _record(self, outputs: list[StepOutput], rows: int, accepted: list[int], drafted: list[int],
                draft_seconds: float, forward_seconds: float, start: float, prefill_seconds: float) -> None:
        if not outputs and not rows:
            return
        self.stats.record(rows, accepted, drafted, sum(len(o.new_tokens) for o in outputs),
                          sum(o.finished for o in outputs), draft_seconds, forward_seconds,
                          time.perf_counter() - start, prefill_seconds)

    def generate(self, requests: Iterable[Request]) -> list[GenerationResult]:
        """Runs ``requests`` to completion; results in the order given."""
        order = [self.add(r) for r in requests]
        done: dict[str, GenerationResult] = {}
        while self.has_work:
            for out in self.step():
                if out.finished and out.result is not None:
                    done[out.request_id] = out.result
        return [done[i] for i in order]

    # ------------------------------------------------------------------ phases
    def _drop_cancelled(self) -> list[StepOutput]:
        if not self._cancelled:
            return []
        outs = [StepOutput(r.request_id, [], True, "cancelled") for r in self.waiting
                if r.request_id in self._cancelled]
        self.waiting = deque(r for r in self.waiting if r.request_id not in self._cancelled)
        gone = [i for i, r in enumerate(self.batch.rows) if r.request.request_id in self._cancelled]
        for i in gone:
            row = self.batch.rows[i]
            outs.append(StepOutput(row.request.request_id, [], True, "cancelled", row.finish("cancelled")))
        self.batch.remove(gone)
        self._cancelled.clear()
        return outs

    def _verify_forward(self) -> tuple[Tensor, Tensor | None, float]:
        """One target forward over every row's [x_{n-1}, drafts, padding] → logits [B, G+1, V],
        hidden [B, G+1, n, H] (or None), seconds."""
        rows, dev = self.batch.rows, self.target.device
        width = 1 + max(r.num_drafts for r in rows)
        # [B, G+1]: x_{n-1} (the last of the row's new tokens), its drafts, padding; built as lists,
        # one tensor op (a round's small torch ops cost more than their work, docs/results.md)
        ids = torch.tensor([[r.seq.new_tokens[-1]] + ([] if r.drafts is None else r.drafts[0].tolist())
                            + [0] * (width - 1 - r.num_drafts) for r in rows], dtype=torch.long, device=dev)
        cache = self.batch.cache
        # a slot cache knows each row's positions (its committed slots); an HF cache is told them
        positions = None if self.pool is not None else torch.tensor(
            [[r.seq.length - 1 + j for j in range(width)] for r in rows], dtype=torch.long, device=dev)  # [B, G+1]
        t0 = time.perf_counter()
        # each row's real tokens: a slot cache leaves the padding out of the pass (ragged kernel rows)
        mask = cache.attention_mask(width, [1 + r.num_drafts for r in rows])
        out = self.target.forward(ids, attention_mask=mask, layer_ids=self.layer_ids,
                                  cache=cache if self.pool is not None else cache.cache, use_cache=True,
                                  position_ids=positions)
        sync_device(dev)
        return out.logits, out.hidden, time.perf_counter() - t0

    def _accept(self, logits: Tensor, hidden: Tensor | None, forward_seconds: float) -> list[StepOutput]:
        """logits [B, G+1, V], hidden [B, G+1, n, H] → every row's output this round; commits the
        accepted slots, feeds the drafter, frees finished rows, compacts when it pays."""
        rows, outs, finished = self.batch.rows, [], []
        t0 = time.perf_counter()
        verdicts = self._verdicts(logits)
        states = self.drafting.consume_verified(rows, [a for a, _ in verdicts], hidden)
        shared = (time.perf_counter() - t0) / len(rows)
        for b, (row, (a, nxt)) in enumerate(zip(rows, verdicts)):
            row.seq, emitted = commit_round(self.drafter, self.settings, row.seq, states[b], row.drafts, a, nxt,
                                            hidden[b:b + 1] if hidden is not None else None, row.result,
                                            proposal=row.proposal)
            row.result.verify_seconds += forward_seconds + shared
            out = row.output(emitted, len(row.seq.new_tokens) - len(emitted))
            outs.append(out)
            if out.finished:
                finished.append(b)
        self.batch.cache.commit([a + 1 for a, _ in verdicts])  # x_{n-1} and the accepted drafts of each row
        self.batch.remove(finished)
        if self.batch.cache is not None and self.batch.cache.reclaimable() > self.compact_at:
            self.batch.cache.compact()
        return outs

    def _verdicts(self, logits: Tensor) -> list[tuple[int, Tensor]]:
        """logits [B, G+1, V] → per row (accepted drafts, next token [1]): rows whose rule
        verifies many at once (``Rule.verify_rows``: no per-request randomness), one call per
        such rule; the others one by one, each with its own randomness."""
        rows, dev = self.batch.rows, logits.device
        verdicts: list[tuple[int, Tensor] | None] = [None] * len(rows)
        groups: dict[Rule, list[int]] = {}
        for b, row in enumerate(rows):
            if row.rule.verifies_rows:
                groups.setdefault(row.rule, []).append(b)
            else:
                verdicts[b] = self._verify_row(row, logits[b:b + 1])
        empty = torch.zeros(0, dtype=torch.long, device=dev)
        for rule, idx in groups.items():
            mine = logits if len(idx) == len(rows) else logits[torch.tensor(idx, device=dev)]
            if all(rows[b].drafts is None for b in idx):  # plain rows only: no drafts to pad
                drafts = empty.view(len(idx), 0)
                lens = torch.zeros(len(idx), dtype=torch.long, device=dev)
            else:
                drafts, lens = _padded([rows[b].drafts for b in idx], dev)
            res = rule.verify_rows(drafts, lens, mine[:, :drafts.shape[1] + 1])
            for j, (b, a) in enumerate(zip(idx, res.num_accepted.tolist())):
                verdicts[b] = (a, res.next_token[j:j + 1])
        return verdicts  # type: ignore[return-value]

    def _verify_row(self, row: Row, logits: Tensor) -> tuple[int, Tensor]:
        """Row logits [1, G+1, V] → (accepted drafts, next token [1])."""
        dev, start = logits.device, row.seq.length
        if row.drafts is None:  # plain decoding: the target's own choice at position n
            token = row.rule.sample_target(logits[:, :1], torch.tensor([[start]], device=dev), row.rnd)
            return 0, token[:, 0]
        g = row.drafts.shape[1]
        positions = torch.arange(start, start + g + 1, device=dev)[None, :]
        res = row.rule.verify(row.drafts, logits[:, :g + 1], row.proposal, positions, row.rnd)
        return int(res.num_accepted[0]), res.next_token


def _padded(drafts: list[Tensor | None], device: torch.device) -> tuple[Tensor, Tensor]:
    """Rows' drafts ([1, g] each, or None for a plain row) → drafts [R, G] long (padding never read
    past a row's length), lengths [R] long; built in numpy on a CPU (torch's small ops cost more
    than the verification they feed)."""
    lens = [0 if d is None else d.shape[1] for d in drafts]
    if device.type != "cpu":
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return (torch.nn.utils.rnn.pad_sequence([empty if d is None else d[0] for d in drafts], batch_first=True),
                torch.tensor(lens, dtype=torch.long, device=device))
    out = np.zeros((len(drafts), max(lens)), dtype=np.int64)
    for r, d in enumerate(drafts):
        if d is not None:
            out[r, :d.shape[1]] = d[0].numpy()
    return torch.from_numpy(out), torch.from_numpy(np.asarray(lens, dtype=np.int64))
