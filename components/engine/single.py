"""The batch-1 engines' loop: one request at a time, lossless under its rule.

``SpeculativeEngine`` runs the chain round of ``chain.py`` (draft → verify → accept) until
``max_new_tokens`` new tokens exist; ``decode`` is the loop it shares with ``tree.TreeEngine``
(a prefill, then rounds of a ``RoundStep``);
``target_only_generate`` is the baseline every speedup is measured against. A generation of R
rounds costs exactly R + 1 target forwards (the invariant of ``core.py``).

What this module leaves to others:
* batch size 1 (``batch.BatchEngine`` runs the same steps over many requests, with stop tokens,
  cancellation and an adaptive draft cap);
* chains (``tree.TreeEngine`` drafts token trees); γ is fixed here, shortened only so as not to
  overshoot ``max_new_tokens`` (the drafter may propose fewer; a round it proposes nothing
  in is a plain step, ``chain.verify_chain``);
* no stop tokens: generation runs for exactly ``max_new_tokens`` tokens.

Knows nothing about tokenization (token id lists in and out), drafter families (only the
protocol ``core.EngineDrafter``) or how rules verify.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from components.drafters.base import DEFAULT_SAMPLING
from components.engine.cache.slab import preallocate
from components.engine.chain import chain_round, prefill
from components.engine.core import (
    EngineDrafter,
    GenerationResult,
    SequenceState,
    new_randomness,
    positions,
    sync_device,
)
from components.engine.rules import RoundRandomness, Rule, get_rule
from components.engine.settings import EngineSettings, resolve_settings
from components.spec.sampling import SamplingParams

RoundStep = Callable[[Any, EngineDrafter, EngineSettings, Rule, SequenceState, int, RoundRandomness, GenerationResult],
                     SequenceState]  # (target, drafter, settings, rule, seq, remaining, rnd, res) → seq


class SpeculativeEngine:
    """Draft-verify rounds of ``drafter`` against ``target`` under one acceptance rule, chains."""

    def __init__(self, target: Any, drafter: EngineDrafter, rule: str = "greedy",
                 num_speculative_tokens: int | None = None, loop_stages: int = EngineSettings.loop_stages,
                 loop_gate: float = EngineSettings.loop_gate, carryover: bool = EngineSettings.carryover,
                 preallocate: bool = EngineSettings.preallocate, settings: EngineSettings | None = None):
        """``settings``: resolved already (``settings.resolve_settings``); else resolved here from
        the drafting options: ``loop_stages`` > 1 turns on DLoop multi-stage drafting (another
        block while the drafted tokens' summed log-probability is ≥ ``loop_gate``),
        ``carryover`` hands the target's states of each round's rejected drafts to the drafter
        as context for the next round's first block, ``preallocate`` grows the KV cache in
        place (``cache.slab``)."""
        self.target, self.drafter, self.rule = target, drafter, get_rule(rule)
        self.settings = settings or resolve_settings(drafter, num_speculative_tokens, loop_stages, loop_gate,
                                                     carryover, preallocate)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams = DEFAULT_SAMPLING,
                 seed: int = 0) -> GenerationResult:
        """Exactly ``max_new_tokens`` new token ids after ``prompt_ids`` (lossless under the rule)."""
        return decode(self.target, self.drafter, self.settings, self.rule, chain_round, prompt_ids, max_new_tokens,
                      sampling, seed)


@torch.no_grad()
def decode(target: Any, drafter: EngineDrafter, settings: EngineSettings, rule: Rule, play: RoundStep,
           prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams = DEFAULT_SAMPLING,
           seed: int = 0) -> GenerationResult:
    """Prefill (``chain.prefill``), then rounds of ``play`` (``chain.chain_round``,
    ``tree.tree_round``) until ``max_new_tokens`` new tokens exist, timed."""
    dev = target.device
    rnd = new_randomness(sampling, seed, dev)
    clock = time.perf_counter()
    seq = prefill(target, drafter, settings, rule, torch.tensor([prompt_ids], dtype=torch.long, device=dev), rnd)
    sync_device(dev)
    res = GenerationResult([], target_forwards=1, prefill_seconds=time.perf_counter() - clock)
    while len(seq.new_tokens) < max_new_tokens:
        seq = play(target, drafter, settings, rule, seq, max_new_tokens - len(seq.new_tokens), rnd, res)
    res.tokens = seq.new_tokens[:max_new_tokens]
    res.total_seconds = time.perf_counter() - clock
    return res


@torch.no_grad()
def target_only_generate(target: Any, prompt_ids: list[int], max_new_tokens: int,
                         sampling: SamplingParams = DEFAULT_SAMPLING, seed: int = 0,
                         rule: str = "greedy", preallocate_cache: bool = True) -> GenerationResult:
    """The baseline: the target alone, one token per forward, sampled as ``rule``'s target side
    (greedy argmax; Gumbel-max with the same position-keyed noise; multinomial otherwise), its
    KV cache preallocated like the engines' (``preallocate_cache``)."""
    dev = target.device
    chooser, rnd = get_rule(rule), new_randomness(sampling, seed, dev)
    clock = time.perf_counter()
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=dev)
    out = target.forward(ids, use_cache=True, last_logits=True)
    cache = preallocate(out.cache) if preallocate_cache else out.cache
    res = GenerationResult([], target_forwards=1)
    pos = len(prompt_ids)
    while True:
        token = chooser.sample_target(out.logits[:, -1:], positions(pos, 1, dev), rnd)  # [1, 1]
        res.tokens.append(int(token[0, 0]))
        if len(res.tokens) == 1:
            res.prefill_seconds = time.perf_counter() - clock  # the first token known, as the engines'
        pos += 1
        if len(res.tokens) >= max_new_tokens:
            break
        out = target.forward(token, cache=cache, use_cache=True)
        res.add_round()
    sync_device(dev)
    res.total_seconds = time.perf_counter() - clock
    return res
