"""The batch engine's admission step: waiting requests join the running batch.

All requests admitted in one round are prefilled in ONE target forward, their prompts
right-padded to the longest (padding masked out, each row at positions 0..p-1), and the
drafter consumes their prompts in one ``consume_many`` call where it has one. On this CPU a
prefill is compute-bound (~36 ms for a 49-token prompt of the embedded target), so one padded
pass saves less than a decode round would (16 prompts: 690 → 575 ms), but it is paid once per
request, and more often per second the faster speculation finishes requests. A lone request
(or prompts of one length) is prefilled without a mask, exactly as batch 1 always was.

The padding slots stay in the ragged cache as holes (``RaggedCache``: masked out, removed by
compaction), like rejected drafts. Each request's first token is drawn by its own rule with its
own randomness, in admission order, as a batch-1 prefill would.

A mixin of ``batch.BatchEngine``; knows the target's forward, the drafter's consume protocol
and the ragged cache, nothing about drafting or verification.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from components.engine.batch_cache import RaggedCache
from components.engine.batch_state import Request, StepOutput, _check_end, _Running
from components.engine.engine import GenerationResult, Sequence, new_randomness, sync_device
from components.engine.kv_slab import preallocate
from components.engine.rules import get_rule


class AdmitStep:
    """``_admit`` and the batched prefill, for ``BatchEngine``."""

    def _admit(self) -> list[StepOutput]:
        """Prefills as many waiting requests as there are free rows; emits each one's first
        token; requests that end there (a stop token, one token asked) leave at once."""
        free = self.max_batch_size - len(self.batch.rows)
        reqs = [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]
        if not reqs:
            return []
        runs, cache = self._prefill_many(reqs)
        outs, keep = [], []
        for i, run in enumerate(runs):
            cut, reason = _check_end(run.request, run.seq.new_tokens, 0)
            if reason:
                run.seq.new_tokens = cut
                outs.append(StepOutput(run.request.request_id, cut, True, reason, self._finish(run, reason)))
                continue
            outs.append(StepOutput(run.request.request_id, list(run.seq.new_tokens)))
            self.batch.rows.append(run)
            keep.append(i)
        if not keep:
            return outs
        if len(keep) < len(runs):
            cache.select(keep)
        if self.batch.cache is None:
            self.batch.cache = cache
        else:
            self.batch.cache.concat(cache)
        return outs

    def _prefill_many(self, reqs: list[Request]) -> tuple[list[_Running], RaggedCache]:
        """One target forward over the prompts of ``reqs`` (right-padded), their first tokens and
        drafter states; the cache of their rows (padding slots masked out)."""
        dev, clock = self.target.device, time.perf_counter()
        lens = [len(r.prompt_ids) for r in reqs]
        width = max(lens)
        ids = torch.zeros(len(reqs), width, dtype=torch.long, device=dev)  # [k, L]
        valid = torch.zeros(len(reqs), width, dtype=torch.bool, device=dev)  # [k, L]
        for i, r in enumerate(reqs):
            ids[i, :lens[i]] = torch.tensor(r.prompt_ids, dtype=torch.long, device=dev)
            valid[i, :lens[i]] = True
        speculate = [r.speculate and self.drafter is not None for r in reqs]
        mask = None if bool(valid.all()) else valid.long()
        out = self.target.forward(ids, attention_mask=mask, layer_ids=self.layer_ids if any(speculate) else (),
                                  use_cache=True)
        last = out.logits[torch.arange(len(reqs), device=dev), torch.tensor(lens, device=dev) - 1]  # [k, V]
        states = self._prompt_states(reqs, speculate, ids, lens, out.hidden)
        runs = []
        for i, req in enumerate(reqs):
            rule, rnd = get_rule(req.rule), new_randomness(req.sampling, req.seed, dev)
            first = rule.sample_target(last[i:i + 1, None], torch.tensor([[lens[i]]], device=dev), rnd)[:, 0]
            seq = Sequence(None, states[i], first, lens[i] + 1, [int(first)])
            runs.append(_Running(req, rule, rnd, seq, GenerationResult([], target_forwards=1), clock))
        sync_device(dev)
        share = (time.perf_counter() - clock) / len(reqs)
        for run in runs:
            run.result.prefill_seconds = share
        return runs, RaggedCache(preallocate(out.cache) if self.preallocate else out.cache, valid)

    def _prompt_states(self, reqs: list[Request], speculate: list[bool], ids: Any, lens: list[int],
                       hidden: Any) -> list[Any]:
        """The drafter state of every speculating request after its prompt (None for plain
        ones): one ``consume_many`` call where the drafter has it."""
        idx = [i for i, s in enumerate(speculate) if s]
        states: list[Any] = [None] * len(reqs)
        if not idx:
            return states
        news = self._consume_each([self.drafter.init_state(1) for _ in idx],
                                  [ids[i:i + 1, :lens[i]] for i in idx],
                                  [hidden[i:i + 1, :lens[i]] if hidden is not None else None for i in idx])
        for i, new in zip(idx, news):
            states[i] = new
        return states

    # provided by BatchEngine
    batch: Any
    waiting: Any
    target: Any
    drafter: Any
    layer_ids: list[int]
    max_batch_size: int
    preallocate: bool
    _consume_each: Any
    _finish: Any
