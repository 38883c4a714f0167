"""One serving replica's work, free of HTTP and Ray: checked requests in, text deltas out.

``Replica`` holds the engine parts (``parts.build_parts``) behind an ``AsyncEngine`` and does,
per request: admission (at most ``max_ongoing_requests`` running + ``max_queued_requests``
waiting; beyond them an ``APIError`` 503/429 with ``Retry-After`` at once, never a wait), the
rule from the sampling parameters (greedy at temperature 0, else ``serve.sampled_rule``), the
generation as ``Delta``s (text cut at stop strings, which then cancel the engine request), and
the ``Outcome`` with usage and the request's speculative statistics. Leaving ``generate`` early
(client gone: the task is cancelled) cancels the engine request, whose rows are freed at the
next round.

A new ``Replica`` is warming up (``lifecycle.py``) until ``warm_up(steps)`` has run its steps
(the caller's: e.g. ``assemble.adapt``, the adaptive cap's round profile), started the engine thread
and completed one short greedy generation (the first rounds' one-time costs are paid before
traffic; its counters are not exported, ``counters.py``). A failed warm-up, or an
``EngineError`` in any stream, makes it dead for good.

Stop tokens: the engine ends a request at its stop ids itself; with ``min_tokens`` the engine
gets none and the detokenizer ends the output at the first stop id past ``min_tokens`` (the
target's own tokens either way: earlier stop ids are generated, they just do not end it).

Knows the engine's public API (``AsyncEngine``, ``Request``, ``EngineError``) and the protocol's
records; not when or on which thread the warm-up runs (``app.py`` decides), nor how counters
become metrics.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from components.engine import AsyncEngine, EngineError, Request
from components.serving.assemble import EngineParts
from components.serving.counters import EngineCounters, drafter_failures, observe_request
from components.serving.detokenizer import TextStream
from components.serving.lifecycle import Lifecycle
from components.serving.protocol import APIError, GenerateParams, Served
from components.serving.responses import Outcome, SpecStats
from components.serving.telemetry import ServingMetrics
from components.spec.sampling import GREEDY

WARM_UP_PROMPT = "def hello(name):\n    return"  # any text: the warm-up generation's prompt


@dataclass
class Delta:
    """Text (and its tokens) that may be sent now."""

    text: str
    token_ids: list[int]
    completion_tokens: int  # tokens of the output so far, these included


class Replica:
    """Admission and generation of one engine (module docstring)."""

    def __init__(self, parts: EngineParts, served: Served, max_queued: int, sampled_rule: str = "gumbel",
                 overload_status: int = 503, retry_after_s: int = 1, drafter_label: str | None = None,
                 metrics: ServingMetrics | None = None, poll_s: float = 0.5, stream_interval_s: float = 0.0):
        self.parts, self.served = parts, served
        self.stream_interval_s = stream_interval_s  # AsyncEngine's: at most one chunk per interval
        self.capacity = parts.engine.max_batch_size + int(max_queued)
        self.sampled_rule, self.overload_status = sampled_rule, overload_status
        self.drafter_label = drafter_label
        self.metrics = metrics or ServingMetrics(served.model, export_to_ray=False)
        self.life = Lifecycle(retry_after_s)
        self.counters = EngineCounters(parts, self.metrics, poll_s)
        self.admitted = 0  # requests between admission and their end
        self.engine: AsyncEngine | None = None  # started by warm_up

    # ------------------------------------------------------------------ warm-up and health
    def warm_up(self, steps: Sequence[tuple[str, Callable[[], None]]] = ()) -> bool:
        """Runs ``steps`` (phase name, call), starts the engine thread and one short greedy
        generation; then the replica is ``ok``. Never raises: a failure makes it ``dead``."""
        life = self.life
        try:
            for phase, step in steps:
                life.phase = phase
                step()
            life.phase = "warm-up generation"
            self.engine = AsyncEngine(self.parts.engine, stream_interval_s=self.stream_interval_s)
            asyncio.run(self.engine.generate(self._warm_up_request()))
        except Exception as err:  # noqa: BLE001  (a failed warm-up is reported, not raised: see check_health)
            life.died(err, during=f"warm-up ({life.phase})")
            return False
        self.counters.baseline()
        life.warm()
        return True

    def _warm_up_request(self) -> Request:
        ids = list(self.served.tokenizer.encode(WARM_UP_PROMPT))[:16] or [0]
        room = max(1, self.served.max_model_len - len(ids))
        return Request(ids, min(room, 2 * (self.parts.engine.max_cap + 1)), GREEDY, 0, "greedy",
                       speculate=True, request_id=f"warm-up-{uuid.uuid4().hex[:8]}")

    @property
    def healthy(self) -> bool:
        return self.life.healthy

    def status(self) -> dict[str, Any]:
        """The ``/health`` body."""
        eng, life = self.parts.engine, self.life
        return {"status": life.state, "phase": life.phase, "error": life.error, "uptime_s": life.uptime(),
                "running": len(eng.running), "waiting": len(eng.waiting), "admitted": self.admitted,
                "capacity": self.capacity, "drafter_failures": drafter_failures(self.parts)}

    def shutdown(self) -> None:
        self.counters.stop()
        if self.engine is not None:
            self.engine.shutdown()

    # ------------------------------------------------------------------ admission
    def admit(self) -> None:
        """Takes one request in, or raises the warming-up / dead-engine / overload ``APIError``."""
        self.life.check_ready()
        if self.admitted >= self.capacity:
            self.metrics.inc("specline:requests_rejected", reason="overload")
            code = "rate_limit_exceeded" if self.overload_status == 429 else "overloaded"
            retry = self.life.retry_after_s
            raise APIError(self.overload_status, f"server overloaded: {self.admitted} requests in flight, capacity "
                                                 f"{self.capacity}; retry after {retry} s",
                           code=code, headers=self.life.retry_after())
        self.admitted += 1

    def release(self) -> None:
        self.admitted -= 1

    # ------------------------------------------------------------------ generation
    def request_for(self, params: GenerateParams, request_id: str) -> Request:
        greedy = params.sampling.temperature <= 0
        sampling = GREEDY if greedy else params.sampling
        return Request(params.prompt_ids, params.max_tokens, sampling, params.seed,
                       "greedy" if greedy else self.sampled_rule, () if params.min_tokens else params.stop_token_ids,
                       speculate=params.speculate, request_id=request_id)

    def text_stream(self, params: GenerateParams) -> TextStream:
        """The detokenizer of one output: stop strings, and stop ids once ``min_tokens`` asks it."""
        return TextStream(self.served.tokenizer, params.stop, params.include_stop_str_in_output,
                          params.skip_special_tokens, params.stop_token_ids if params.min_tokens else (),
                          params.min_tokens)

    async def generate(self, params: GenerateParams, arrival: float | None = None,
                       request_id: str | None = None) -> AsyncIterator[Delta | Outcome]:
        """``Delta``s, then one ``Outcome``. Call ``admit()`` first; ``release()`` runs at the end."""
        arrival = time.perf_counter() if arrival is None else arrival
        text, chunks = self.text_stream(params), []
        first, result, reason = None, None, None
        assert self.engine is not None, "admit() refuses requests until the replica is warm"
        stream = self.engine.stream(self.request_for(params, request_id or f"cmpl-{uuid.uuid4().hex}"))
        try:
            async for out in stream:
                first = first or time.perf_counter()
                chunks.extend(out.rounds or (len(out.new_tokens),))  # tokens per round
                self.metrics.inc("vllm:generation_tokens", len(out.new_tokens))
                before = len(text.tokens)
                delta = text.push(out.new_tokens)
                if text.stopped is not None:
                    yield Delta(delta, text.tokens[before:], len(text.tokens))
                    reason = "stop"
                    break  # leaving the stream cancels the engine request
                if out.finished:
                    result, reason = out.result, "length" if out.finish_reason == "length" else "stop"
                    delta += text.finish()
                if delta or params.return_token_ids:
                    yield Delta(delta, list(out.new_tokens), len(text.tokens))
        except EngineError as err:
            self.life.died(err)
            raise self.life.dead_error(f"the engine failed during this request: {err}") from None
        finally:
            await stream.aclose()  # a stop string or a cancelled task: the engine request is cancelled
            self.release()
        out = Outcome(text.text, text.tokens, reason or "stop", len(params.prompt_ids), _spec_stats(result, chunks),
                      self.drafter_label, params.speculate and self.parts.drafter is not None)
        observe_request(self.metrics, params, out, arrival, first)
        yield out


def _spec_stats(result: Any, chunks: list[int]) -> SpecStats:
    """From the engine's result when the request ran to its end; from the chunk sizes when a
    stop string cut it (every round emits accepted + 1 tokens; how many it drafted is unknown)."""
    if result is not None:
        return SpecStats(result.rounds, list(result.accepted), list(result.drafted))
    return SpecStats(max(0, len(chunks) - 1), [c - 1 for c in chunks[1:]], None)
