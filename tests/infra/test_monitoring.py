"""Monitoring: the Prometheus scrape config (``infra/prometheus/prometheus.yml``) reads Ray's own
service-discovery file and the KubeRay pods' metrics ports; the Grafana dashboard
(``infra/grafana-serving.json``) has a panel for each serving figure the issue names, and every
series a panel queries exists:

* in code: among the names specline's replica defines (``telemetry.SPECS``) as Ray exports them;
* live: a replica built as a Serve replica builds it (``build_replica``: the target, the guarded
  drafter, the batch engine, metrics exported to Ray), warmed up as Serve warms it up, serves
  requests (one drafter fault, one overload refusal) in this process; then every target of the
  service-discovery content Ray writes for Prometheus is scraped over HTTP, and every series of
  every panel must be in what the node's metrics export port answers. Without Ray Serve's HTTP
  proxy, so the series lack Serve's application/deployment/replica tags (the panels filter on
  ``application``, matched by ``.*`` when "All" is picked)."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request

import pytest
import yaml

from components.config import DrafterConfig, ServeConfig, SpeclineConfig
from components.serving.telemetry import SPECS, ray_name
from tests.infra.manifests import INFRA, one

DASHBOARD = INFRA / "grafana-serving.json"
PROMETHEUS = INFRA / "prometheus" / "prometheus.yml"
# what the issue asks the dashboard to show → a series its panel must query
ASKED = {"acceptance length": "ray_vllm_spec_decode_num_accepted_tokens_total",
         "accepted tokens/s": "ray_vllm_spec_decode_num_accepted_tokens_total",
         "draft length": "ray_vllm_spec_decode_num_draft_tokens_total",
         "TTFT": "ray_vllm_time_to_first_token_seconds_bucket",
         "TPOT": "ray_vllm_request_time_per_output_token_seconds_bucket",
         "queue depth": "ray_vllm_num_requests_waiting",
         "fallbacks": "ray_specline_spec_decode_fallbacks_total",
         "errors": "ray_specline_requests_rejected_total"}


def panel_series() -> dict[str, set[str]]:
    """Panel title → the Prometheus series its queries read."""
    dash = json.loads(DASHBOARD.read_text())
    return {p["title"]: {n for t in p["targets"] for n in re.findall(r"\bray_[a-z0-9_]+", t["expr"])}
            for p in dash["panels"]}


def exported_names() -> set[str]:
    """The series Ray's metrics export port serves for SPECS (counters _total, histograms per bucket)."""
    out: set[str] = set()
    for name, (kind, *_rest) in SPECS.items():
        base = "ray_" + ray_name(name)
        out |= {base + "_total"} if kind == "counter" else {base} if kind == "gauge" else {
            base + "_bucket", base + "_sum", base + "_count"}
    return out


def test_the_dashboard_has_a_panel_for_each_figure_asked():
    panels = panel_series()
    for figure, series in ASKED.items():
        assert any(figure.lower() in title.lower() and series in used for title, used in panels.items()), figure
    dash = json.loads(DASHBOARD.read_text())
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == "${datasource}" and all('application=~"$application"' in t["expr"]
                                                                for t in p["targets"]), p["title"]


def test_every_series_of_the_dashboard_is_defined_by_the_replica():
    used = set().union(*panel_series().values())
    assert used and used <= exported_names(), used - exported_names()


def test_prometheus_reads_rays_discovery_file_and_the_kuberay_metrics_ports():
    from ray._private import ray_constants

    config = yaml.safe_load(PROMETHEUS.read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    (files,) = [c["files"] for c in jobs["ray"]["file_sd_configs"]]
    assert files == [f"/tmp/ray/{ray_constants.PROMETHEUS_SERVICE_DISCOVERY_FILE}"]  # Ray's default temp dir
    kube = jobs["ray-kuberay"]
    assert kube["kubernetes_sd_configs"][0]["namespaces"]["names"] == [one("RayCluster")["metadata"]["namespace"]]
    keep = {r["source_labels"][0]: r["regex"] for r in kube["relabel_configs"] if r.get("action") == "keep"}
    # KubeRay labels every Ray pod ray.io/is-ray-node=yes; the manifests name the metrics port "metrics"
    assert keep == {"__meta_kubernetes_pod_label_ray_io_is_ray_node": "yes",
                    "__meta_kubernetes_pod_container_port_name": "metrics"}
    cluster = one("RayCluster")["spec"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        ports = {p["name"] for c in group["template"]["spec"]["containers"] for p in c["ports"]}
        assert "metrics" in ports


# ----------------------------------------------------------------------------- live
def _serve(replica, bodies: list[dict]) -> None:
    from components.serving.protocol import APIError, parse_request

    async def one_request(body: dict) -> None:
        params = parse_request("completion", body, replica.served)
        replica.admit()
        async for _ in replica.generate(params):
            pass

    async def all_requests() -> None:
        await asyncio.gather(*(one_request(b) for b in bodies))

    asyncio.run(all_requests())
    replica.counters.export()
    while True:  # overload: admissions past capacity are refused and counted
        try:
            replica.admit()
        except APIError as err:
            assert err.status == 503
            break


class _Flaky:
    """A drafter method that raises after ``ok`` calls (a drafter fault mid-round)."""

    def __init__(self, inner, ok: int):
        self.inner, self.ok = inner, ok

    def __call__(self, *args, **kwargs):
        self.ok -= 1
        if self.ok < 0:
            raise RuntimeError("drafter fault")
        return self.inner(*args, **kwargs)


def _scrape(url: str) -> set[str]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


@pytest.mark.slow
def test_a_live_replicas_metrics_reach_rays_export_port_with_every_panel_series(
        tmp_path, tiny_target_cfg, tiny_target_build, tiny_target, ray_session):
    import ray
    from ray._private.metrics_agent import PrometheusServiceDiscoveryWriter

    from components.drafters import build_drafter, save_drafter
    from components.serving.app import build_replica, warm_up_steps
    from components.serving.provenance import DrafterSource

    drafter = save_drafter(build_drafter(DrafterConfig(name="dspark", num_layers=1, block_size=4, markov_rank=8),
                                         tiny_target), tmp_path / "drafter")
    ids = tiny_target.tokenizer.encode("def parse(path):\n    with open(path) as f:\n        return f.read()\n")
    bodies = [{"prompt": ids[i:i + 8], "max_tokens": 12, "temperature": 0, "ignore_eos": True} for i in range(4)]
    source = DrafterSource(str(drafter), "test")
    # fixed γ (every request drafts: acceptance, fallbacks), then the adaptive cap (the draft cap histogram)
    for adaptive in (False, True):
        sc = ServeConfig(adaptive=adaptive, profile_dir=str(tmp_path / "profiles"), max_ongoing_requests=4,
                         max_queued_requests=0, num_speculative_tokens=3, loop_stages=1)
        cfg = SpeclineConfig(run_dir=str(tmp_path / "runs"), target=tiny_target_cfg, serve=sc)
        replica = build_replica(cfg, str(tiny_target_build[0]), source, "tiny")
        try:
            assert replica.warm_up(warm_up_steps(replica, sc))
            if not adaptive:
                guarded = replica.parts.drafter.drafter
                method = "propose_many" if hasattr(guarded, "propose_many") else "propose"
                setattr(guarded, method, _Flaky(getattr(guarded, method), ok=3))
            _serve(replica, bodies)
        finally:
            replica.shutdown()

    gcs = ray.get_runtime_context().gcs_address
    content = json.loads(PrometheusServiceDiscoveryWriter(gcs, str(tmp_path)).get_file_discovery_content())
    node = {f"{n['NodeManagerAddress']}:{n['MetricsExportPort']}" for n in ray.nodes() if n["Alive"]}
    targets = {t for group in content for t in group["targets"]}
    assert node <= targets  # what Prometheus's file_sd reads names every node's metrics export port
    wanted = set().union(*panel_series().values())
    deadline, found = time.monotonic() + 45, set()
    while not wanted <= found and time.monotonic() < deadline:  # Ray reports user metrics every ~10 s
        time.sleep(2)
        found = set().union(*(_scrape(f"http://{t}/metrics") for t in node))
    assert wanted <= found, sorted(wanted - found)
