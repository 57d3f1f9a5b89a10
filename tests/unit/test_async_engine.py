"""AsyncEngine over a scripted engine: thread confinement, streaming, abort, death, shutdown."""

from __future__ import annotations

import asyncio
import threading

import pytest

from hybridllm.entrypoints.openai.async_engine import AsyncEngine
from hybridllm.entrypoints.openai.errors import EngineDeadError
from hybridllm.sampling_params import SamplingParams
from tests.unit.scripted_engine import ScriptedEngine
from tests.waiting import wait_until_async


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=20))


async def _started(engine: ScriptedEngine) -> AsyncEngine:
    async_engine = AsyncEngine(engine)
    async_engine.start()
    return async_engine


def test_generate_streams_cumulative_outputs_on_one_thread():
    engine = ScriptedEngine()

    async def main():
        ae = await _started(engine)
        outs = [o async for o in ae.generate("r1", [5, 6], SamplingParams(max_tokens=4))]
        assert outs[-1].finished and outs[-1].outputs[0].token_ids == [1, 2, 3, 4]
        assert all(not o.finished for o in outs[:-1])
        assert await ae.embed([[1, 2, 3]]) == [[3.0, 0.0]]
        assert (await ae.get_stats()).num_running == 0
        await ae.shutdown(timeout=1)
        assert ae.metrics.finished("length") == 1
        return ae

    ae = run(main())
    assert engine.shut_down and not ae.is_healthy
    # Every engine call came from the single engine thread, never the event loop's.
    assert len(engine.calling_threads) == 1
    assert threading.get_ident() not in engine.calling_threads


def test_bad_request_fails_alone_and_engine_lives_on():
    engine = ScriptedEngine()

    async def main():
        ae = await _started(engine)
        with pytest.raises(ValueError, match="empty"):
            await ae.add_request("bad", [], SamplingParams(max_tokens=2))
        outs = [o async for o in ae.generate("good", [1], SamplingParams(max_tokens=2))]
        assert outs[-1].outputs[0].token_ids == [1, 2]
        assert ae.is_healthy
        await ae.shutdown(timeout=1)

    run(main())


def test_cancelled_consumer_aborts_its_request():
    engine = ScriptedEngine(step_delay=0.01)

    async def main():
        ae = await _started(engine)

        received = []

        async def consume():
            async for output in ae.generate("slow", [1], SamplingParams(max_tokens=10_000)):
                received.append(output)

        task = asyncio.ensure_future(consume())
        await wait_until_async(lambda: received, 10, "the consumer got no output")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until_async(lambda: engine.aborted, 10, "the cancelled request was not aborted")
        assert engine.aborted == ["slow"]
        assert ae.metrics.finished("abort") == 1
        assert ae.num_in_flight == 0
        # Breaking out of the iterator early aborts too.
        async for _ in ae.generate("brk", [1], SamplingParams(max_tokens=10_000)):
            break
        await wait_until_async(
            lambda: "brk" in engine.aborted, 10, "the abandoned request was not aborted"
        )
        await ae.shutdown(timeout=1)

    run(main())


def test_idle_engine_thread_does_not_spin():
    engine = ScriptedEngine()

    async def main():
        ae = await _started(engine)
        # A fixed sleep on purpose: what is tested is that nothing happens in this time.
        await asyncio.sleep(0.3)
        assert engine.num_steps == 0  # no work: blocked on the command queue
        await ae.shutdown(timeout=1)

    run(main())


def test_step_exception_fails_in_flight_requests_and_marks_engine_dead():
    engine = ScriptedEngine(fail_at_step=3)

    async def main():
        ae = await _started(engine)
        with pytest.raises(EngineDeadError, match="simulated worker crash"):
            async for _ in ae.generate("r", [1], SamplingParams(max_tokens=100)):
                pass
        assert not ae.is_healthy
        with pytest.raises(EngineDeadError):
            await ae.add_request("late", [1], SamplingParams(max_tokens=2))
        with pytest.raises(EngineDeadError):
            await ae.embed([[1]])
        await ae.shutdown(timeout=1)

    run(main())
    assert engine.shut_down


def test_shutdown_aborts_requests_that_outlive_the_timeout():
    engine = ScriptedEngine(step_delay=0.01)

    async def main():
        ae = await _started(engine)
        stream = await ae.add_request("long", [1], SamplingParams(max_tokens=100_000))
        await wait_until_async(lambda: engine.num_steps, 10, "the request never ran")
        await ae.shutdown(timeout=0.1)
        with pytest.raises(EngineDeadError, match="shutting down"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await ae.add_request("after", [1], SamplingParams(max_tokens=2))

    run(main())
    assert engine.shut_down and "long" in engine.aborted


def test_launch_builds_the_engine_on_the_thread_that_runs_it():
    built_on = []

    def build():
        built_on.append(threading.get_ident())
        return ScriptedEngine()

    ae = AsyncEngine.launch(build)
    engine = ae.engine

    async def main():
        ae.start()
        outs = [o async for o in ae.generate("r", [1], SamplingParams(max_tokens=3))]
        assert outs[-1].outputs[0].token_ids == [1, 2, 3]
        await ae.shutdown(timeout=1)

    run(main())
    assert engine.shut_down
    # loading and every later engine call on one thread (torch's OpenMP pool is per thread)
    assert engine.calling_threads == set(built_on)
    assert threading.get_ident() not in built_on


def test_launch_raises_what_building_raised():
    def build():
        raise FileNotFoundError("model path /nope does not exist")

    with pytest.raises(FileNotFoundError, match="/nope"):
        AsyncEngine.launch(build)
