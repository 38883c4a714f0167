"""Serving metrics, named after vLLM's so its dashboards and habits carry over.

Each metric is recorded twice: into Ray's metrics (``ray.serve.metrics``, i.e. ``ray.util.metrics``
tagged with deployment / replica / application) and into this replica's own table, which
``GET /metrics`` renders at once in the Prometheus text format (one replica's view: the one
that answered), with vLLM's exact names. Ray deprecates ``:`` in metric names, so there the
colon becomes ``_`` and Ray adds its prefix: ``vllm:spec_decode_num_drafts`` is
``ray_vllm_spec_decode_num_drafts_total`` on Ray's metrics export port (after its next report,
~10 s). Names (counters get ``_total`` in the text format, as in vLLM)::

    vllm:spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens      counters
    vllm:spec_decode_num_accepted_tokens_per_pos{position}                      counter
    vllm:num_requests_running / vllm:num_requests_waiting                       gauges
    vllm:prompt_tokens / vllm:generation_tokens / vllm:request_success{finished_reason}
    vllm:time_to_first_token_seconds / vllm:request_time_per_output_token_seconds /
    vllm:e2e_request_latency_seconds                                            histograms
    specline:spec_decode_acceptance_length     histogram, per request (1 + accepted / drafts)
    specline:spec_decode_draft_cap             histogram, the cap the engine chose per round
    specline:spec_decode_fallbacks             counter, drafter failures turned plain decoding
    specline:requests_rejected{reason}         counter, overload rejections
    specline:generation_tokens_per_second      gauge, tokens per second of engine busy time
    specline:engine_rounds / _busy_seconds / _prefill_seconds / _forward_seconds / _draft_seconds
                                               counters: the engine's rounds, their time, and of it
                                               admission (prefill), the rounds' target pass, drafting
    vllm:prefix_cache_queries / _hits          counters, prompt tokens admitted / copied from kept
                                               prompt prefixes (``serve.prefix_cache_tokens``)

Knows metric names and the Prometheus text format; nothing about the engine or HTTP (the
replica feeds it).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)
LENGTH_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0, 16.0)
CAP_BUCKETS = (0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0, 16.0, 24.0, 32.0)  # le 0.5: plain rounds

SPECS: dict[str, tuple[str, str, tuple[str, ...], Sequence[float]]] = {  # name: kind, help, tag keys, buckets
    "vllm:spec_decode_num_drafts": ("counter", "Drafting rounds (one per request per round).", (), ()),
    "vllm:spec_decode_num_draft_tokens": ("counter", "Draft tokens proposed.", (), ()),
    "vllm:spec_decode_num_accepted_tokens": ("counter", "Draft tokens accepted.", (), ()),
    "vllm:spec_decode_num_accepted_tokens_per_pos": ("counter", "Accepted draft tokens per position.",
                                                     ("position",), ()),
    "vllm:num_requests_running": ("gauge", "Requests in the running batch.", (), ()),
    "vllm:num_requests_waiting": ("gauge", "Requests waiting to join the batch.", (), ()),
    "vllm:prompt_tokens": ("counter", "Prompt tokens of finished requests.", (), ()),
    "vllm:generation_tokens": ("counter", "Generated tokens.", (), ()),
    "vllm:request_success": ("counter", "Finished requests.", ("finished_reason",), ()),
    "vllm:time_to_first_token_seconds": ("histogram", "Time to first token.", (), LATENCY_BUCKETS),
    "vllm:request_time_per_output_token_seconds": ("histogram", "Time per output token after the first.", (),
                                                   LATENCY_BUCKETS),
    "vllm:e2e_request_latency_seconds": ("histogram", "End-to-end request latency.", (), LATENCY_BUCKETS),
    "specline:spec_decode_acceptance_length": ("histogram", "Mean acceptance length of a request.", (),
                                               LENGTH_BUCKETS),
    "specline:spec_decode_draft_cap": ("histogram", "Draft cap chosen per round.", (), CAP_BUCKETS),
    "specline:spec_decode_fallbacks": ("counter", "Drafter failures (requests fell back to plain decoding).",
                                       (), ()),
    "specline:requests_rejected": ("counter", "Requests rejected for overload.", ("reason",), ()),
    "specline:generation_tokens_per_second": ("gauge", "Tokens per second of engine busy time.", (), ()),
    "specline:engine_rounds": ("counter", "Engine rounds (admission, drafting, one target pass, acceptance).",
                               (), ()),
    "specline:engine_busy_seconds": ("counter", "Engine time in rounds (the rest it waits for requests).", (), ()),
    "specline:engine_prefill_seconds": ("counter", "Engine time admitting requests (their prefill passes).",
                                        (), ()),
    "specline:engine_forward_seconds": ("counter", "Engine time in the rounds' target passes (verify or plain).",
                                        (), ()),
    "specline:engine_draft_seconds": ("counter", "Engine time drafting.", (), ()),
    "vllm:prefix_cache_queries": ("counter", "Prompt tokens of admitted requests.", (), ()),
    "vllm:prefix_cache_hits": ("counter", "Prompt tokens copied from kept prompt prefixes instead of computed.",
                               (), ()),
}


@dataclass
class _Series:
    value: float = 0.0  # counter / gauge
    buckets: list[int] = field(default_factory=list)  # histogram: per upper bound (not cumulative)
    total: float = 0.0
    count: int = 0


class ServingMetrics:
    """The replica's metrics: ``inc``, ``set``, ``observe`` by name; ``render()`` for /metrics."""

    def __init__(self, model: str, export_to_ray: bool = True):
        self.model = model
        self._lock = threading.Lock()
        self._series: dict[tuple[str, tuple[tuple[str, str], ...]], _Series] = {}
        self._ray: dict[str, Any] = _ray_metrics(model) if export_to_ray else {}

    def inc(self, name: str, value: float = 1.0, **tags: str) -> None:
        if value <= 0:
            return
        with self._lock:
            self._get(name, tags).value += value
        if name in self._ray:
            self._ray[name].inc(value, tags=tags or None)

    def set(self, name: str, value: float, **tags: str) -> None:
        with self._lock:
            self._get(name, tags).value = value
        if name in self._ray:
            self._ray[name].set(value, tags=tags or None)

    def observe(self, name: str, value: float, **tags: str) -> None:
        bounds = SPECS[name][3]
        with self._lock:
            s = self._get(name, tags)
            if not s.buckets:
                s.buckets = [0] * (len(bounds) + 1)
            s.buckets[bisect.bisect_left(bounds, value)] += 1
            s.total += value
            s.count += 1
        if name in self._ray:
            self._ray[name].observe(value, tags=tags or None)

    def value(self, name: str, **tags: str) -> float:
        """A counter's or gauge's value (a histogram's count)."""
        with self._lock:
            s = self._series.get((name, tuple(sorted(tags.items()))))
        return 0.0 if s is None else (s.count if SPECS[name][0] == "histogram" else s.value)

    def _get(self, name: str, tags: dict[str, str]) -> _Series:
        if name not in SPECS:
            raise KeyError(f"unknown metric {name}")
        return self._series.setdefault((name, tuple(sorted(tags.items()))), _Series())

    def render(self) -> str:
        """The Prometheus text exposition of this replica's metrics."""
        lines: list[str] = []
        with self._lock:
            items = sorted(self._series.items())
        done: set[str] = set()
        for (name, tags), s in items:
            kind, help_text, _, bounds = SPECS[name]
            base = name + ("_total" if kind == "counter" else "")
            if name not in done:
                lines += [f"# HELP {base} {help_text}", f"# TYPE {base} {kind}"]
                done.add(name)
            labels = (("model_name", self.model),) + tags
            if kind != "histogram":
                lines.append(f"{base}{_labels(labels)} {s.value}")
                continue
            running = 0
            for bound, n in zip([*bounds, float("inf")], s.buckets):
                running += n
                le = "+Inf" if bound == float("inf") else repr(float(bound))
                lines.append(f"{name}_bucket{_labels(labels + (('le', le),))} {running}")
            lines += [f"{name}_sum{_labels(labels)} {s.total}", f"{name}_count{_labels(labels)} {s.count}"]
        return "\n".join(lines) + "\n"


def _labels(pairs: tuple[tuple[str, str], ...]) -> str:
    inner = ",".join(f'{k}="{v!s}"' for k, v in pairs)
    return "{" + inner + "}" if inner else ""


def ray_name(name: str) -> str:
    """The name in Ray (no colons): ``vllm:x`` → ``vllm_x``."""
    return name.replace(":", "_")


def _ray_metrics(model: str) -> dict[str, Any]:
    """The same metrics in Ray (tagged by Serve with deployment / replica / application)."""
    import ray
    from ray.serve import metrics as serve_metrics

    if not ray.is_initialized():
        return {}
    kinds = {"counter": serve_metrics.Counter, "gauge": serve_metrics.Gauge, "histogram": serve_metrics.Histogram}
    out: dict[str, Any] = {}
    for name, (kind, help_text, tag_keys, bounds) in SPECS.items():
        extra = {"boundaries": list(bounds)} if kind == "histogram" else {}
        metric = kinds[kind](ray_name(name), description=help_text, tag_keys=("model_name", *tag_keys), **extra)
        metric.set_default_tags({"model_name": model})
        out[name] = metric
    return out
