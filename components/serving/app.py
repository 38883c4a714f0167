"""The Ray Serve application: a FastAPI ingress over one ``Replica`` per Serve replica.

Routes (OpenAI-compatible, as vLLM's server names them)::

    POST /v1/completions        prompt (string or token ids) → text, streaming or not
    POST /v1/chat/completions   messages (the target's chat template) → text, streaming or not
    GET  /v1/models             the served model, its drafter (run id, version) and engine settings
    GET  /health                200 once warm; 503 while warming up or once the engine failed
    POST /tokenize, /detokenize vLLM's shapes ({"prompt"|"messages"} → tokens; {"tokens"} → prompt)
    GET  /metrics               this replica's metrics, Prometheus text (``telemetry.py``)

Bodies are parsed here, not by FastAPI's models, so every client mistake is a 400 (413 for a
body over ``serve.max_body_bytes``, 404 for another model, 401 without the API key) with an
OpenAI error body. An error after a stream started goes out as an SSE ``data: {"error": ...}``
chunk, then ``[DONE]``. ``build_app(cfg, target_path, source, api_key)`` gives the bound
deployment for ``serve.run``; ``deployment_options(sc)`` the Serve settings (replicas or
autoscaling, ``max_ongoing_requests`` / ``max_queued_requests``, backpressure status and
Retry-After, health checks, one GPU per replica on clusters).

Start-up, as Ray Serve sees it. The constructor loads the target and drafter and builds the
engine: what a configuration can make fail (a drafter for another target, a capability it
lacks) fails the replica's start, which Serve retries ``max_constructor_retry_count`` times and
``serve.run`` then reports. The warm-up (``Replica.warm_up``: the adaptive cap's round profile,
measured on a host's first start per setting, then one short generation) runs on a thread once
the constructor has returned, so Serve marks the replica running and routes to it: meanwhile
``/health`` is 503 ``{"status": "warming_up", "phase": ...}`` and ``/v1/*`` a 503 OpenAI error
with ``Retry-After`` (``/tokenize``, ``/detokenize`` and ``/metrics`` answer). ``check_health``
passes while warming up: Serve runs it once at the end of start-up and counts a failure there as
a failed start (the deployment fails for good after ``max_constructor_retry_count``), and replaces
a running replica after three failed periodic checks, so failing it would restart any warm-up
longer than three ``health_check_period_s``, for ever. It fails once the warm-up or an engine
round failed (``/health`` 503 ``"dead"`` with the error); Serve then replaces the replica. The
price of a background warm-up: to Serve a warming replica is up, so ``serve.run`` returns before
it is warm (poll ``/health``) and a scale-up or rolling update routes requests to a new replica
that answers them 503 + ``Retry-After`` until warm, rather than queueing them.

No ``from __future__ import annotations`` here: the deployment class is pickled by value, and
FastAPI must resolve its routes' ``Request`` annotations in the replica. Knows FastAPI, Ray
Serve and the serving components; nothing about the engine's internals.
"""

import hmac
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from components.config import ServeConfig, SpeclineConfig
from components.serving import responses as rs
from components.serving.protocol import (
    APIError,
    GenerateParams,
    Served,
    message_text,
    parse_json,
    parse_request,
)
from components.serving.provenance import DrafterSource
from components.serving.replica import Delta, Replica
from components.serving.responses import Outcome

log = logging.getLogger(__name__)
HEADROOM = 8  # Serve-level slots above the replica's own capacity: /health, /metrics, tokenize routes
ROUTER_QUEUE = 4  # Serve's router queue, in multiples of a replica's capacity
PROTECTED = ("/v1/", "/tokenize", "/detokenize")


def model_id(cfg: SpeclineConfig) -> str:
    """The served model id: ``serve.model_name``, else the target's name (last path part)."""
    return cfg.serve.model_name or Path(cfg.target.name_or_path.rstrip("/")).name


def served_for(target: Any, sc: ServeConfig, model: str) -> Served:
    gen = getattr(target.model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    ids = [*(eos if isinstance(eos, (list, tuple)) else [eos]), target.tokenizer.eos_token_id]
    positions = int(getattr(target.model.config, "max_position_embeddings", 0) or 1 << 30)
    return Served(model, target.tokenizer, target.vocab_size, min(sc.max_model_len or positions, positions),
                  tuple(dict.fromkeys(int(i) for i in ids if i is not None and i >= 0)))


def deployment_options(sc: ServeConfig) -> dict[str, Any]:
    """Ray Serve deployment settings from ``serve``."""
    opts: dict[str, Any] = {
        "max_ongoing_requests": sc.max_ongoing_requests + sc.max_queued_requests + HEADROOM,
        # Serve's own queue (requests not yet routed): an outer net with a plain-text body; the
        # replica answers overload itself, with an OpenAI body, long before this fills
        "max_queued_requests": ROUTER_QUEUE * (sc.max_ongoing_requests + sc.max_queued_requests),
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


# ----------------------------------------------------------------------------- request plumbing
async def read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 once it passes ``limit`` bytes (by Content-Length or as it streams in)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes is over the limit of {limit}", code="body_too_large")
    data = bytearray()
    async for part in request.stream():
        data += part
        if len(data) > limit:
            raise APIError(413, f"request body is over the limit of {limit} bytes", code="body_too_large")
    return bytes(data)


def check_key(request: Request, key: str | None) -> None:
    if key is None or not request.url.path.startswith(PROTECTED):
        return
    given = request.headers.get("authorization", "")
    token = given[7:] if given.lower().startswith("bearer ") else ""
    if not hmac.compare_digest(token.encode(), key.encode()):
        raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")


async def collect(rid: str, model: str, params: GenerateParams, first: Delta | Outcome,
                  gen: AsyncIterator[Delta | Outcome]) -> dict[str, Any]:
    """The non-streaming body: every delta, then the outcome."""
    item = first
    while not isinstance(item, Outcome):
        item = await gen.__anext__()
    return rs.full_response(rid, model, params, item)


async def events(rid: str, model: str, params: GenerateParams, first: Delta | Outcome,
                 gen: AsyncIterator[Delta | Outcome]) -> AsyncIterator[str]:
    """SSE chunks: (chat: the role first) deltas, the finish chunk, the usage chunk, [DONE]."""
    try:
        if params.kind == "chat":
            yield rs.sse(rs.chunk(rid, model, params, "", first=True))
        item = first
        while not isinstance(item, Outcome):
            yield rs.sse(rs.chunk(rid, model, params, item.text, item.token_ids))
            item = await gen.__anext__()
        yield rs.sse(rs.chunk(rid, model, params, "", [], out=item))
        if params.include_usage:
            yield rs.sse(rs.usage_chunk(rid, model, params, item))
    except APIError as err:  # the stream has started: the error is the next chunk
        yield rs.sse(err.body())
    except Exception as err:
        log.exception("stream %s failed", rid)
        yield rs.sse(APIError(500, f"internal error: {type(err).__name__}: {err}").body())
    finally:
        await gen.aclose()
    yield rs.DONE


async def start(replica: Replica, params: GenerateParams, arrival: float) -> tuple[str, Delta | Outcome, Any]:
    """Admits the request and runs it to its first output (so an overload or dead engine is an
    HTTP status, not a broken stream)."""
    rid = f"{'chatcmpl' if params.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    replica.admit()
    gen = replica.generate(params, arrival, rid)
    try:
        first = await gen.__anext__()
    except BaseException:
        await gen.aclose()
        raise
    return rid, first, gen


# ----------------------------------------------------------------------------- the deployment
async def respond(replica: Replica, model: str, params: Any, arrival: float) -> Any:
    """A checked generation request's response: an SSE stream, or one JSON body."""
    rid, first, gen = await start(replica, params, arrival)
    if params.stream:
        return StreamingResponse(events(rid, model, params, first, gen), media_type="text/event-stream")
    try:
        return JSONResponse(await collect(rid, model, params, first, gen))
    finally:
        await gen.aclose()


def build_replica(cfg: SpeclineConfig, target_path: str, source: DrafterSource, model: str) -> Replica:
    """One replica's engine parts (target, guarded drafter, batch engine) behind a ``Replica``,
    not yet warm (``warm_up_steps``, ``Replica.warm_up``)."""
    from components.serving.parts import build_parts
    from components.serving.telemetry import ServingMetrics

    sc = cfg.serve
    parts = build_parts(cfg.target, sc, target_path, source, adapt_now=False)
    replica = Replica(parts, served_for(parts.target, sc, model), sc.max_queued_requests, sc.sampled_rule,
                      sc.overload_status, sc.retry_after_s, source.label if source.path else None,
                      ServingMetrics(model, export_to_ray=True))
    log.info("replica loaded in %.1f s: %s, drafter %s; warming up", parts.startup_seconds, model, source.label)
    return replica


def warm_up_steps(replica: Replica, sc: ServeConfig) -> list[tuple[str, Callable[[], None]]]:
    """The warm-up's own steps before the warm-up generation: the adaptive cap's round profile."""
    from components.serving.parts import adapt

    if not sc.adaptive or replica.parts.drafter is None:
        return []
    return [("round profile", lambda: adapt(replica.parts, sc))]


class ServerRoutes:
    """One replica: a target + drafter engine and what it answers on each route. The Serve
    class of ``make_server_class`` only binds these methods to FastAPI paths."""

    def __init__(self, cfg: SpeclineConfig, target_path: str, source: DrafterSource, api_key: str | None):
        self.model, self.source, self.api_key, self.sc = model_id(cfg), source, api_key, cfg.serve
        self.replica = build_replica(cfg, target_path, source, self.model)
        threading.Thread(target=self.warm_up, name="specline-warm-up", daemon=True).start()

    def warm_up(self) -> None:
        """On the warm-up thread (module docstring)."""
        self.replica.warm_up(warm_up_steps(self.replica, self.sc))

    def check_health(self) -> None:
        self.replica.check_health()

    async def body(self, request: Request) -> Any:
        """The request's JSON body, once its API key checks out."""
        check_key(request, self.api_key)
        return parse_json(await read_body(request, self.sc.max_body_bytes))

    async def generate(self, kind: str, request: Request) -> Any:
        """/v1/completions (``kind`` "completion") and /v1/chat/completions ("chat")."""
        arrival = time.perf_counter()
        body = await self.body(request)
        self.replica.check_ready()
        params = parse_request(kind, body, self.replica.served)
        return await respond(self.replica, self.model, params, arrival)

    def models(self, request: Request) -> Any:
        check_key(request, self.api_key)
        self.replica.check_ready()
        return JSONResponse(model_card(self.model, self.source, self.replica))

    def health(self) -> Any:
        return JSONResponse(self.replica.status(), status_code=200 if self.replica.healthy else 503)

    def metrics(self) -> Any:
        self.replica.poll_metrics()
        return PlainTextResponse(self.replica.metrics.render(), media_type="text/plain; version=0.0.4")


def make_server_class() -> type:
    """The FastAPI app and the Serve deployment class, made on call (no import-time app)."""
    from ray import serve

    api = new_api()

    @serve.ingress(api)
    class SpeclineServer(ServerRoutes):
        @api.post("/v1/completions")
        async def completions(self, request: Request) -> Any:
            return await self.generate("completion", request)

        @api.post("/v1/chat/completions")
        async def chat(self, request: Request) -> Any:
            return await self.generate("chat", request)

        @api.get("/v1/models")
        async def list_models(self, request: Request) -> Any:
            return self.models(request)

        @api.get("/health")
        async def get_health(self) -> Any:
            return self.health()

        @api.post("/tokenize")
        async def tokenize(self, request: Request) -> Any:
            return JSONResponse(tokenize_body(self.replica, await self.body(request)))

        @api.post("/detokenize")
        async def detokenize(self, request: Request) -> Any:
            return JSONResponse(detokenize_body(self.replica, await self.body(request)))

        @api.get("/metrics")
        async def get_metrics(self) -> Any:
            return self.metrics()

    return SpeclineServer


def new_api() -> Any:
    """A FastAPI app whose errors are OpenAI bodies: ``APIError`` → its status; anything else →
    a logged 500 with the same shape."""
    from fastapi import FastAPI

    api = FastAPI(title="specline", docs_url=None, redoc_url=None)

    @api.exception_handler(APIError)
    async def _api_error(_request: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @api.exception_handler(Exception)
    async def _unexpected(_request: Request, err: Exception) -> JSONResponse:
        log.exception("unexpected server error")
        return JSONResponse(APIError(500, f"internal error: {type(err).__name__}: {err}").body(), status_code=500)

    return api


def build_app(cfg: SpeclineConfig, target_path: str, source: DrafterSource, api_key: str | None) -> Any:
    """The bound Serve application (``serve.run(build_app(...), name=..., route_prefix="/")``)."""
    from ray import serve

    server = serve.deployment(make_server_class(), name="SpeclineServer", **deployment_options(cfg.serve))
    return server.bind(cfg, target_path, source, api_key)


# ----------------------------------------------------------------------------- small bodies
def model_card(model: str, source: DrafterSource, replica: Replica) -> dict[str, Any]:
    drafter = None
    if source.path is not None and replica.parts.drafter is not None:
        cfg = replica.parts.drafter.cfg
        drafter = {"id": source.label, "family": cfg.name, "run_id": source.run_id, "version": source.version,
                   "origin": source.origin}
    return {"object": "list", "data": [{
        "id": model, "object": "model", "created": int(time.time()), "owned_by": "specline",
        "max_model_len": replica.served.max_model_len,
        "specline": {"drafter": drafter, "engine": replica.parts.settings}}]}


def tokenize_body(replica: Replica, body: dict[str, Any]) -> dict[str, Any]:
    if ("prompt" in body) == ("messages" in body):
        raise APIError(400, "give exactly one of 'prompt' (a string) or 'messages'", param="prompt")
    special = body.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise APIError(400, "'add_special_tokens' must be a boolean", param="add_special_tokens")
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise APIError(400, "'prompt' must be a string", param="prompt")
        tokens = replica.tokenize(body["prompt"], add_special_tokens=special)
    else:
        msgs = body["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise APIError(400, "'messages' must be a non-empty list of messages", param="messages")
        tokens = replica.tokenize(messages=[message_text(m, i) for i, m in enumerate(msgs)])
    return {"count": len(tokens), "max_model_len": replica.served.max_model_len, "tokens": tokens}


def detokenize_body(replica: Replica, body: dict[str, Any]) -> dict[str, Any]:
    tokens = body.get("tokens")
    vocab = replica.served.vocab_size
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                               for t in tokens):
        raise APIError(400, f"'tokens' must be a list of token ids in [0, {vocab})", param="tokens")
    return {"prompt": replica.detokenize(tokens)}
