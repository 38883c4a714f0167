"""Requests in, async token streams out: a ``BatchEngine`` driven by one background thread.

What a server replica (Ray Serve, an HTTP handler) holds::

    engine = AsyncEngine(BatchEngine(target, drafter))
    async for chunk in engine.stream(Request(prompt_ids, 64, stop_token_ids=(eos,))):
        send(chunk.new_tokens)              # one chunk per round (1..γ+1 tokens), or per stream interval
    # leaving the loop early (client gone, asyncio cancellation) cancels the request and frees
    # its cache rows at the next round

With ``stream_interval_s`` > 0 a stream hands out at most one chunk per interval: its first
output at once (time to first token is not delayed), later rounds' outputs held on the engine
thread and merged (``StepOutput.rounds`` lists each round's token count) until a round ends
with the interval past, or the request finishes, or the next round will prefill a waiting
request (a long round: what is held goes out before it). Held outputs cost the event loop
nothing: it is woken once per chunk, not once per round. That is Ray Serve LLM's stream
batching and vLLM's ``stream_interval``: each chunk costs the serving side (detokenizing, an
SSE event, the hop from replica to HTTP proxy) CPU time that shares the cores with the target's
passes, so fewer, larger chunks leave more of them to decoding. The tokens, and their order,
are the same at any interval.

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
import time
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
    # engine thread only: outputs held back by the stream interval, and when the last was sent
    held: StepOutput | None = None
    sent: float | None = None


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
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, EngineError):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self._command("cancel", rid)

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
                if self.engine.will_admit:  # a prefill round: what is held goes out before it
                    self._release_held()
                outputs = self.engine.step()
            except BaseException as exc:  # noqa: BLE001  (delivered to every caller, then stop)
                self._fail(exc)
                return
            now = time.perf_counter()
            for out in outputs:
                self._deliver(out.request_id, out, now)

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

    def _deliver(self, rid: str, out: StepOutput, now: float) -> None:
        """Hands ``out`` (merged with what was held) to the stream's loop, or holds it while the
        interval runs."""
        stream = self._streams.get(rid)
        if stream is None:
            return
        if stream.held is not None:
            out, stream.held = merged(stream.held, out), None
        if stream.sent is not None and now - stream.sent < self.stream_interval_s and not out.finished:
            stream.held = out
            return
        stream.sent = now
        self._send(stream, out)

    def _release_held(self) -> None:
        now = time.perf_counter()
        for stream in list(self._streams.values()):
            if stream.held is not None:
                held, stream.held, stream.sent = stream.held, None, now
                self._send(stream, held)

    @staticmethod
    def _send(stream: _Stream, item: StepOutput | EngineError) -> None:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _fail(self, exc: BaseException) -> None:
        self._failed = exc
        error = EngineError(f"engine round failed: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        for stream in list(self._streams.values()):
            self._send(stream, error)
