"""Requests in, async token streams out: a ``BatchEngine`` driven by one background thread.

What a server replica (Ray Serve, an HTTP handler) holds::

    engine = AsyncEngine(BatchEngine(target, drafter))
    async for chunk in engine.stream(Request(prompt_ids, 64, stop_token_ids=(eos,))):
        send(chunk.new_tokens)              # one chunk per round: 1..γ+1 tokens
    # leaving the loop early (client gone, asyncio cancellation) cancels the request and frees
    # its cache rows at the next round

With ``stream_interval_s`` > 0 a stream hands out at most one chunk per interval: the first
output at once (time to first token is not delayed), then whatever rounds finished while the
interval ran, merged into one ``StepOutput`` (its ``rounds`` lists each round's token count).
That is Ray Serve LLM's stream batching and vLLM's ``stream_interval``: each chunk costs the
serving side (detokenizing, an SSE event, the hop from replica to HTTP proxy) CPU time that
shares the cores with the target's passes, so fewer, larger chunks leave more of them to
decoding. The tokens, and their order, are the same at any interval.

All calls into the ``BatchEngine`` happen on the engine thread (it is not thread-safe): adds
and cancels are queued as commands and applied between rounds, so requests join and leave the
running batch without stopping it. Each round's outputs are handed to the asyncio loop that
owns the request (``call_soon_threadsafe``). torch releases the GIL inside its kernels, so the
event loop stays responsive while a round runs.

If a round raises, every in-flight stream raises ``EngineError`` with the cause, and the engine
refuses new requests (its caches may be inconsistent): a replica should be restarted.
Knows the batch engine's ``add/cancel/step``; nothing about HTTP, tokenizers or Ray.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from components.engine.batch.continuous import BatchEngine
from components.engine.batch.state import Request, StepOutput
from components.engine.core import GenerationResult


class EngineError(RuntimeError):
    """The engine thread failed; the message carries the original error."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # StepOutput | EngineError items


def merged(a: StepOutput, b: StepOutput) -> StepOutput:
    """Two consecutive outputs of one request as one: ``b``'s end, both rounds' tokens."""
    rounds = (a.rounds or (len(a.new_tokens),)) + (b.rounds or (len(b.new_tokens),))
    return StepOutput(a.request_id, a.new_tokens + b.new_tokens, b.finished, b.finish_reason, b.result, rounds)


class AsyncEngine:
    """Continuous batching behind ``async stream(request)``; one engine thread per instance."""

    def __init__(self, engine: BatchEngine, idle_wait_s: float = 0.05, stream_interval_s: float = 0.0):
        if stream_interval_s < 0:
            raise ValueError(f"stream_interval_s must be >= 0, got {stream_interval_s}")
        self.engine = engine
        self.stream_interval_s = stream_interval_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # ("add", Request) | ("cancel", id)
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._failed: BaseException | None = None
        self._idle_wait_s = idle_wait_s
        self._thread = threading.Thread(target=self._run, name="specline-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller side (asyncio)
    async def stream(self, request: Request) -> AsyncIterator[StepOutput]:
        """Yields one ``StepOutput`` per round that produced tokens for ``request``; the last one
        has ``finished=True``. Closing the iterator early cancels the request."""
        if self._failed is not None or self._stop.is_set():
            raise EngineError(f"engine is not running: {self._failed or 'shut down'}")
        rid = request.request_id
        if rid in self._streams:
            raise ValueError(f"request id '{rid}' is already in flight")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[rid] = stream
        self._command("add", request)
        finished, sent = False, None  # loop time of the last chunk handed out
        try:
            while True:
                item = await stream.queue.get()
                if self.stream_interval_s > 0 and sent is not None:
                    item = await self._gather(stream, item, sent + self.stream_interval_s)
                if isinstance(item, EngineError):
                    raise item
                finished = item.finished
                sent = stream.loop.time()
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self._command("cancel", rid)

    @staticmethod
    async def _gather(stream: _Stream, item: StepOutput | EngineError, until: float) -> StepOutput | EngineError:
        """``item`` merged with every output that arrives before loop time ``until`` (or before
        the request finishes); an error ends the wait and is returned as it is."""
        while isinstance(item, StepOutput) and not item.finished:
            wait = until - stream.loop.time()
            try:
                nxt = stream.queue.get_nowait() if wait <= 0 else await asyncio.wait_for(stream.queue.get(), wait)
            except (TimeoutError, asyncio.QueueEmpty):
                return item
            item = nxt if isinstance(nxt, EngineError) else merged(item, nxt)
        return item

    async def generate(self, request: Request) -> GenerationResult:
        """The whole generation at once (drains ``stream``)."""
        result = None
        async for out in self.stream(request):
            result = out.result
        assert result is not None  # the finished output always carries it
        return result

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the engine thread after its current round."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------------ engine thread
    def _command(self, kind: str, arg: Any) -> None:
        self._commands.put((kind, arg))
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._apply_commands()  # inside the try: a failing add/cancel must not end the thread silently
                if not self.engine.has_work:
                    self._wake.wait(self._idle_wait_s)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
            except BaseException as exc:  # noqa: BLE001  (delivered to every caller, then stop)
                self._fail(exc)
                return
            for out in outputs:
                self._deliver(out.request_id, out)

    def _apply_commands(self) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self.engine.add(arg)
            else:
                self.engine.cancel(arg)

    def _deliver(self, rid: str, item: StepOutput | EngineError) -> None:
        stream = self._streams.get(rid)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _fail(self, exc: BaseException) -> None:
        self._failed = exc
        error = EngineError(f"engine round failed: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        for rid in list(self._streams):
            self._deliver(rid, error)
