"""What a replica feeds its metrics (``telemetry.ServingMetrics``): the engine's counters since the
last export, and each finished request's latencies.

The engine keeps running totals (``BatchEngine.stats``, an ``EngineStats``); ``EngineCounters``
takes a snapshot of them by field name, and each ``export()`` adds the difference to the last
snapshot to the counters named in ``FIELDS`` / ``PER_POSITION`` (a field the engine renames
fails loudly, by name). The warm-up's own generation is not traffic: ``baseline()`` once warm
makes its counts the starting point, and ``export()`` does nothing before it. A thread exports
every ``poll_s``; ``/metrics`` exports on demand. Knows the engine's public counters
(``stats``, ``caps``/``capped_rounds``, ``running``/``waiting``) and the guard's failure count;
nothing about HTTP or requests' contents.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import time
from typing import Any

from components.serving.protocol import GenerateParams
from components.serving.responses import Outcome
from components.serving.telemetry import ServingMetrics

log = logging.getLogger(__name__)
FIELDS = {  # counter: the EngineStats field it follows
    "vllm:spec_decode_num_drafts": "drafting_rounds",
    "vllm:spec_decode_num_draft_tokens": "drafted",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
    "specline:engine_rounds": "rounds",
    "specline:engine_busy_seconds": "busy_seconds",
    "specline:engine_prefill_seconds": "prefill_seconds",
    "specline:engine_forward_seconds": "verify_seconds",
    "specline:engine_draft_seconds": "draft_seconds",
    "vllm:prefix_cache_queries": "prompt_tokens",
    "vllm:prefix_cache_hits": "prefix_hit_tokens",
}
PER_POSITION = {"vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_at"}  # counter{position}: list field


@dataclasses.dataclass
class Snapshot:
    """The engine's running totals at one moment."""

    stats: dict[str, Any]  # EngineStats fields by name (lists copied)
    capped_rounds: int  # rounds whose draft cap the engine recorded
    failures: int  # drafter failures the guard turned plain

    def delta(self, before: Snapshot, field: str) -> float:
        return self.stats[field] - before.stats[field]


class EngineCounters:
    """The engine's counters into ``metrics`` (module docstring)."""

    def __init__(self, parts: Any, metrics: ServingMetrics, poll_s: float = 0.5):
        self.parts, self.metrics = parts, metrics  # parts.engine may be rebuilt by the warm-up
        self._last: Snapshot | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, args=(poll_s,), name="specline-metrics", daemon=True)
        self._thread.start()

    def baseline(self) -> None:
        """The counts as they are now are taken as exported (the warm-up's are not traffic)."""
        with self._lock:
            self._last = self.snapshot()

    def snapshot(self) -> Snapshot:
        eng = self.parts.engine
        stats = {f.name: copy.copy(getattr(eng.stats, f.name)) for f in dataclasses.fields(eng.stats)}
        return Snapshot(stats, eng.capped_rounds, drafter_failures(self.parts))

    def export(self) -> None:
        """The counts since the last export, into the metrics; nothing before ``baseline()``."""
        if self._last is None:
            return
        with self._lock:
            now, before = self.snapshot(), self._last
            self._counters(now, before)
            self._caps(now, before)
            self._last = now
        eng = self.parts.engine
        self.metrics.set("vllm:num_requests_running", len(eng.running))
        self.metrics.set("vllm:num_requests_waiting", len(eng.waiting))

    def stop(self) -> None:
        self._stop.set()

    def _counters(self, now: Snapshot, before: Snapshot) -> None:
        m = self.metrics
        for name, field in FIELDS.items():
            m.inc(name, now.delta(before, field))
        for name, field in PER_POSITION.items():
            old = before.stats[field]
            for k, hits in enumerate(now.stats[field]):
                m.inc(name, hits - (old[k] if k < len(old) else 0), position=str(k))
        busy = now.delta(before, "busy_seconds")
        if busy > 0:
            m.set("specline:generation_tokens_per_second", now.delta(before, "tokens") / busy)
        m.inc("specline:spec_decode_fallbacks", now.failures - before.failures)

    def _caps(self, now: Snapshot, before: Snapshot) -> None:
        caps = list(self.parts.engine.caps)  # the engine keeps the last caps only
        for cap in caps[len(caps) - min(now.capped_rounds - before.capped_rounds, len(caps)):]:
            self.metrics.observe("specline:spec_decode_draft_cap", float(cap))

    def _poll(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                self.export()
            except Exception as err:  # noqa: BLE001  (metrics never take the replica down)
                log.warning("metrics poll failed: %s", err)


def drafter_failures(parts: Any) -> int:
    """Drafter failures the guard turned into plain decoding, so far."""
    return parts.drafter.failures if parts.drafter is not None else 0


def observe_request(metrics: ServingMetrics, params: GenerateParams, out: Outcome, arrival: float,
                    first: float | None) -> None:
    """One finished request: its tokens, finish reason, latencies and acceptance length."""
    now, n = time.perf_counter(), len(out.token_ids)
    metrics.inc("vllm:prompt_tokens", len(params.prompt_ids))
    metrics.inc("vllm:request_success", finished_reason=out.finish_reason)
    metrics.observe("vllm:e2e_request_latency_seconds", now - arrival)
    if first is not None:
        metrics.observe("vllm:time_to_first_token_seconds", first - arrival)
        if n > 1:
            metrics.observe("vllm:request_time_per_output_token_seconds", (now - first) / (n - 1))
    if out.spec.drafted:
        metrics.observe("specline:spec_decode_acceptance_length", out.spec.to_dict()["mean_acceptance_length"])
