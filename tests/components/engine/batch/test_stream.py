"""The async front of the batch engine: concurrent streams get the target's own greedy tokens in
round-sized chunks; leaving a stream early cancels its request and frees its rows; a failing
round surfaces as ``EngineError`` in every in-flight stream."""

from __future__ import annotations

import asyncio

import pytest

from components.engine.batch import BatchEngine, Request
from components.engine.batch.stream import AsyncEngine, EngineError
from tests.components.engine.batch.test_continuous import requests
from tests.components.engine.test_engine_greedy import random_drafter


@pytest.fixture
def async_engine(tiny_target):
    engine = AsyncEngine(BatchEngine(tiny_target, random_drafter(tiny_target, "dspark"), max_batch_size=4))
    yield engine
    engine.shutdown()


def test_concurrent_streams_are_lossless(tiny_target, greedy_refs, async_engine):
    async def consume(req: Request) -> tuple[list[int], int]:
        tokens, chunks = [], 0
        async for out in async_engine.stream(req):
            tokens += out.new_tokens
            chunks += 1
        assert out.finished and out.result.tokens == tokens
        return tokens, chunks

    async def main():
        return await asyncio.gather(*(consume(r) for r in requests(tiny_target)))

    results = asyncio.run(main())
    assert [tokens for tokens, _ in results] == greedy_refs
    assert all(chunks >= 1 for _, chunks in results)
    assert async_engine.in_flight == 0


def test_leaving_a_stream_cancels_the_request(tiny_target, async_engine):
    async def main():
        req = Request(requests(tiny_target)[0].prompt_ids, 200)
        async for _ in async_engine.stream(req):
            break  # client gone after the first chunk
        for _ in range(200):  # the engine thread drops it at its next round
            if not async_engine.engine.has_work:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the cancelled request is still running")

    asyncio.run(main())
    assert async_engine.engine.batch.cache is None


def test_failing_round_reaches_every_stream(tiny_target, async_engine):
    def broken_forward(*args, **kwargs):
        raise RuntimeError("device lost")

    async def main():
        prompt = requests(tiny_target)[0].prompt_ids
        with pytest.raises(EngineError, match="device lost"):
            async for _ in async_engine.stream(Request(prompt, 50)):
                async_engine.engine.target = type("Broken", (), {"forward": staticmethod(broken_forward),
                                                                "device": tiny_target.device})()
        with pytest.raises(EngineError, match="not running"):
            async for _ in async_engine.stream(Request(prompt, 5)):
                pass

    asyncio.run(main())


def test_a_failing_admission_fails_the_streams_instead_of_hanging_them(tiny_target, async_engine):
    def broken_add(request: Request) -> str:
        raise RuntimeError("queue corrupted")

    async_engine.engine.add = broken_add  # the engine thread's next command fails

    async def main():
        prompt = requests(tiny_target)[0].prompt_ids
        with pytest.raises(EngineError, match="queue corrupted"):
            async for _ in async_engine.stream(Request(prompt, 5)):
                pass

    asyncio.run(asyncio.wait_for(main(), timeout=30))  # before the fix: the stream waited for ever
