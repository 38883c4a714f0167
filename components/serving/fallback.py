"""A drafter that cannot take the engine down: a failure inside the drafter turns the affected
requests into plain decoding, losslessly, and is logged and counted.

``GuardedDrafter(drafter)`` has the drafter's engine protocol (its capabilities, taps and γ are
the wrapped drafter's) and wraps each request's drafter state in a ``Slot``. When a call on a
slot raises (``init_state``, ``consume``/``consume_many``, ``propose``/``propose_many``,
``consume_own``, ``with_carry``), that slot is marked failed and from then on:

* ``consume`` and friends leave it failed without calling the drafter;
* ``propose`` returns a *null proposal*: the last token repeated, with the one-hot q it was
  "sampled" from and confidence 0. Every rule stays lossless with it (greedy matches tokens;
  speculative/block sampling gets the true q of its drafts; Gumbel reads the target's noise),
  so the request's output is what it would have been; the zero confidence makes the adaptive
  draft cap choose plain rounds for such rows (with a fixed cap they verify the null drafts,
  which costs a little width and accepts what the target itself would emit).

Requests admitted later get fresh states and the real drafter again. Knows the drafter engine
protocol (``components.engine``'s ``EngineDrafter``); nothing about requests, HTTP or Ray.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from components.drafters.base import DEFAULT_SAMPLING, Proposal
from components.spec.sampling import SamplingParams

log = logging.getLogger(__name__)
NULL_LOGIT = -1e9  # every token but the null draft's: exp() is exactly 0 in float32


@dataclass
class Slot:
    """One request's drafter state, and whether the drafter failed on it (a failed ``propose``
    marks the slot in place: the engine keeps the slot it proposed from until it consumes)."""

    inner: Any  # the wrapped drafter's state (None once failed)
    failed: bool = False


FAILED = Slot(None, True)
_GUARDED = ("consume_many", "propose_many", "consume_own", "with_carry")


class GuardedDrafter:
    """The wrapped drafter, with failures confined to the requests they hit (module docstring)."""

    def __init__(self, drafter: Any, vocab_size: int):
        self.drafter, self.vocab_size = drafter, int(vocab_size)
        self.failures = 0  # calls that raised (each turns one or more requests plain)
        self.last_error: str | None = None
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:  # taps, γ, capabilities, parameters, ... of the drafter
        if name in _GUARDED:
            getattr(self.drafter, name)  # AttributeError when the drafter has no such method
            return getattr(self, f"_{name}")
        return getattr(self.drafter, name)

    def _failed(self, call: str, err: BaseException, rows: int) -> None:
        with self._lock:
            self.failures += 1
            self.last_error = f"{call}: {type(err).__name__}: {err}"
        log.warning("drafter failed in %s (%s rows fall back to plain decoding): %s", call, rows, self.last_error)

    # ------------------------------------------------------------------ one row
    def init_state(self, batch_size: int) -> Slot:
        try:
            return Slot(self.drafter.init_state(batch_size))
        except Exception as err:  # noqa: BLE001  (any drafter failure falls back)
            self._failed("init_state", err, batch_size)
            return FAILED

    def consume(self, state: Slot, tokens: Tensor, hidden: Tensor | None) -> Slot:
        if state.failed:
            return FAILED
        try:
            return Slot(self.drafter.consume(state.inner, tokens, hidden))
        except Exception as err:  # noqa: BLE001
            self._failed("consume", err, 1)
            return FAILED

    def propose(self, state: Slot, last_token: Tensor, sampling: SamplingParams = DEFAULT_SAMPLING,
                generator: torch.Generator | None = None, num_speculative_tokens: int | None = None) -> Proposal:
        gamma = int(num_speculative_tokens or self.drafter.num_speculative_tokens)
        if state.failed:
            return self.null_proposal(last_token, gamma)
        try:
            return self.drafter.propose(state.inner, last_token, sampling, generator,
                                        num_speculative_tokens=num_speculative_tokens)
        except Exception as err:  # noqa: BLE001
            self._failed("propose", err, 1)
            state.failed = True  # consume() now leaves it failed
            return self.null_proposal(last_token, gamma)

    def rollback(self, state: Slot, length: int) -> Slot:
        return state if state.failed else Slot(self.drafter.rollback(state.inner, length))

    def null_proposal(self, last_token: Tensor, gamma: int) -> Proposal:
        """``gamma`` copies of the last token [B], one-hot q, confidence 0 (module docstring)."""
        rows = last_token.reshape(-1).shape[0]
        tokens = last_token.reshape(rows, 1).expand(rows, gamma).clone()  # [B, γ]
        probs = torch.zeros(rows, gamma, self.vocab_size, device=last_token.device)  # [B, γ, V]
        probs.scatter_(2, tokens[..., None], 1.0)
        logits = torch.full_like(probs, NULL_LOGIT).masked_fill(probs > 0, 0.0)
        return Proposal(tokens, logits, probs, torch.zeros(rows, gamma, device=last_token.device))

    # ------------------------------------------------------------------ many rows (when the drafter has them)
    def _consume_many(self, states: list[Slot], tokens: list[Tensor], hidden: list[Tensor]) -> list[Slot]:
        out: list[Slot] = [FAILED] * len(states)
        live = [i for i, s in enumerate(states) if not s.failed]
        if not live:
            return out
        try:
            news = self.drafter.consume_many([states[i].inner for i in live], [tokens[i] for i in live],
                                             [hidden[i] for i in live])
        except Exception as err:  # noqa: BLE001
            self._failed("consume_many", err, len(live))
            return out
        for i, new in zip(live, news):
            out[i] = Slot(new)
        return out

    def _propose_many(self, states: list[Slot], last_tokens: Tensor, sampling: Any,
                      num_speculative_tokens: Any = None, generators: list[Any] | None = None) -> list[Proposal]:
        n, gamma = len(states), num_speculative_tokens
        gammas = [int(g) for g in gamma] if isinstance(gamma, list) else [
            int(gamma or self.drafter.num_speculative_tokens)] * n
        out = [self.null_proposal(last_tokens[i:i + 1], gammas[i]) if s.failed else None for i, s in enumerate(states)]
        live = [i for i, s in enumerate(states) if not s.failed]
        if not live:
            return out  # type: ignore[return-value]
        def pick(values: list[Any]) -> list[Any]:
            return [values[i] for i in live]

        try:
            props = self.drafter.propose_many(
                [states[i].inner for i in live], last_tokens[torch.tensor(live, device=last_tokens.device)],
                pick(sampling) if isinstance(sampling, list) else sampling,
                pick(gamma) if isinstance(gamma, list) else gamma,
                generators=pick(generators) if generators is not None else None)
        except Exception as err:  # noqa: BLE001
            self._failed("propose_many", err, len(live))
            for i in live:
                states[i].failed = True
                out[i] = self.null_proposal(last_tokens[i:i + 1], gammas[i])
            return out  # type: ignore[return-value]
        for i, prop in zip(live, props):
            out[i] = prop
        return out  # type: ignore[return-value]

    def _consume_own(self, state: Slot, states: Tensor) -> Slot:
        if state.failed:
            return FAILED
        try:
            return Slot(self.drafter.consume_own(state.inner, states))
        except Exception as err:  # noqa: BLE001
            self._failed("consume_own", err, 1)
            return FAILED

    def _with_carry(self, state: Slot, hidden_rej: Tensor, start_position: int) -> Slot:
        if state.failed:
            return FAILED
        try:
            return Slot(self.drafter.with_carry(state.inner, hidden_rej, start_position))
        except Exception as err:  # noqa: BLE001
            self._failed("with_carry", err, 1)
            return FAILED
