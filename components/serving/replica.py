"""One serving replica's work, free of HTTP and Ray: checked requests in, text deltas out.

``Replica`` holds the engine parts (``parts.build_parts``) behind an ``AsyncEngine`` and does,
per request: admission (at most ``max_ongoing_requests`` running + ``max_queued_requests``
waiting; beyond them an ``APIError`` 503/429 with ``Retry-After`` at once, never a wait), the
rule from the sampling parameters (greedy at temperature 0, else ``serve.sampled_rule``), the
generation as ``Delta``s (text cut at stop strings, which then cancel the engine request), and
the ``Outcome`` with usage and the request's speculative statistics. Leaving ``generate`` early
(client gone: the task is cancelled) cancels the engine request, whose rows are freed at the
next round.

Lifecycle: ``warming_up`` → ``ok`` | ``dead``. A new ``Replica`` is warming up: ``admit`` refuses
with 503 ``warming_up`` + ``Retry-After``, ``check_health`` passes, ``status()`` says so, until
``warm_up(steps)`` has run its steps (the caller's: e.g. ``parts.adapt``, the adaptive cap's
round profile), started the engine thread and completed one short greedy generation (the
first rounds' one-time costs are paid before traffic; its counters are not exported). Once the
warm-up or a round has failed (``EngineError`` in any stream), the replica is dead for good:
``check_health`` raises, so Ray Serve replaces it, and requests get 503 ``engine_dead``. A
metrics thread reads the engine's counters every ``poll_s`` into ``ServingMetrics`` once warm.
Knows the engine's public API (``AsyncEngine``, ``BatchEngine.stats/caps/running/waiting``) and
the protocol's records; not when or on which thread the warm-up runs (``app.py`` decides).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from components.engine import AsyncEngine, EngineError, Request
from components.serving.detokenizer import TextStream
from components.serving.parts import EngineParts
from components.serving.protocol import APIError, GenerateParams, Served
from components.serving.responses import Outcome, SpecStats
from components.serving.telemetry import ServingMetrics
from components.spec.sampling import GREEDY, SamplingParams

log = logging.getLogger(__name__)
WARM_UP_PROMPT = "def hello(name):\n    return"  # any text: the warm-up generation's prompt
WARMING, OK, DEAD = "warming_up", "ok", "dead"


@dataclass
class Delta:
    """Text (and its tokens) that may be sent now."""

    text: str
    token_ids: list[int]


class Replica:
    """Admission, generation and health of one engine (module docstring)."""

    def __init__(self, parts: EngineParts, served: Served, max_queued: int, sampled_rule: str = "gumbel",
                 overload_status: int = 503, retry_after_s: int = 1, drafter_label: str | None = None,
                 metrics: ServingMetrics | None = None, poll_s: float = 0.5):
        self.parts, self.served = parts, served
        self.capacity = parts.engine.max_batch_size + int(max_queued)
        self.sampled_rule, self.overload_status, self.retry_after_s = sampled_rule, overload_status, retry_after_s
        self.drafter_label = drafter_label
        self.metrics = metrics or ServingMetrics(served.model, export_to_ray=False)
        self.admitted = 0  # requests between admission and their end
        self.engine: AsyncEngine | None = None  # started by warm_up
        self.phase: str | None = "loaded"  # the warm-up step under way; None once warm
        self.error: str | None = None  # set once the warm-up or a round failed: the replica is dead
        self.created = time.perf_counter()
        self._seen = _Seen()
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, args=(poll_s,), name="specline-metrics", daemon=True)
        self._poller.start()

    # ------------------------------------------------------------------ warm-up
    def warm_up(self, steps: Sequence[tuple[str, Callable[[], None]]] = ()) -> bool:
        """Runs ``steps`` (phase name, call), starts the engine thread and one short greedy
        generation; then the replica is ``ok``. Never raises: a failure makes it ``dead``."""
        try:
            for phase, step in steps:
                self.phase = phase
                step()
            self.phase = "warm-up generation"
            self.engine = AsyncEngine(self.parts.engine)
            asyncio.run(self.engine.generate(self._warm_up_request()))
        except Exception as err:  # noqa: BLE001  (a failed warm-up is reported, not raised: see check_health)
            self._died(err, during=f"warm-up ({self.phase})")
            return False
        self._seen.baseline(self.parts)
        self.phase = None
        log.info("replica warm %.1f s after it was created", time.perf_counter() - self.created)
        return True

    def _warm_up_request(self) -> Request:
        ids = list(self.served.tokenizer.encode(WARM_UP_PROMPT))[:16] or [0]
        room = max(1, self.served.max_model_len - len(ids))
        return Request(ids, min(room, 2 * (self.parts.engine.max_cap + 1)), GREEDY, 0, "greedy",
                       speculate=True, request_id=f"warm-up-{uuid.uuid4().hex[:8]}")

    # ------------------------------------------------------------------ health
    @property
    def state(self) -> str:
        return DEAD if self.error is not None else WARMING if self.phase is not None else OK

    @property
    def healthy(self) -> bool:
        """Ready for traffic (what ``/health`` answers 200 for)."""
        return self.state == OK

    def check_health(self) -> None:
        """Raises once the replica is dead (Ray Serve then replaces it); passes while it warms up."""
        if self.error is not None:
            raise RuntimeError(f"engine is dead: {self.error}")

    def status(self) -> dict[str, Any]:
        eng = self.parts.engine
        return {"status": self.state, "phase": self.phase, "error": self.error,
                "uptime_s": round(time.perf_counter() - self.created, 3), "running": len(eng.running),
                "waiting": len(eng.waiting), "admitted": self.admitted, "capacity": self.capacity,
                "drafter_failures": _failures(self.parts)}

    def check_ready(self) -> None:
        """Raises the 503 ``APIError`` (with ``Retry-After``) while warming up or once dead."""
        retry = {"Retry-After": str(self.retry_after_s)}
        if self.error is not None:
            raise APIError(503, f"the engine of this replica failed ({self.error}); it is being replaced, "
                                "retry shortly", code="engine_dead", headers=retry)
        if self.phase is not None:
            raise APIError(503, f"this replica is warming up ({self.phase}); retry after {self.retry_after_s} s",
                           code="warming_up", headers=retry)

    def shutdown(self) -> None:
        self._stop.set()
        if self.engine is not None:
            self.engine.shutdown()

    # ------------------------------------------------------------------ generation
    def admit(self) -> None:
        """Takes one request in, or raises the warming-up / dead-engine / overload ``APIError``."""
        self.check_ready()
        if self.admitted >= self.capacity:
            self.metrics.inc("specline:requests_rejected", reason="overload")
            code = "rate_limit_exceeded" if self.overload_status == 429 else "overloaded"
            raise APIError(self.overload_status, f"server overloaded: {self.admitted} requests in flight, capacity "
                                                 f"{self.capacity}; retry after {self.retry_after_s} s",
                           code=code, headers={"Retry-After": str(self.retry_after_s)})
        self.admitted += 1

    def release(self) -> None:
        self.admitted -= 1

    def request_for(self, params: GenerateParams, request_id: str) -> Request:
        greedy = params.temperature <= 0
        sampling = GREEDY if greedy else SamplingParams(
            temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
        return Request(params.prompt_ids, params.max_tokens, sampling, params.seed,
                       "greedy" if greedy else self.sampled_rule, params.stop_token_ids,
                       speculate=params.speculate, request_id=request_id)

    async def generate(self, params: GenerateParams, arrival: float | None = None,
                       request_id: str | None = None) -> AsyncIterator[Delta | Outcome]:
        """``Delta``s, then one ``Outcome``. Call ``admit()`` first; ``release()`` runs at the end."""
        arrival = time.perf_counter() if arrival is None else arrival
        rid = request_id or f"cmpl-{uuid.uuid4().hex}"
        text = TextStream(self.served.tokenizer, params.stop, params.include_stop_str_in_output,
                          params.skip_special_tokens)
        chunks: list[int] = []
        first: float | None = None
        result, reason = None, None
        assert self.engine is not None, "admit() refuses requests until the replica is warm"
        stream = self.engine.stream(self.request_for(params, rid))
        try:
            async for out in stream:
                first = first or time.perf_counter()
                chunks.append(len(out.new_tokens))
                self.metrics.inc("vllm:generation_tokens", len(out.new_tokens))
                before = len(text.tokens)
                delta = text.push(out.new_tokens)
                if text.stopped is not None:
                    yield Delta(delta, text.tokens[before:])
                    reason = "stop"
                    break  # leaving the stream cancels the engine request
                if out.finished:
                    result, reason = out.result, "length" if out.finish_reason == "length" else "stop"
                    delta += text.finish()
                if delta or params.return_token_ids:
                    yield Delta(delta, list(out.new_tokens))
        except EngineError as err:
            self._died(err)
            raise APIError(503, f"the engine failed during this request: {err}", code="engine_dead",
                           headers={"Retry-After": str(self.retry_after_s)}) from None
        finally:
            await stream.aclose()  # a stop string or a cancelled task: the engine request is cancelled
            self.release()
        spec = _spec_stats(result, chunks)
        out = Outcome(text.text, text.tokens, reason or "stop", len(params.prompt_ids), spec, self.drafter_label,
                      params.speculate and self.parts.drafter is not None)
        self._observe(params, out, arrival, first)
        yield out

    def _died(self, err: BaseException, during: str = "a round") -> None:
        if self.error is None:
            self.error = str(err) if during == "a round" else f"{during}: {type(err).__name__}: {err}"
            log.error("engine failed in %s; this replica reports unhealthy from now on: %s", during, err)

    def _observe(self, params: GenerateParams, out: Outcome, arrival: float, first: float | None) -> None:
        m, now, n = self.metrics, time.perf_counter(), len(out.token_ids)
        m.inc("vllm:prompt_tokens", len(params.prompt_ids))
        m.inc("vllm:request_success", finished_reason=out.finish_reason)
        m.observe("vllm:e2e_request_latency_seconds", now - arrival)
        if first is not None:
            m.observe("vllm:time_to_first_token_seconds", first - arrival)
            if n > 1:
                m.observe("vllm:request_time_per_output_token_seconds", (now - first) / (n - 1))
        if out.spec.drafted:
            m.observe("specline:spec_decode_acceptance_length", out.spec.to_dict()["mean_acceptance_length"])

    # ------------------------------------------------------------------ engine counters → metrics
    def _poll(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                self.poll_metrics()
            except Exception as err:  # noqa: BLE001  (metrics never take the replica down)
                log.warning("metrics poll failed: %s", err)

    def poll_metrics(self) -> None:
        """The engine's counters since the last call, into the metrics (also called by /metrics)."""
        if self.phase is not None:
            return  # warming up: the warm-up generation's counters become the baseline instead
        eng, m, seen = self.parts.engine, self.metrics, self._seen
        with seen.lock:
            now = _counts(eng)
            m.inc("vllm:spec_decode_num_drafts", now[0] - seen.counts[0])
            m.inc("vllm:spec_decode_num_draft_tokens", now[1] - seen.counts[1])
            m.inc("vllm:spec_decode_num_accepted_tokens", now[2] - seen.counts[2])
            for k, hits in enumerate(now[3]):
                m.inc("vllm:spec_decode_num_accepted_tokens_per_pos", hits - _at(seen.counts[3], k), position=str(k))
            busy = now[5] - seen.counts[5]
            if busy > 0:
                m.set("specline:generation_tokens_per_second", (now[4] - seen.counts[4]) / busy)
            new = min(eng.capped_rounds - seen.caps, len(eng.caps))  # the engine keeps the last caps only
            for cap in list(eng.caps)[len(eng.caps) - new:]:
                m.observe("specline:spec_decode_draft_cap", float(cap))
            seen.counts, seen.caps = now, eng.capped_rounds
            failures = _failures(self.parts)
            m.inc("specline:spec_decode_fallbacks", failures - seen.failures)
            seen.failures = failures
        m.set("vllm:num_requests_running", len(eng.running))
        m.set("vllm:num_requests_waiting", len(eng.waiting))

    # ------------------------------------------------------------------ tokenizer routes
    def tokenize(self, text: str | None = None, messages: list[Any] | None = None,
                 add_special_tokens: bool = True) -> list[int]:
        tok = self.served.tokenizer
        if messages is not None:
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return list(tok.encode(text or "", add_special_tokens=add_special_tokens))

    def detokenize(self, tokens: list[int]) -> str:
        return self.served.tokenizer.decode(tokens)


@dataclass
class _Seen:
    """Engine counters as last exported (drafts, draft tokens, accepted, per position, tokens, busy s)."""

    counts: tuple[Any, ...] = (0, 0, 0, [], 0, 0.0)
    caps: int = 0
    failures: int = 0

    def __post_init__(self) -> None:
        self.lock = threading.Lock()

    def baseline(self, parts: EngineParts) -> None:
        """The engine's counters as they are now, taken as exported (the warm-up's are not traffic)."""
        with self.lock:
            self.counts, self.caps, self.failures = _counts(parts.engine), parts.engine.capped_rounds, _failures(parts)


def _counts(eng: Any) -> tuple[Any, ...]:
    st = eng.stats
    return st.drafting_rounds, st.drafted, st.accepted, list(st.accepted_at), st.tokens, st.busy_seconds


def _failures(parts: EngineParts) -> int:
    return parts.drafter.failures if parts.drafter is not None else 0


def _at(values: list[int], k: int) -> int:
    return values[k] if k < len(values) else 0


def _spec_stats(result: Any, chunks: list[int]) -> SpecStats:
    """From the engine's result when the request ran to its end; from the chunk sizes when a
    stop string cut it (every round emits accepted + 1 tokens; how many it drafted is unknown)."""
    if result is not None:
        return SpecStats(result.rounds, list(result.accepted), list(result.drafted))
    return SpecStats(max(0, len(chunks) - 1), [c - 1 for c in chunks[1:]], None)
