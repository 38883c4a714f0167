"""Metrics: the Prometheus text of a replica (vLLM's names, counters with ``_total``, cumulative
histogram buckets) and the Grafana panels under ``infra/`` reading only names Ray exports."""

from __future__ import annotations

import json
import re

from components.config import PROJECT_ROOT
from components.serving.telemetry import SPECS, ServingMetrics, ray_name


def test_render_is_prometheus_text():
    m = ServingMetrics("tiny", export_to_ray=False)
    m.inc("vllm:spec_decode_num_drafts", 3)
    m.inc("vllm:spec_decode_num_accepted_tokens_per_pos", 2, position="0")
    m.set("vllm:num_requests_running", 4)
    for v in (0.003, 0.05, 0.05, 30.0):
        m.observe("vllm:time_to_first_token_seconds", v)
    text = m.render()
    assert 'vllm:spec_decode_num_drafts_total{model_name="tiny"} 3.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"} 2.0' in text
    assert 'vllm:num_requests_running{model_name="tiny"} 4' in text
    assert 'vllm:time_to_first_token_seconds_bucket{model_name="tiny",le="0.005"} 1' in text
    assert 'vllm:time_to_first_token_seconds_bucket{model_name="tiny",le="0.06"} 3' in text
    assert 'vllm:time_to_first_token_seconds_bucket{model_name="tiny",le="+Inf"} 4' in text
    assert 'vllm:time_to_first_token_seconds_count{model_name="tiny"} 4' in text
    assert "# TYPE vllm:spec_decode_num_drafts_total counter" in text


def test_grafana_panels_read_exported_names():
    dash = json.loads((PROJECT_ROOT / "infra" / "grafana-serving.json").read_text())
    exported = set()
    for name, (kind, *_rest) in SPECS.items():
        base = "ray_" + ray_name(name)
        exported |= {base + "_total"} if kind == "counter" else {base} if kind == "gauge" else {
            base + "_bucket", base + "_sum", base + "_count"}
    used = {n for p in dash["panels"] for t in p["targets"] for n in re.findall(r"ray_[a-z0-9_]+", t["expr"])}
    assert used and used <= exported, used - exported
