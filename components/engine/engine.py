"""The speculative decoding engine's core round, lossless, for one request at a time (batch 1).

gpt-fast style verbs, one step each::

    prefill  -- one target forward over the prompt (taps at drafter.layer_ids, KV cache kept);
                its last logits give the first new token; the drafter consumes every prompt
                position (their target hidden states exist);
    draft    -- drafter.propose after the last token (the drafter state is not changed);
    verify   -- one target forward over [last_token, drafts] continuing the cache; the rule
                decides the accepted tokens and the next (recovered or bonus) token;
    accept   -- crop the target cache to the committed length (``DynamicCache.crop``) and feed
                the verified positions' hidden states, already computed by ``verify``, to the
                drafter. Accepted tokens are never recomputed. With carryover, the target's
                states of the rejected drafts (also computed by ``verify``) become the drafter's
                temporary context for the next round's first block (``with_carry``).

Carryover bookkeeping, for a round anchored at a = n-1 (x_{n-1} at position a) that drafts
d_1..d_G and accepts m < G: verify's input [x_{n-1}, d_1..d_G] sits at positions a..a+G, so
d_{m+1}.. are verify-hidden rows m+1.. at positions a+m+1..; after consuming x_{n-1}, d_1..d_m
the drafter holds a+m+1 positions and the next block is anchored at a+m+1 (the recovered
token). The first min(G-m, γ) rejected rows are attached at positions a+m+1.. -- the layout
the carryover objective trains (rows at a+m+1..a+γ, re-draft anchored at a+m+1). A full accept
attaches none. DLoop's later stages drop them (see ``DFlashDrafter.consume_own``).

Invariant between rounds, for committed tokens x_0..x_{n-1}: the target cache and the drafter
state hold n-1 positions; x_{n-1} (the last emitted token) has not been through the target.
So a generation of R rounds costs exactly R + 1 target forwards.

What this module leaves to others:
* batch size 1 (``batch.BatchEngine`` batches these same steps over many requests, with stop
  tokens, cancellation and an adaptive draft cap);
* chains (``tree.TreeEngine`` drafts token trees); γ is fixed here, shortened only so as not to
  overshoot ``max_new_tokens``;
* carryover rows are read by the next round's first block only, at most γ of them (one block);
* no stop tokens: generation runs for exactly ``max_new_tokens`` tokens.

The engine knows nothing about tokenization (token id lists in and out), drafter families
(it uses only the engine protocol of ``components.drafters.base``) or how rules verify.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from components.drafters.base import DEFAULT_SAMPLING, Proposal
from components.drafters.capabilities import Capability, has, require
from components.engine.cache.slab import preallocate
from components.engine.rules import RoundRandomness, Rule, get_rule
from components.spec.sampling import SamplingParams
from components.spec.verify import VerifyResult


class EngineDrafter(Protocol):
    """What the engine needs from a drafter (``components.drafters.base.Drafter`` has it)."""

    layer_ids: Sequence[int]  # target taps to capture (may be empty)
    num_speculative_tokens: int  # default γ

    def init_state(self, batch_size: int) -> Any: ...
    def consume(self, state: Any, tokens: Tensor, hidden: Tensor | None) -> Any: ...
    def propose(self, state: Any, last_token: Tensor, sampling: SamplingParams = ...,
                generator: torch.Generator | None = ..., num_speculative_tokens: int | None = ...) -> Proposal: ...
    def capabilities(self) -> frozenset[Capability]: ...
    def identity(self) -> str: ...  # what stored measurements (round profiles) of it are keyed by

    # Declared, not probed (``components.drafters.capabilities``): ``OWN_CONTEXT`` (``consume_own``)
    # for loop_stages > 1 and ``CARRYOVER`` (``with_carry``) for carryover=True are required when
    # the engine is built; ``BATCHED_PROPOSE``/``BATCHED_CONSUME`` are the batch engine's fast paths.


@dataclass
class GenerationResult:
    """One request's output and what it cost."""

    tokens: list[int]  # the new tokens (prompt excluded): max_new_tokens of them unless stopped early
    rounds: int = 0  # draft-verify rounds (target-only: decoding steps)
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens per round
    drafted: list[int] = field(default_factory=list)  # draft tokens proposed per round (γ)
    carried: list[int] = field(default_factory=list)  # carryover rows the round's first block read
    target_forwards: int = 0  # target forward passes, prefill included
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0  # verify + accept (target forward, rule, cache crop, consume)
    total_seconds: float = 0.0
    finish_reason: str = "length"  # "length" | "stop" (a stop token, kept) | "cancelled"

    def add_round(self, accepted: int, drafted: int, carried: int = 0) -> None:
        """Counts one draft-verify round (one target forward) and its acceptance."""
        self.rounds += 1
        self.target_forwards += 1
        self.accepted.append(accepted)
        self.drafted.append(drafted)
        self.carried.append(carried)

    @property
    def tau(self) -> float:
        """Acceptance length τ: mean tokens emitted per round (accepted + 1)."""
        return (sum(self.accepted) + len(self.accepted)) / max(1, len(self.accepted))


@dataclass
class SequenceState:
    """One request's running state between rounds (see the invariant in the module docstring)."""

    cache: Any  # the target's KV cache, n-1 positions
    draft_state: Any  # the drafter's state, n-1 positions
    last_token: Tensor  # [1] long, x_{n-1}
    length: int  # n: committed tokens, prompt included
    new_tokens: list[int]
    carry_rows: int = 0  # carryover rows in draft_state (rejected drafts of the last round)


def sync_device(device: torch.device) -> None:
    """Waits for queued GPU work, so that wall-clock timings cover it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def new_randomness(sampling: SamplingParams, seed: int, device: torch.device) -> RoundRandomness:
    """One request's sources of randomness: a generator seeded with ``seed`` and its Gumbel seed."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return RoundRandomness(sampling, gen, torch.tensor([seed], dtype=torch.long, device=device))


def _positions(start: int, count: int, device: torch.device) -> Tensor:  # [1, count] long
    return torch.arange(start, start + count, device=device).unsqueeze(0)


def crop_cache(cache: Any, length: int) -> None:
    """Drops every cached position from ``length`` on (HF caches: ``crop(-n)`` removes n, in
    transformers 4.x and 5.x alike; 5.x refuses a positive absolute length)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


class SpeculativeEngine:
    """Draft-verify rounds of ``drafter`` against ``target`` under one acceptance rule."""

    def __init__(self, target: Any, drafter: EngineDrafter, rule: str = "greedy", num_speculative_tokens: int | None = None,
                 loop_stages: int = 1, loop_gate: float = -0.5, carryover: bool = False,
                 preallocate: bool = True):
        """``loop_stages`` > 1 turns on DLoop multi-stage drafting: after a stage whose drafted
        tokens' summed drafter log-probability is ≥ ``loop_gate``, the drafter drafts another
        block on its own states (``consume_own``), up to ``loop_stages`` blocks per round.
        ``carryover`` hands the target's states of each round's rejected drafts to the drafter
        (``with_carry``) as context for the next round's first block. ``preallocate``: the KV
        cache grows in place in a buffer with headroom (``cache.slab``) instead of by ``torch.cat``."""
        self.target = target
        self.preallocate = bool(preallocate)
        self.drafter = drafter
        self.rule: Rule = get_rule(rule)
        self.num_speculative_tokens = int(num_speculative_tokens or drafter.num_speculative_tokens)
        if has(drafter, Capability.BLOCK_INTERNALS) and self.num_speculative_tokens > drafter.max_speculative_tokens:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens}: drafter '{drafter.cfg.name}' drafts "
                             f"at most {drafter.max_speculative_tokens} per block (DLoop stages add blocks: loop_stages)")
        self.layer_ids = list(drafter.layer_ids)
        if loop_stages < 1:
            raise ValueError(f"loop_stages must be >= 1, got {loop_stages}")
        if loop_stages > 1:
            require(drafter, f"engine loop_stages={loop_stages} (DLoop)", Capability.OWN_CONTEXT,
                    hint="a block drafter (dflash, dspark) drafts on its own states")
        self.loop_stages, self.loop_gate = int(loop_stages), float(loop_gate)
        if carryover:
            require(drafter, "engine carryover=True", Capability.CARRYOVER,
                    hint="a block drafter (dflash, dspark) built with drafter.carryover=true has it")
        self.carryover = bool(carryover)

    # ------------------------------------------------------------------ steps
    def prefill(self, prompt: Tensor, rnd: RoundRandomness) -> SequenceState:
        """prompt [1, P] → the sequence after the first new token (sampled from the prefill)."""
        out = self.target.forward(prompt, layer_ids=self.layer_ids, use_cache=True)
        p = prompt.shape[1]
        first = self.rule.sample_target(out.logits[:, -1:], _positions(p, 1, prompt.device), rnd)[:, 0]
        state = self.drafter.consume(self.drafter.init_state(1), prompt, out.hidden)
        cache = preallocate(out.cache) if self.preallocate else out.cache
        return SequenceState(cache, state, first, p + 1, [int(first)])

    def draft(self, seq: SequenceState, gamma: int, rnd: RoundRandomness) -> tuple[Proposal, Tensor]:
        """Proposal and the draft tokens [1, γ] to verify (predicting positions n..n+γ-1).

        With DLoop, γ may span several stages; later stages run on a throw-away drafter state
        extended with the earlier stages' own states, so ``seq.draft_state`` never changes."""
        state, last, start = seq.draft_state, seq.last_token, seq.length
        props, drafts = [], []
        while True:
            g = min(self.num_speculative_tokens, gamma - sum(d.shape[1] for d in drafts))
            prop = self.drafter.propose(state, last, self.rule.draft_sampling(rnd), rnd.generator, num_speculative_tokens=g)
            picked = self.rule.pick_drafts(prop, _positions(start, g, last.device), rnd)
            props.append(prop)
            drafts.append(picked)
            start += g
            if not self._loop_again(len(props), start - seq.length, gamma, prop, picked):
                break
            state = self.drafter.consume_own(state, prop.states)
            last = picked[:, -1]
        return _concat(props), torch.cat(drafts, dim=1)

    def _loop_again(self, stages: int, drafted: int, gamma: int, prop: Proposal, picked: Tensor) -> bool:
        """DLoop's gate: another stage if allowed, room is left, and Σ log q(drafts) ≥ gate."""
        if stages >= self.loop_stages or drafted >= gamma or prop.states is None:
            return False
        log_q = torch.log_softmax(prop.logits.float(), dim=-1).gather(-1, picked.unsqueeze(-1))
        return float(log_q.sum()) >= self.loop_gate

    def verify(self, seq: SequenceState, prop: Proposal, drafts: Tensor,
               rnd: RoundRandomness) -> tuple[VerifyResult, Tensor | None, Any]:
        """One target forward over [x_{n-1}, drafts] [1, γ+1] → (result, hidden [1, γ+1, n, H], cache)."""
        ids = torch.cat([seq.last_token[:, None], drafts], dim=1)
        out = self.target.forward(ids, layer_ids=self.layer_ids, cache=seq.cache, use_cache=True)
        positions = _positions(seq.length, ids.shape[1], ids.device)
        result = self.rule.verify(drafts, out.logits, prop, positions, rnd)
        return result, out.hidden, out.cache

    def accept(self, seq: SequenceState, drafts: Tensor, result: VerifyResult, hidden: Tensor | None,
               cache: Any) -> SequenceState:
        """Commit x_{n-1} + the accepted drafts: crop the cache, feed their hidden states."""
        a = int(result.num_accepted[0])
        committed = seq.length + a  # positions now in the cache: x_0 .. x_{n-1+a}
        crop_cache(cache, committed)
        tokens = torch.cat([seq.last_token[:, None], drafts[:, :a]], dim=1)  # [1, a+1]
        kept = hidden[:, : a + 1] if hidden is not None else None
        state = self.drafter.consume(seq.draft_state, tokens, kept)  # drops any earlier carry
        carried = 0
        if self.carryover and hidden is not None:
            # [1, carried, n, H]: the rejected d_{m+1}.. (m = a accepted), at positions committed..
            rejected = hidden[:, a + 1:a + 1 + self.num_speculative_tokens]
            carried = rejected.shape[1]
            if carried:
                state = self.drafter.with_carry(state, rejected, committed)
        emitted = drafts[0, :a].tolist() + [int(result.next_token[0])]
        return SequenceState(cache, state, result.next_token, committed + 1, seq.new_tokens + emitted, carried)

    # ------------------------------------------------------------------ loop
    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams = DEFAULT_SAMPLING,
                 seed: int = 0) -> GenerationResult:
        """Exactly ``max_new_tokens`` new token ids after ``prompt_ids`` (lossless under the rule)."""
        return decode(self, prompt_ids, max_new_tokens, sampling, seed)

    def round(self, seq: SequenceState, remaining: int, rnd: RoundRandomness, res: GenerationResult) -> SequenceState:
        """One draft-verify-accept round, timed into ``res``."""
        dev = seq.last_token.device
        gamma = max(1, min(self.num_speculative_tokens * self.loop_stages, remaining - 1))  # a round emits up to γ+1 tokens
        carried = seq.carry_rows
        t0 = time.perf_counter()
        prop, drafts = self.draft(seq, gamma, rnd)
        sync_device(dev)
        t1 = time.perf_counter()
        result, hidden, cache = self.verify(seq, prop, drafts, rnd)
        seq = self.accept(seq, drafts, result, hidden, cache)
        sync_device(dev)
        res.draft_seconds += t1 - t0
        res.verify_seconds += time.perf_counter() - t1
        res.add_round(int(result.num_accepted[0]), drafts.shape[1], carried)
        return seq


class RoundEngine(Protocol):
    """What ``decode`` runs: a prefill and rounds that keep the invariant of the module docstring
    (``SpeculativeEngine`` with chains, ``tree.TreeEngine`` with token trees)."""

    target: Any

    def prefill(self, prompt: Tensor, rnd: RoundRandomness) -> SequenceState: ...
    def round(self, seq: SequenceState, remaining: int, rnd: RoundRandomness,
              res: GenerationResult) -> SequenceState: ...


@torch.no_grad()
def decode(engine: RoundEngine, prompt_ids: list[int], max_new_tokens: int,
           sampling: SamplingParams = DEFAULT_SAMPLING, seed: int = 0) -> GenerationResult:
    """Prefill, then ``engine``'s rounds until ``max_new_tokens`` new tokens exist, timed."""
    dev = engine.target.device
    rnd = new_randomness(sampling, seed, dev)
    clock = time.perf_counter()
    seq = engine.prefill(torch.tensor([prompt_ids], dtype=torch.long, device=dev), rnd)
    sync_device(dev)
    res = GenerationResult([], target_forwards=1, prefill_seconds=time.perf_counter() - clock)
    while len(seq.new_tokens) < max_new_tokens:
        seq = engine.round(seq, max_new_tokens - len(seq.new_tokens), rnd, res)
    res.tokens = seq.new_tokens[:max_new_tokens]
    res.total_seconds = time.perf_counter() - clock
    return res


def _concat(props: list[Proposal]) -> Proposal:
    """One proposal from consecutive stages' proposals (along the draft axis)."""
    if len(props) == 1:
        return props[0]
    conf = [p.confidences for p in props]
    return Proposal(torch.cat([p.tokens for p in props], 1), torch.cat([p.logits for p in props], 1),
                    torch.cat([p.probs for p in props], 1),
                    torch.cat(conf, 1) if all(c is not None for c in conf) else None)


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
    out = target.forward(ids, use_cache=True)
    cache = preallocate(out.cache) if preallocate_cache else out.cache
    res = GenerationResult([], target_forwards=1)
    pos = len(prompt_ids)
    while True:
        token = chooser.sample_target(out.logits[:, -1:], _positions(pos, 1, dev), rnd)  # [1, 1]
        res.tokens.append(int(token[0, 0]))
        pos += 1
        if len(res.tokens) >= max_new_tokens:
            break
        out = target.forward(token, cache=cache, use_cache=True)
        res.target_forwards += 1
        res.rounds += 1
    sync_device(dev)
    res.total_seconds = time.perf_counter() - clock
    return res
