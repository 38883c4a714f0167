"""One serving replica's work, free of HTTP and Ray: checked requests in, text deltas out.

``Replica`` holds the engine parts (``parts.build_parts``) behind an ``AsyncEngine`` and does,
per request: admission (at most ``max_ongoing_requests`` running + ``max_queued_requests``
waiting; beyond them an ``APIError`` 503/429 with ``Retry-After`` at once, never a wait), the
rule from the sampling parameters (greedy at temperature 0, else ``serve.sampled_rule``), the
generation as ``Delta``s (text cut at stop strings, which then cancel the engine request), and
the ``Outcome`` with usage and the request's speculative statistics. Leaving ``generate`` early
(client gone: the task is cancelled) cancels the engine request, whose rows are freed at the
next round.

Health: once a round has failed (``EngineError`` in any stream), the replica is dead for good:
``check_health`` raises, so Ray Serve replaces it, and requests get 503. A metrics thread reads
the engine's counters every ``poll_s`` into ``ServingMetrics``. Knows the engine's public API
(``AsyncEngine``, ``BatchEngine.stats/caps/running/waiting``) and the protocol's records.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from components.engine import AsyncEngine, EngineError, Request
from components.serving.decode import TextStream
from components.serving.parts import EngineParts
from components.serving.protocol import APIError, GenerateParams, Served
from components.serving.responses import Outcome, SpecStats
from components.serving.telemetry import ServingMetrics
from components.spec.sampling import GREEDY, SamplingParams

log = logging.getLogger(__name__)


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
        self.engine = AsyncEngine(parts.engine)
        self.capacity = parts.engine.max_batch_size + int(max_queued)
        self.sampled_rule, self.overload_status, self.retry_after_s = sampled_rule, overload_status, retry_after_s
        self.drafter_label = drafter_label
        self.metrics = metrics or ServingMetrics(served.model, export_to_ray=False)
        self.admitted = 0  # requests between admission and their end
        self.error: str | None = None  # set once a round failed: the replica is dead
        self._seen = _Seen()
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, args=(poll_s,), name="specline-metrics", daemon=True)
        self._poller.start()

    # ------------------------------------------------------------------ health
    @property
    def healthy(self) -> bool:
        return self.error is None

    def check_health(self) -> None:
        """Raises while the engine is dead (Ray Serve then replaces the replica)."""
        if self.error is not None:
            raise RuntimeError(f"engine is dead: {self.error}")

    def status(self) -> dict[str, Any]:
        eng = self.parts.engine
        return {"status": "ok" if self.healthy else "dead", "error": self.error, "running": len(eng.running),
                "waiting": len(eng.waiting), "admitted": self.admitted, "capacity": self.capacity,
                "drafter_failures": self.parts.drafter.failures if self.parts.drafter is not None else 0}

    def shutdown(self) -> None:
        self._stop.set()
        self.engine.shutdown()

    # ------------------------------------------------------------------ generation
    def admit(self) -> None:
        """Takes one request in, or raises the overload / dead-engine ``APIError``."""
        if self.error is not None:
            raise APIError(503, f"the engine of this replica failed ({self.error}); it is being replaced, "
                                "retry shortly", code="engine_dead", headers={"Retry-After": str(self.retry_after_s)})
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

    def _died(self, err: BaseException) -> None:
        if self.error is None:
            self.error = str(err)
            log.error("engine failed; this replica reports unhealthy from now on: %s", err)

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
        eng, m, seen = self.parts.engine, self.metrics, self._seen
        with seen.lock:
            st = eng.stats
            now = (st.drafting_rounds, st.drafted, st.accepted, list(st.accepted_at), st.tokens, st.busy_seconds)
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
            failures = self.parts.drafter.failures if self.parts.drafter is not None else 0
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


def _at(values: list[int], k: int) -> int:
    return values[k] if k < len(values) else 0


def _spec_stats(result: Any, chunks: list[int]) -> SpecStats:
    """From the engine's result when the request ran to its end; from the chunk sizes when a
    stop string cut it (every round emits accepted + 1 tokens; how many it drafted is unknown)."""
    if result is not None:
        return SpecStats(result.rounds, list(result.accepted), list(result.drafted))
    return SpecStats(max(0, len(chunks) - 1), [c - 1 for c in chunks[1:]], None)
