"""The batch engine's admission: waiting requests join the running batch.

All requests admitted in one round are prefilled in ONE target forward, their prompts
right-padded to the longest (padding masked out, each row at positions 0..p-1), and the
drafter consumes their prompts in one ``consume_many`` call where it declares
``Capability.BATCHED_CONSUME`` (``draft.consume_rows``). A prefill is paid once per request,
so batching it matters less than batching decode rounds; a lone request (or prompts of one
length) is prefilled without a mask, exactly as batch 1 always was.

The padding slots stay in the ragged cache as holes (``RaggedCache``: masked out, removed by
compaction), like rejected drafts. A target whose batch cache is a static slab
(``batch_cache == "slots"``: the fast step) prefills each prompt into a free row of its own
instead (``SlotCache``: no padding, no holes), copying the longest prefix that an earlier prompt
left in ``prefixes`` (``cache.prefix.PrefixStore``) instead of computing it. Each request's first
token is drawn by its own rule with its own randomness, in admission order, as a batch-1 prefill
would.

Knows the target's forward, the drafter's consume protocol and the ragged cache; nothing about
drafting or verification.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from components.engine.batch.draft import consume_rows
from components.engine.batch.state import Batch, Request, Row, StepOutput
from components.engine.cache.prefix import PrefixStore
from components.engine.cache.ragged import RaggedCache
from components.engine.cache.slab import preallocate
from components.engine.cache.slots import SlotCache, SlotPool
from components.engine.core import GenerationResult, SequenceState, new_randomness, sync_device
from components.engine.rules import get_rule


class Admission:
    """Prefills requests joining the batch (``admit``), for ``BatchEngine``."""

    def __init__(self, target: Any, drafter: Any, layer_ids: list[int], preallocate_cache: bool = True,
                 pool: SlotPool | None = None, prefixes: PrefixStore | None = None):
        """``pool``: the slab of a target whose ``batch_cache`` is "slots" (prompts prefilled
        one by one into its free rows); None: one padded forward into a ragged HF cache.
        ``prefixes``: prompt prefixes kept across requests (with ``pool`` only)."""
        self.target, self.drafter = target, drafter  # drafter None: every request decodes plainly
        self.layer_ids = layer_ids
        self.preallocate_cache = bool(preallocate_cache)
        self.pool, self.prefixes = pool, prefixes

    def admit(self, batch: Batch, reqs: list[Request]) -> list[StepOutput]:
        """Prefills ``reqs`` into ``batch``; emits each one's first token; requests that end
        there (a stop token, one token asked) leave at once."""
        if not reqs:
            return []
        rows, cache = self.prefill(reqs)
        outs, keep = [], []
        for i, row in enumerate(rows):
            out = row.output(list(row.seq.new_tokens), 0)
            outs.append(out)
            if not out.finished:
                keep.append(i)
        if len(keep) < len(rows):
            cache.select(keep)  # frees the finished ones' rows (a slot cache hands them back)
        if not keep:
            return outs
        batch.join([rows[i] for i in keep], cache)
        return outs

    def prefill(self, reqs: list[Request]) -> tuple[list[Row], RaggedCache | SlotCache]:
        """The prompts of ``reqs`` through the target, their first tokens and drafter states; the
        cache of their rows."""
        dev, clock = self.target.device, time.perf_counter()
        speculate = [r.speculate and self.drafter is not None for r in reqs]
        layer_ids = self.layer_ids if any(speculate) else ()
        if self.pool is not None:
            last, prompts, hidden, cache = self._prefill_slots(reqs, layer_ids)
        else:
            last, prompts, hidden, cache = self._prefill_ragged(reqs, layer_ids)
        states = self._prompt_states(speculate, prompts, hidden)
        rows = []
        for i, req in enumerate(reqs):
            n = prompts[i].shape[1]
            rule, rnd = get_rule(req.rule), new_randomness(req.sampling, req.seed, dev)
            first = rule.sample_target(last[i:i + 1, None], torch.tensor([[n]], device=dev), rnd)[:, 0]
            seq = SequenceState(None, states[i], first, n + 1, [int(first)])
            rows.append(Row(req, rule, rnd, seq, GenerationResult([], target_forwards=1), clock))
        sync_device(dev)
        share = (time.perf_counter() - clock) / len(reqs)
        for row in rows:
            row.result.prefill_seconds = share
        return rows, cache

    def _prefill_ragged(self, reqs: list[Request], layer_ids: Any) -> tuple[Tensor, list[Tensor], list[Any], RaggedCache]:
        """ONE target forward over the prompts, right-padded → last logits [k, V], prompts [1, L_i]
        and their taps [1, L_i, n, H] (or None), the ragged cache (padding slots masked out)."""
        dev = self.target.device
        lens = [len(r.prompt_ids) for r in reqs]
        width = max(lens)
        ids = torch.zeros(len(reqs), width, dtype=torch.long, device=dev)  # [k, L]
        valid = torch.zeros(len(reqs), width, dtype=torch.bool, device=dev)  # [k, L]
        for i, r in enumerate(reqs):
            ids[i, :lens[i]] = torch.tensor(r.prompt_ids, dtype=torch.long, device=dev)
            valid[i, :lens[i]] = True
        mask = None if bool(valid.all()) else valid.long()
        out = self.target.forward(ids, attention_mask=mask, layer_ids=layer_ids, use_cache=True)
        last = out.logits[torch.arange(len(reqs), device=dev), torch.tensor(lens, device=dev) - 1]  # [k, V]
        hidden = [out.hidden[i:i + 1, :lens[i]] if out.hidden is not None else None for i in range(len(reqs))]
        cache = RaggedCache(preallocate(out.cache) if self.preallocate_cache else out.cache, valid)
        return last, [ids[i:i + 1, :lens[i]] for i in range(len(reqs))], hidden, cache

    def _prefill_slots(self, reqs: list[Request], layer_ids: Any) -> tuple[Tensor, list[Tensor], list[Any], SlotCache]:
        """Each prompt into its own free row of the slab (one pass each: no padding) → as
        ``_prefill_ragged``, with a ``SlotCache`` of the new rows."""
        dev = self.target.device
        lasts, prompts, hidden, cache = [], [], [], SlotCache(self.pool, [], [])
        for r in reqs:
            ids = torch.tensor([r.prompt_ids], dtype=torch.long, device=dev)  # [1, L]
            out = self.target.prefill_slot(self.pool, ids, layer_ids, self.prefixes)
            lasts.append(out.logits[0, -1])
            prompts.append(ids)
            hidden.append(out.hidden)
            cache.concat(out.cache)
        return torch.stack(lasts), prompts, hidden, cache

    def _prompt_states(self, speculate: list[bool], prompts: list[Tensor], hidden: list[Any]) -> list[Any]:
        """prompts [1, L_i], their taps [1, L_i, n, H] (or None) → the drafter state of every
        speculating request after its prompt (None for plain ones), in one ``consume_rows`` call."""
        idx = [i for i, s in enumerate(speculate) if s]
        states: list[Any] = [None] * len(speculate)
        if not idx:
            return states
        news = consume_rows(self.drafter, [self.drafter.init_state(1) for _ in idx], [prompts[i] for i in idx],
                            [hidden[i] for i in idx])
        for i, new in zip(idx, news):
            states[i] = new
        return states
