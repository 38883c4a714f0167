"""The Ray Serve application: a FastAPI app over one ``Replica`` per Serve replica.

Routes (OpenAI-compatible, as vLLM's server names them), declared once in ``new_api``::

    POST /v1/completions        prompt (string or token ids) → text, streaming or not
    POST /v1/chat/completions   messages (the target's chat template) → text, streaming or not
    GET  /v1/models             the served model, its drafter (run id, version) and engine settings
    GET  /health                200 once warm; 503 while warming up or once the engine failed
    POST /tokenize, /detokenize vLLM's shapes ({"prompt"|"messages"} → tokens; {"tokens"} → prompt)
    GET  /metrics               this replica's metrics, Prometheus text (``telemetry.py``)

The API key is the app's dependency (``auth.py``): every route but ``/health`` and ``/metrics``
needs it, a route added later included. Bodies are parsed by ``protocol.py``, not by FastAPI's
models, so every client mistake is a 400 (413 for a body over ``serve.max_body_bytes``, 404 for
another model, 401 without the API key) with an OpenAI error body; no OpenAPI schema is served.
``build_app(cfg, target_path, source, api_key)`` gives the bound deployment for ``serve.run``;
``deployment_options(sc)`` the Serve settings; ``app_builder(args)`` the same from a Serve config
file (``import_path: components.serving.app:app_builder``, ``infra/serve-specline.yaml``).

Overload. A replica's own admission (``Replica.admit``) refuses a generation request past its
capacity (``max_ongoing_requests`` running + ``max_queued_requests`` waiting) at once, before
reading its body: 503/429 with ``Retry-After`` and an OpenAI body. A request past the Serve
slots of every replica waits in Serve's router, which routes two waiting requests per replica
at a time with a back-off of up to half a second per try (Ray Serve 2.60), and so let a burst
of 150 wait 10 s for its refusal. So a replica has twice its capacity in Serve slots (the spare
half for probes and refusals, which are quick) and the router queues no more than the spare
(``max_queued_requests``): past it the router refuses at once itself, with the same status and
``Retry-After`` and Serve's own plain-text body. The queue cannot be shorter: the router counts a
request as queued while it picks a replica, so a burst the replica could admit, arriving at
once, must fit in it. What is left: at most that many requests of a large burst wait in the
router, and are answered (refused, or served once a slot frees) as it routes them, two per try
(``test_http.py`` prints the burst's refusal times).

Start-up, as Ray Serve sees it. The constructor loads the target and drafter and builds the
engine: what a configuration can make fail (a drafter for another target, a capability it
lacks) fails the replica's start, which Serve retries ``max_constructor_retry_count`` times and
``serve.run`` then reports. The warm-up (``Replica.warm_up``: the adaptive cap's round profile,
measured on a host's first start per setting, then one short generation) runs on a thread once
the constructor has returned, so Serve marks the replica running and routes to it: meanwhile
``/health`` is 503 ``{"status": "warming_up", "phase": ...}`` and ``/v1/*`` a 503 OpenAI error
with ``Retry-After`` (``/tokenize``, ``/detokenize`` and ``/metrics`` answer); ``check_health``
passes until the replica is dead (``lifecycle.py``). The price of a background warm-up: to
Serve a warming replica is up, so ``serve.run`` returns before it is warm (poll ``/health``) and
a scale-up or rolling update routes requests to a new replica that answers them 503 +
``Retry-After`` until warm, rather than queueing them.

No ``from __future__ import annotations`` here: FastAPI reads the handlers' ``Request``
annotations. Knows FastAPI, Ray Serve and the serving components; nothing about the engine's
internals.
"""

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse

from components.config import ConfigError, ServeConfig, SpeclineConfig
from components.serving import generation
from components.serving.auth import key_dependency
from components.serving.protocol import (
    APIError,
    Served,
    detokenize_request,
    parse_json,
    tokenize_request,
)
from components.serving.provenance import DrafterSource
from components.serving.replica import Replica
from components.serving.responses import model_card

log = logging.getLogger(__name__)
HEADROOM = 8  # the least Serve-level slots past a replica's capacity: /health, /metrics, tokenize routes


def model_id(cfg: SpeclineConfig) -> str:
    """The served model id: ``serve.model_name``, else the target's name (last path part)."""
    return cfg.serve.model_name or Path(cfg.target.name_or_path.rstrip("/")).name


def served_for(target: Any, sc: ServeConfig, model: str) -> Served:
    """What request checks need of ``target``: a generation ends at its eos ids (``Target.eos_ids``)
    unless ignore_eos."""
    positions = int(getattr(target.model.config, "max_position_embeddings", 0) or 1 << 30)
    return Served(model, target.tokenizer, target.vocab_size, min(sc.max_model_len or positions, positions),
                  target.eos_ids)


def deployment_options(sc: ServeConfig) -> dict[str, Any]:
    """Ray Serve deployment settings from ``serve`` (overload: module docstring)."""
    capacity = sc.max_ongoing_requests + sc.max_queued_requests  # what the replica admits
    spare = max(HEADROOM, capacity)
    opts: dict[str, Any] = {
        # Serve's slots: the capacity and as many again (probes, refusals); its router's queue:
        # as many as the capacity (a burst the replica could admit gets in, even all at once);
        # past it the router refuses at once (module docstring)
        "max_ongoing_requests": capacity + spare, "max_queued_requests": spare,
        "backpressure_config": {"status_code": sc.overload_status, "retry_after_s": sc.retry_after_s},
        "health_check_period_s": sc.health_check_period_s, "health_check_timeout_s": sc.health_check_timeout_s,
        "ray_actor_options": {"num_cpus": sc.cpus_per_replica, "num_gpus": sc.gpus_per_replica},
        "max_constructor_retry_count": 1,  # a drafter that does not fit its target fails at once, named
        "logging_config": {"enable_access_log": sc.access_log},
    }
    if sc.autoscaling:
        opts["autoscaling_config"] = {"min_replicas": sc.min_replicas, "max_replicas": sc.max_replicas,
                                      "target_ongoing_requests": sc.target_ongoing_requests}
    else:
        opts["num_replicas"] = sc.num_replicas
    return opts


def build_replica(cfg: SpeclineConfig, target_path: str, source: DrafterSource, model: str) -> Replica:
    """One replica's engine parts (target, guarded drafter, batch engine) behind a ``Replica``,
    not yet warm (``warm_up_steps``, ``Replica.warm_up``)."""
    from components.serving.assemble import build_parts
    from components.serving.telemetry import ServingMetrics

    sc = cfg.serve
    parts = build_parts(cfg.target, sc, target_path, source, adapt_now=False)
    replica = Replica(parts, served_for(parts.target, sc, model), sc.max_queued_requests, sc.sampled_rule,
                      sc.overload_status, sc.retry_after_s, source.label if source.speculates else None,
                      ServingMetrics(model, export_to_ray=True), stream_interval_s=sc.stream_interval_ms / 1000)
    log.info("replica loaded in %.1f s: %s, drafter %s; warming up", parts.startup_seconds, model, source.label)
    return replica


def warm_up_steps(replica: Replica, sc: ServeConfig) -> list[tuple[str, Callable[[], None]]]:
    """The warm-up's own steps before the warm-up generation: the adaptive cap's round profile."""
    from components.serving.assemble import adapt

    if not replica.parts.adapts:
        return []
    return [("round profile", lambda: adapt(replica.parts, sc))]


def on_a_thread_of_its_own(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on a new thread that ends when it returns (its exception re-raised here).

    The kernels' OpenMP runtime (libgomp) keeps a team of worker threads for every thread that
    ran a parallel region, for as long as that thread lives; once a process holds more of them
    than CPUs, every worker sleeps between regions (libgomp's throttled spin) and each of a
    decode pass's few hundred regions pays a wake-up: a replica decoding on two threads ran its
    passes at half the speed (docs/results.md). Building the engine packs weights on torch's
    thread count, and a replica's constructor runs on the actor's thread, which lives as long as
    the replica; on a thread of its own the build leaves no team behind, and the engine thread's
    is the only one."""
    with ThreadPoolExecutor(1, thread_name_prefix="specline-build") as pool:  # its exit joins the thread
        return pool.submit(fn, *args).result()


class Server:
    """One Serve replica: a target + drafter engine and the handler of each route (``new_api``
    binds them to paths; Serve builds that app in the replica, ``__serve_build_asgi_app__``)."""

    def __init__(self, cfg: SpeclineConfig, target_path: str, source: DrafterSource, api_key: str | None):
        self.model, self.source, self.api_key, self.sc = model_id(cfg), source, api_key, cfg.serve
        self.replica = on_a_thread_of_its_own(build_replica, cfg, target_path, source, self.model)
        threading.Thread(target=self.warm_up, name="specline-warm-up", daemon=True).start()

    def __serve_build_asgi_app__(self) -> Any:
        return new_api(self, self.api_key)

    def warm_up(self) -> None:
        """On the warm-up thread (module docstring)."""
        self.replica.warm_up(warm_up_steps(self.replica, self.sc))

    def check_health(self) -> None:
        self.replica.life.check_health()

    async def completions(self, request: Request) -> Any:
        return await generation.generate(self.replica, self.model, "completion", request, self.sc.max_body_bytes)

    async def chat(self, request: Request) -> Any:
        return await generation.generate(self.replica, self.model, "chat", request, self.sc.max_body_bytes)

    async def models(self) -> Any:
        self.replica.life.check_ready()
        drafter = None
        if self.source.speculates and self.replica.parts.drafter is not None:
            drafter = {"id": self.source.label, "family": self.replica.parts.family,
                       "run_id": self.source.run_id, "version": self.source.version, "origin": self.source.origin}
        return JSONResponse(model_card(self.model, self.replica.served.max_model_len, drafter,
                                       self.replica.parts.settings))

    async def health(self) -> Any:
        return JSONResponse(self.replica.status(), status_code=200 if self.replica.healthy else 503)

    async def tokenize(self, request: Request) -> Any:
        body = parse_json(await generation.read_body(request, self.sc.max_body_bytes))
        return JSONResponse(tokenize_request(body, self.replica.served))

    async def detokenize(self, request: Request) -> Any:
        body = parse_json(await generation.read_body(request, self.sc.max_body_bytes))
        return JSONResponse(detokenize_request(body, self.replica.served))

    async def metrics(self) -> Any:
        self.replica.counters.export()
        return PlainTextResponse(self.replica.metrics.render(), media_type="text/plain; version=0.0.4")


def new_api(server: Server, api_key: str | None) -> Any:
    """The FastAPI app of one replica: the route table, the key on every route but the public
    ones, and errors as OpenAI bodies (``APIError`` → its status; anything else → a logged 500)."""
    from fastapi import Depends, FastAPI

    api = FastAPI(title="specline", docs_url=None, redoc_url=None, openapi_url=None,
                  dependencies=[Depends(key_dependency(api_key))])
    api.post("/v1/completions")(server.completions)
    api.post("/v1/chat/completions")(server.chat)
    api.get("/v1/models")(server.models)
    api.get("/health")(server.health)
    api.post("/tokenize")(server.tokenize)
    api.post("/detokenize")(server.detokenize)
    api.get("/metrics")(server.metrics)

    @api.exception_handler(APIError)
    async def _api_error(_request: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @api.exception_handler(Exception)
    async def _unexpected(_request: Request, err: Exception) -> JSONResponse:
        log.exception("unexpected server error")
        return JSONResponse(APIError(500, f"internal error: {type(err).__name__}: {err}").body(), status_code=500)

    return api


def make_server_class() -> type:
    """The Serve ingress class (its app is built in each replica, from the replica's key)."""
    from ray import serve

    return serve.ingress()(Server)


def build_app(cfg: SpeclineConfig, target_path: str, source: DrafterSource, api_key: str | None) -> Any:
    """The bound Serve application (``serve.run(build_app(...), name=..., route_prefix="/")``)."""
    from ray import serve

    server = serve.deployment(make_server_class(), name="SpeclineServer", **deployment_options(cfg.serve))
    return server.bind(cfg, target_path, source, api_key)


def app_builder(args: dict[str, Any]) -> Any:
    """The app from a Serve config (``import_path: components.serving.app:app_builder``, e.g. a
    KubeRay RayService's ``serveConfigV2`` or ``serve run``): ``args`` = ``{"conf": "dspark.yaml",
    "overrides": ["serve.drafter=suffix", ...]}``, read as the command line reads them. The
    drafter comes from ``serve.drafter_path``, ``serve.drafter_run_id`` or ``serve.drafter:
    suffix``/``none`` (there is no train stage upstream); the target is resolved (built or
    converted on first use) here, in the process that builds the app."""
    from components.confload import load_cli
    from components.serving.auth import api_key
    from components.serving.provenance import resolve_drafter
    from components.target.hf import resolve_target_path
    from components.tracking import tracking_uri

    unknown = set(args) - {"conf", "overrides"}
    if unknown:
        raise ConfigError(f"app_builder args: unknown {sorted(unknown)}; use conf and overrides")
    cfg = load_cli([f"conf={args.get('conf', 'dspark.yaml')}", *list(args.get("overrides") or [])])
    source = resolve_drafter(cfg, {}, tracking_uri(cfg) if cfg.tracking.enabled else None)
    return build_app(cfg, resolve_target_path(cfg.target, progress=False), source, api_key(cfg.serve))
