"""Stage ``serve``: the target + drafter behind an OpenAI-compatible API on Ray Serve.

    python -m pipelines.serve conf=dspark.yaml serve.drafter_path=runs/train/drafter
    python -m pipelines.serve conf=dspark.yaml serve.drafter_run_id=<train stage's MLflow run id>
    python -m pipelines.serve conf=dspark.yaml serve.drafter=none      # the target alone
    python -m pipelines.full conf=dspark.yaml "stages=[target,data,train,eval,serve]"

Setup: the target (upstream ``target_path`` or the configured one), the drafter
(``components.serving.provenance``: path, MLflow run id, or the train stage's), the API key
(``serve.api_key`` or the variable ``serve.api_key_env`` names). Run: Ray (``components.cluster``),
Serve's HTTP proxy on ``serve.host:serve.port``, the app (``components.serving.app``). Report:
the MLflow run records which drafter (path, run id, registered version) is served and the
settings; the endpoint, the Ray dashboard and a sample ``curl`` are printed. With
``serve.block=true`` (default) the process then serves until Ctrl-C or SIGTERM (either shuts the
app, Serve and Ray down and ends with status 0); ``serve.block=false``
returns once the app is up (tests, scripts), leaving it running in this process's Ray.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

from components.cluster import dashboard_url, init_ray, shutdown_ray
from components.config import ConfigError, ServeConfig, SpeclineConfig
from components.data.shards import find_rollouts, load_manifest
from components.serving.app import build_app, model_id
from components.serving.auth import api_key
from components.serving.provenance import DrafterSource, resolve_drafter
from components.target.hf import resolve_target_path
from components.tracking import Tracker, tracking_uri
from pipelines.cli import main


def endpoint(sc: ServeConfig) -> str:
    host = "127.0.0.1" if sc.host in ("0.0.0.0", "::") else sc.host
    return f"http://{host}:{sc.port}"


def sample_curl(sc: ServeConfig, model: str, key: str | None) -> str:
    auth = ' -H "Authorization: Bearer $KEY"' if key else ""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32})
    return f"curl {endpoint(sc)}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'"


def start_app(cfg: SpeclineConfig, target_path: str, source: DrafterSource, key: str | None) -> None:
    """Serve's HTTP proxy on the configured address, then the app (waits until it is up)."""
    from ray import serve

    sc = cfg.serve
    serve.start(http_options={"host": sc.host, "port": sc.port})
    try:
        serve.run(build_app(cfg, target_path, source, key), name=sc.app_name, route_prefix="/", blocking=False)
    except RuntimeError as err:  # the replica constructor failed (e.g. a drafter for another target)
        raise ConfigError(f"serve: the app did not start: {_first_cause(str(err) + _status_text(sc.app_name))}") from None
    wait_until_ready(sc)


def wait_until_ready(sc: ServeConfig, poll_s: float = 0.5) -> None:
    """Returns once ``/health`` answers 200: the replica has warmed up (round profile, one short
    generation). A replica that dies while warming up, or ``serve.ready_timeout_s`` passing, is
    one clear error."""
    import urllib.error
    import urllib.request

    host = "127.0.0.1" if sc.host in ("0.0.0.0", "::") else sc.host
    url, last = f"http://{host}:{sc.port}/health", "no answer"
    deadline = time.monotonic() + sc.ready_timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        except urllib.error.HTTPError as err:  # 503 while warming up, or once dead
            body = json.loads(err.read() or b"{}")
            last = f"{body.get('status')}: {body.get('error')}" if body.get("error") else str(body.get("status"))
        except (urllib.error.URLError, OSError, ValueError) as err:
            last = str(err)
        time.sleep(poll_s)
    raise ConfigError(f"serve: the app did not become ready within serve.ready_timeout_s={sc.ready_timeout_s} s "
                      f"(last /health: {last}); see the replica's log")


def _status_text(app_name: str) -> str:
    """What Serve says about the app's deployments (their constructors' errors)."""
    from ray import serve

    try:
        app = serve.status().applications[app_name]
        return "\n".join([app.message or ""] + [d.message or "" for d in app.deployments.values()])
    except Exception:  # noqa: BLE001  (status is a best effort for the message)
        return ""


def _first_cause(text: str) -> str:
    for marker in ("ConfigError: ", "DrafterError: ", "TargetError: "):
        if marker in text:
            return text[text.rindex(marker) + len(marker):].strip().splitlines()[0]
    return text.strip().splitlines()[0] if text.strip() else "unknown error"


def _metrics_port() -> int | None:
    import ray

    ports = [n.get("MetricsExportPort") for n in ray.nodes() if n.get("Alive")]
    return ports[0] if ports else None


def _log(tracker: Tracker, cfg: SpeclineConfig, source: DrafterSource, target_path: str, model: str) -> None:
    params = {f"serve.{k}": v for k, v in dataclasses.asdict(cfg.serve).items() if k != "api_key"}
    tracker.log_params(params | {"serve.target_path": target_path, "serve.model": model,
                                 "serve.drafter_source": source.origin, "serve.drafter_checkpoint": source.path,
                                 "serve.drafter_run": source.run_id, "serve.drafter_version": source.version,
                                 "serve.drafter_served": source.label, "serve.drafter_why": source.why or None})


def _with_rollouts(cfg: SpeclineConfig, upstream: dict[str, Any], source: DrafterSource,
                   target_path: str) -> SpeclineConfig:
    """``cfg`` with ``serve.suffix_rollouts`` resolved for the replicas, where suffix decoding
    serves: ``auto`` → the data stage's shards of this run (upstream ``data_dir``, else
    ``data.output_dir``) when they are of the served target (``target_path``), else ``none``
    (a named directory is the replica's to check: its tokenizer against the target's)."""
    sc = cfg.serve
    if source.method not in ("suffix", "hybrid") or sc.suffix_rollouts != "auto":
        return cfg
    found = find_rollouts(sc.suffix_rollouts, [upstream.get("data_dir"), cfg.data.output_dir], "serve.suffix_rollouts")
    of = load_manifest(found)["meta"].get("target") if found is not None else None
    if found is not None and Path(str(of)).resolve() != Path(target_path).resolve():
        print(f"serve: suffix decoding starts with an empty tree: the rollouts in {found} are of {of}, "
              f"not of {target_path}", file=sys.stderr, flush=True)
        found = None
    elif found is not None:
        print(f"serve: suffix decoding's global tree starts with the rollouts in {found}", file=sys.stderr, flush=True)
    return dataclasses.replace(cfg, serve=dataclasses.replace(sc, suffix_rollouts=str(found) if found else "none"))


def run(cfg: SpeclineConfig, tracker: Tracker, upstream: dict[str, Any]) -> dict[str, Any]:
    """Returns upstream plus ``serve_endpoint``, ``serve_app``, ``serve_model``, ``serve_drafter_*``
    (``serve_drafter``: what drafts, ``serve_drafter_why``: for ``auto``, the eval's figures)."""
    sc, t0 = cfg.serve, time.perf_counter()
    target_path = upstream.get("target_path") or resolve_target_path(cfg.target, progress=True)
    source = resolve_drafter(cfg, upstream, tracking_uri(cfg) if tracker.enabled else None)
    key, model = api_key(sc), model_id(cfg)
    cfg = _with_rollouts(cfg, upstream, source, target_path)
    init_ray(cfg.ray)
    out = {**upstream, "serve_endpoint": endpoint(sc), "serve_app": sc.app_name, "serve_model": model,
           "serve_drafter_path": source.path, "serve_drafter_run_id": source.run_id,
           "serve_drafter": source.label, "serve_drafter_why": source.why}
    # Ray's driver exits with status 15 on SIGTERM, mid-shutdown; from here SIGTERM is Ctrl-C
    previous = signal.signal(signal.SIGTERM, _terminate) if sc.block else None
    try:
        start_app(cfg, target_path, source, key)
        _log(tracker, cfg, source, target_path, model)
        out["serve_startup_seconds"] = time.perf_counter() - t0
        tracker.log_metrics({"serve/startup_seconds": out["serve_startup_seconds"]})
        _announce(sc, model, key, source)
        if sc.block:
            print("serve: serving until Ctrl-C or SIGTERM", file=sys.stderr, flush=True)
            while True:
                time.sleep(3600)
    except (KeyboardInterrupt, _Stop) as why:
        _shut_down(sc, "SIGTERM" if isinstance(why, _Stop) else "Ctrl-C")
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return out


def _announce(sc: ServeConfig, model: str, key: str | None, source: DrafterSource) -> None:
    port, dash = _metrics_port(), dashboard_url()
    picked = f"serve: serve.drafter=auto serves {source.label}: {source.why}\n" if source.why else ""
    lines = [f"{picked}serve: {model} (drafter: {source.label}, from {source.origin}) at {endpoint(sc)}/v1",
             (f"serve: Ray dashboard {dash or 'off (ray.include_dashboard=true to enable)'}; "
             f"metrics: {endpoint(sc)}/metrics (this replica), Ray metrics port {port} (all replicas, ray_ prefix)"),
             f"serve: try  {sample_curl(sc, model, key)}"]
    print("\n".join(lines), file=sys.stderr, flush=True)


class _Stop(Exception):
    """SIGTERM (what Kubernetes, systemd and ``docker stop`` send) while the stage serves."""


def _terminate(signum: int, frame: Any) -> None:
    raise _Stop()


def _shut_down(sc: ServeConfig, why: str) -> None:
    """Deletes the app (requests in flight are cancelled), then shuts Ray down (Serve with it)."""
    from ray import serve

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the shutdown short
    print(f"serve: {why}: shutting down", file=sys.stderr, flush=True)
    try:
        serve.delete(sc.app_name)  # (serve.shutdown() here races its own controller's graceful shutdown)
    finally:
        shutdown_ray()


if __name__ == "__main__":
    sys.exit(main(run, "serve"))
