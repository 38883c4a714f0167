"""What every engine shares: the drafter protocol the engines need, the records of a sequence
and of a generation, and small helpers (randomness, positions, cache cropping, device sync,
handing the target's own K/V to a drafter that reads it: ``attach_target_kv``).

Invariant between rounds, for committed tokens x_0..x_{n-1}: the target cache and the drafter
state hold n-1 positions; x_{n-1} (the last emitted token) has not been through the target.
So a generation of R rounds costs exactly R + 1 target forwards.

Knows nothing about rules' verification, the shape of a round (``chain.py``, ``tree.py``),
batching or tokenization (token id lists in and out); drafter families only through the
protocol ``EngineDrafter`` below, which ``components.drafters.base.Drafter`` implements.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from components.drafters.base import Proposal
from components.drafters.capabilities import Capability, has
from components.engine.cache.views import target_kv
from components.engine.rules import RoundRandomness
from components.spec.sampling import SamplingParams


class EngineDrafter(Protocol):
    """What the engines need from a drafter (``components.drafters.base.Drafter`` has it)."""

    layer_ids: Sequence[int]  # target taps to capture (may be empty)
    num_speculative_tokens: int  # the drafter's default γ

    def init_state(self, batch_size: int) -> Any: ...
    def consume(self, state: Any, tokens: Tensor, hidden: Tensor | None) -> Any: ...
    def propose(self, state: Any, last_token: Tensor, sampling: SamplingParams = ...,
                generator: torch.Generator | None = ..., num_speculative_tokens: int | None = ...) -> Proposal: ...
    def capabilities(self) -> frozenset[Capability]: ...
    def identity(self) -> str: ...  # what stored measurements (round profiles) of it are keyed by

    # ``propose`` returns at most the ``num_speculative_tokens`` asked for: G ≤ γ tokens, and
    # G = 0 (tokens [1, 0], logits/probs [1, 0, V]) says "nothing to propose" (prompt lookup
    # without a match). Every engine handles it with no flag: a round of 0 drafts is a plain
    # step (one target forward over the last token, the rule's own target sample), counted as
    # a plain round. Learned drafters always propose what was asked.
    # Declared, not probed (``components.drafters.capabilities``): ``OWN_CONTEXT`` (``consume_own``)
    # for loop_stages > 1 and ``CARRYOVER`` (``with_carry``) for carryover=True are required when
    # the settings are resolved (``settings.py``); ``BATCHED_PROPOSE``/``BATCHED_CONSUME`` are the
    # batch engine's fast paths; ``TARGET_KV`` (``target_kv_layers``, ``with_target_kv``): every
    # engine hands the drafter views of the target's own K/V cache before it drafts
    # (``attach_target_kv``), and never calls ``with_target_kv`` on a drafter that does not declare it.


@dataclass
class GenerationResult:
    """One request's output and what it cost.

    Rounds are drafting rounds (≥ 1 draft verified) or plain rounds (one token: plain decoding,
    a cap of 0, or a drafter that proposed nothing). ``tau`` is over drafting rounds only (as
    vLLM's mean acceptance length); ``tokens_per_round`` over every round, and
    ``drafting_share`` says which share of the rounds drafted."""

    tokens: list[int]  # the new tokens (prompt excluded): max_new_tokens of them unless stopped early
    rounds: int = 0  # every round after the prefill, drafting or plain (target-only: decoding steps)
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens per drafting round
    drafted: list[int] = field(default_factory=list)  # draft tokens verified per drafting round (num_drafts ≥ 1)
    carried: list[int] = field(default_factory=list)  # carryover rows the round's first block read
    target_forwards: int = 0  # target forward passes, prefill included
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0  # verify + accept (target forward, rule, cache crop, consume)
    total_seconds: float = 0.0
    finish_reason: str = "length"  # "length" | "stop" (a stop token, kept) | "cancelled"

    def add_round(self, accepted: int | None = None, num_drafts: int = 0, carried: int = 0) -> None:
        """Counts one round (one target forward); a drafting round (``accepted`` given) also
        its acceptance, the drafts it verified and the carryover rows it read; ``accepted``
        None is a plain round (one token emitted)."""
        self.rounds += 1
        self.target_forwards += 1
        if accepted is None:
            return
        self.accepted.append(accepted)
        self.drafted.append(num_drafts)
        self.carried.append(carried)

    @property
    def tau(self) -> float:
        """Acceptance length τ: mean tokens emitted per drafting round (accepted + 1)."""
        return (sum(self.accepted) + len(self.accepted)) / max(1, len(self.accepted))

    @property
    def tokens_per_round(self) -> float:
        """τ over every round, plain ones (1 token each) included."""
        return (sum(self.accepted) + self.rounds) / max(1, self.rounds)

    @property
    def drafting_share(self) -> float:
        """The share of rounds that drafted (0.0 without rounds)."""
        return len(self.accepted) / self.rounds if self.rounds else 0.0


@dataclass
class SequenceState:
    """One request's running state between rounds (see the invariant in the module docstring)."""

    cache: Any  # the target's KV cache, n-1 positions (None for a row of a batch: the batch holds it)
    draft_state: Any  # the drafter's state, n-1 positions (None: plain decoding)
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


def positions(start: int, count: int, device: torch.device) -> Tensor:  # → [1, count] long
    """The absolute positions start..start+count-1 of one sequence."""
    return torch.arange(start, start + count, device=device).unsqueeze(0)


def crop_cache(cache: Any, length: int) -> None:
    """Drops every cached position from ``length`` on (HF caches: ``crop(-n)`` removes n, in
    transformers 4.x and 5.x alike; 5.x refuses a positive absolute length)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def attach_target_kv(drafter: EngineDrafter, state: Any, cache: Any, row: int | None = None) -> Any:
    """``state`` with read access to the target's K/V of ``drafter.target_kv_layers`` over the
    committed context (``cache.views.target_kv``: views of ``cache``, of its batch row ``row``
    when given), for a drafter declaring ``Capability.TARGET_KV``; else (or without a cache, or
    for plain decoding's None state) ``state`` itself.

    Call it right before drafting, once every deferred update is consumed (``consume`` drops the
    views), and keep the result as the sequence's drafter state: a drafter (or a wrapper:
    ``serving.fallback``, the hybrid) may mark the state it proposes from, and the engine
    consumes that one. The views show the cache as it is until its next forward."""
    if state is None or cache is None or not has(drafter, Capability.TARGET_KV):
        return state
    return drafter.with_target_kv(state, target_kv(cache, drafter.target_kv_layers, row))
