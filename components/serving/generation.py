"""One generation request over HTTP: admission first, the body checked, the first output awaited,
then an SSE stream or one JSON body.

Admission comes before the body is read or parsed, so a refusal for overload costs next to
nothing and answers at once whatever the burst (the key was checked before, by the app's
dependency). Running the request to its first output before answering makes an overload, a
dead engine or a bad request an HTTP status rather than a broken stream; an error after a stream
started goes out as an SSE ``data: {"error": ...}`` chunk, then ``[DONE]``. Streams carry, as
vLLM's: the role first (chat), the deltas, the finish chunk, with ``include_usage`` a last
chunk with the usage, and with ``continuous_usage_stats`` the usage so far on every chunk.

Knows Starlette's request and response types, the replica's generator and the response bodies;
nothing about routes or the engine.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from components.serving import responses as rs
from components.serving.protocol import APIError, GenerateParams, parse_json, parse_request
from components.serving.replica import Delta, Replica
from components.serving.responses import Outcome

log = logging.getLogger(__name__)


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


async def generate(replica: Replica, model: str, kind: str, request: Request, body_limit: int) -> Any:
    """``kind`` "completion" or "chat": the response to one generation request."""
    arrival = time.perf_counter()
    replica.admit()
    try:
        params = parse_request(kind, parse_json(await read_body(request, body_limit)), replica.served)
    except BaseException:
        replica.release()  # the generation, which releases at its end, never started
        raise
    rid, first, gen = await start(replica, params, arrival)
    if params.stream:
        return StreamingResponse(events(rid, model, params, first, gen), media_type="text/event-stream")
    try:
        return JSONResponse(await collect(rid, model, params, first, gen))
    finally:
        await gen.aclose()


async def start(replica: Replica, params: GenerateParams, arrival: float) -> tuple[str, Delta | Outcome, Any]:
    """Runs an admitted request to its first output: (response id, that output, the generator)."""
    rid = f"{'chatcmpl' if params.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    gen = replica.generate(params, arrival, rid)
    try:
        first = await gen.__anext__()
    except BaseException:
        await gen.aclose()
        raise
    return rid, first, gen


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
    prompt = len(params.prompt_ids)
    try:
        if params.kind == "chat":
            yield rs.sse(rs.chunk(rid, model, params, "", first=True, usage=rs.usage(prompt, 0)))
        item = first
        while not isinstance(item, Outcome):
            usage = rs.usage(prompt, item.completion_tokens)
            yield rs.sse(rs.chunk(rid, model, params, item.text, item.token_ids, usage=usage))
            item = await gen.__anext__()
        yield rs.sse(rs.chunk(rid, model, params, "", [], out=item, usage=item.usage()))
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
