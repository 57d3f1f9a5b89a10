"""RequestStream keeps at most the newest output plus one terminal item, whatever the reader."""

from __future__ import annotations

import asyncio

import pytest

from hybridllm.entrypoints.openai.async_engine import AsyncEngine, RequestStream
from hybridllm.entrypoints.openai.errors import EngineDeadError
from hybridllm.entrypoints.openai.serving_base import merge_streams
from hybridllm.outputs import CompletionOutput, RequestOutput
from hybridllm.sampling_params import SamplingParams
from tests.unit.scripted_engine import ScriptedEngine


def output(request_id: str, num_tokens: int, finished: bool = False) -> RequestOutput:
    tokens = list(range(num_tokens))
    sample = CompletionOutput(
        0, "x" * num_tokens, tokens, None, None, "length" if finished else None
    )
    return RequestOutput(request_id, None, [1], None, [sample], finished)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=20))


def test_unread_outputs_coalesce_to_the_newest_then_the_final():
    async def main():
        stream = RequestStream("r", AsyncEngine(ScriptedEngine()), 0.0)
        for i in range(1, 10_001):
            stream._put(output("r", i))
            assert stream.num_buffered <= 2
        stream._put(output("r", 10_001, finished=True))
        assert stream.num_buffered == 2
        seen = [o async for o in stream]
        assert [len(o.outputs[0].token_ids) for o in seen] == [10_000, 10_001]
        assert seen[-1].finished and stream.num_buffered == 0

    run(main())


def test_an_error_ends_the_stream_after_the_newest_output():
    async def main():
        stream = RequestStream("r", AsyncEngine(ScriptedEngine()), 0.0)
        for i in range(1, 100):
            stream._put(output("r", i))
        stream._put(EngineDeadError("gone"))
        stream._put(output("r", 500))  # nothing after a terminal item is kept
        stream._put(EngineDeadError("again"))
        assert stream.num_buffered == 2
        assert len((await stream.__anext__()).outputs[0].token_ids) == 99
        with pytest.raises(EngineDeadError, match="gone"):
            await stream.__anext__()
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()

    run(main())


def test_a_waiting_reader_wakes_for_each_output():
    async def main():
        stream = RequestStream("r", AsyncEngine(ScriptedEngine()), 0.0)
        got = []

        async def read():
            async for o in stream:
                got.append(len(o.outputs[0].token_ids))

        reader = asyncio.ensure_future(read())
        for i in range(1, 4):
            await asyncio.sleep(0.01)
            stream._put(output("r", i, finished=i == 3))
        await reader
        assert got == [1, 2, 3]

    run(main())


def test_a_slow_reader_of_a_fast_engine_gets_coalesced_deltas():
    engine = ScriptedEngine(step_delay=0.0005)

    async def main():
        ae = AsyncEngine(engine)
        ae.start()
        stream = await ae.add_request("r", [1], SamplingParams(max_tokens=400))
        seen, peak = [], 0
        async with stream:
            async for o in stream:
                seen.append(len(o.outputs[0].token_ids))
                await asyncio.sleep(0.02)  # a slow client; the engine keeps stepping
                peak = max(peak, stream.num_buffered)
        await ae.shutdown(timeout=1)
        return seen, peak

    seen, peak = run(main())
    assert seen[-1] == 400 and seen == sorted(seen)
    assert len(seen) < 200 and peak <= 2  # most outputs were merged into newer ones


def test_merge_streams_reads_only_as_fast_as_its_consumer():
    async def main():
        owner = AsyncEngine(ScriptedEngine())
        streams = [RequestStream(f"r{i}", owner, 0.0) for i in range(3)]
        merged = merge_streams(streams)
        for s in streams:
            s._put(output(s.request_id, 1))
        first = await merged.__anext__()
        # The consumer is idle: thousands more outputs stay coalesced in the streams.
        for n in range(2, 5_000):
            for s in streams:
                s._put(output(s.request_id, n))
        assert all(s.num_buffered <= 2 for s in streams)
        for s in streams:
            s._put(output(s.request_id, 5_000, finished=True))
            s.finished = True
        rest = [item async for item in merged]
        finals = {i: o for i, o in [first, *rest] if o.finished}
        assert sorted(finals) == [0, 1, 2]
        assert len(rest) <= 3 * 3  # per stream at most: the read pending, the newest, the final

    run(main())
