"""The async front of the batch engine: concurrent streams get the target's own greedy tokens in
round-sized chunks (with a stream interval: fewer chunks, the same tokens); leaving a stream early
cancels its request and frees its rows; a failing round surfaces as ``EngineError`` in every
in-flight stream, also one waiting out its interval."""

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


def _chunks(engine: AsyncEngine, req: Request) -> list:
    async def main():
        return [out async for out in engine.stream(req)]

    return asyncio.run(main())


def test_a_stream_interval_merges_rounds_into_fewer_chunks_losslessly(tiny_target):
    """An interval longer than the generation: the first round at once, every later round in one
    chunk that ends with the request; its ``rounds`` are the rounds an unmerged stream hands out."""
    req = requests(tiny_target)[0]
    outs = {}
    for interval in (0.0, 3600.0):
        engine = AsyncEngine(BatchEngine(tiny_target, random_drafter(tiny_target, "dspark"), max_batch_size=4),
                             stream_interval_s=interval)
        try:
            outs[interval] = _chunks(engine, Request(req.prompt_ids, req.max_new_tokens, request_id=f"r{interval}"))
        finally:
            engine.shutdown()
    each, merged = outs[0.0], outs[3600.0]
    assert len(each) > 2 and len(merged) == 2 and merged[-1].finished
    assert [t for o in merged for t in o.new_tokens] == [t for o in each for t in o.new_tokens]
    assert merged[0].new_tokens == each[0].new_tokens and merged[0].rounds == ()
    assert merged[1].rounds == tuple(len(o.new_tokens) for o in each[1:])
    assert merged[1].result.tokens == each[-1].result.tokens


def test_held_outputs_go_out_before_a_prefill_round(tiny_target):
    """A request that joins makes the next round a prefill (a long round): what a running stream
    holds for its interval is handed out before it, not after."""
    engine = AsyncEngine(BatchEngine(tiny_target, None, max_batch_size=4), stream_interval_s=3600.0)
    prompts = [r.prompt_ids for r in requests(tiny_target)]

    async def main():
        first = Request(prompts[0], 300, request_id="long")
        chunks = []
        async for out in engine.stream(first):
            chunks.append(out)
            if len(chunks) == 1:
                while engine._streams["long"].held is None:  # a round is held back
                    await asyncio.sleep(0.001)
                joiner = asyncio.ensure_future(engine.generate(Request(prompts[1], 3, request_id="joins")))
            elif len(chunks) == 2:
                assert not out.finished and out.rounds  # released by the joiner's prefill, mid-request
        await joiner
        return chunks

    try:
        chunks = asyncio.run(asyncio.wait_for(main(), timeout=120))
    finally:
        engine.shutdown()
    assert chunks[-1].finished and sum(len(c.new_tokens) for c in chunks) == 300


def test_an_engine_failure_ends_an_intervals_wait(tiny_target):
    engine = AsyncEngine(BatchEngine(tiny_target, random_drafter(tiny_target, "dspark"), max_batch_size=4),
                         stream_interval_s=3600.0)

    def broken_forward(*args, **kwargs):
        raise RuntimeError("device lost")

    async def main():
        with pytest.raises(EngineError, match="device lost"):
            async for _ in engine.stream(Request(requests(tiny_target)[0].prompt_ids, 50)):
                engine.engine.target = type("Broken", (), {"forward": staticmethod(broken_forward),
                                                          "device": tiny_target.device})()

    try:
        asyncio.run(asyncio.wait_for(main(), timeout=60))  # not the interval's hour
    finally:
        engine.shutdown()


def test_a_negative_stream_interval_is_refused(tiny_target):
    with pytest.raises(ValueError, match="stream_interval_s"):
        AsyncEngine(BatchEngine(tiny_target, None), stream_interval_s=-1)
