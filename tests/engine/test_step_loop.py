"""The step loop both drivers share: a loop that ends (a death or a stop) answers every caller, queued or later."""

import asyncio
import threading
from pathlib import Path

import pytest

from engine import RequestOutput, SamplingParams
from engine.drivers.async_engine import AsyncEngine
from engine.drivers.worker import EngineWorker
from engine.drivers.worker_protocol import StepOutputs, Submit, from_wire
from engine.errors import EngineDeadError
from tests.engine.conftest import make_engine

WAIT_S = 10.0
QUEUE_SETTLE_S = 0.2  # for coroutines started on the event loop to put their commands in the inbox


def _step_that_dies_when_released(engine, release: threading.Event, entered: threading.Event) -> None:
    def step() -> list[RequestOutput]:
        entered.set()
        release.wait(WAIT_S)
        raise RuntimeError("a fault in the step")

    engine.step = step


def test_a_dead_async_loop_answers_what_was_queued_and_what_comes_after(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    entered, release = threading.Event(), threading.Event()
    _step_that_dies_when_released(engine, release, entered)
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    async def consume(async_engine: AsyncEngine, prompt: list[int]) -> list[RequestOutput]:
        return [output async for output in async_engine.generate(prompt, params)]

    async def main() -> tuple[list[object], list[object], bool]:
        async_engine = AsyncEngine(engine)
        async_engine.start()
        running = asyncio.ensure_future(consume(async_engine, [5, 6, 7]))
        assert await asyncio.to_thread(entered.wait, WAIT_S)
        queued = [
            asyncio.ensure_future(consume(async_engine, [5, 6])),
            asyncio.ensure_future(async_engine.call(lambda e: e.stats())),
        ]
        await asyncio.sleep(QUEUE_SETTLE_S)  # both wait in the inbox of a step that is about to die
        release.set()
        answered = await asyncio.wait_for(asyncio.gather(running, *queued, return_exceptions=True), WAIT_S)
        later = await asyncio.wait_for(
            asyncio.gather(
                consume(async_engine, [7, 8]), async_engine.call(lambda e: e.stats()), return_exceptions=True
            ),
            WAIT_S,
        )
        running_after = async_engine.is_running
        await async_engine.stop()
        return answered, later, running_after

    answered, later, running_after = asyncio.run(main())
    for result in (*answered, *later):
        assert isinstance(result, EngineDeadError) and "a fault in the step" in str(result), result
    assert not running_after


def test_a_dead_worker_refuses_queued_and_later_requests(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    entered, release = threading.Event(), threading.Event()
    _step_that_dies_when_released(engine, release, entered)
    refused: dict[str, BaseException] = {}
    all_refused = threading.Event()

    def emit(step: StepOutputs) -> None:
        for rejected in step.rejected:
            refused[rejected.request_id] = from_wire(rejected.error)
        if len(refused) == 2:
            all_refused.set()

    worker = EngineWorker(engine, emit)
    worker.start()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    worker.submit(Submit("running", [5, 6, 7], params, None, None, 1.0))
    assert entered.wait(WAIT_S)
    worker.submit(Submit("queued", [5, 6], params, None, None, 1.0))
    queued_call = worker.stats()
    release.set()
    with pytest.raises(EngineDeadError, match="a fault in the step"):
        queued_call.result(WAIT_S)
    worker.submit(Submit("later", [7, 8], params, None, None, 1.0))
    assert all_refused.wait(WAIT_S), refused
    assert all(isinstance(error, EngineDeadError) for error in refused.values()) and set(refused) == {"queued", "later"}
    worker.stop()


def test_a_stopped_worker_fails_calls_instead_of_queueing_them_forever(tiny_llama: Path) -> None:
    worker = EngineWorker(make_engine(tiny_llama), lambda _: None)
    worker.start().result(WAIT_S)
    assert worker.stats().result(WAIT_S).num_running == 0
    worker.stop()
    with pytest.raises(EngineDeadError, match="stopped"):
        worker.stats().result(WAIT_S)
