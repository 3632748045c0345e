"""in_daemon_thread: a blocking call's result or exception awaited from the loop; a caller that gives up
leaves a daemon thread that ends on its own and settles nothing. LastingThread: calls in turn on one daemon
thread that is still there after them."""

from __future__ import annotations

import asyncio
import threading

import pytest

from app.cluster.daemon_thread import LastingThread, in_daemon_thread


def _fail() -> None:
    raise ValueError("no replica fits")


def test_the_result_and_the_exception_reach_the_caller_from_a_daemon_thread() -> None:
    def where() -> tuple[str, bool]:
        thread = threading.current_thread()
        return thread.name, thread.daemon

    async def run() -> tuple[str, bool]:
        with pytest.raises(ValueError, match="no replica fits"):
            await in_daemon_thread(_fail)
        return await in_daemon_thread(where)

    name, daemon = asyncio.run(run())
    assert name == "loraplex-where" and daemon


def test_a_caller_that_gives_up_leaves_the_call_running_and_is_not_disturbed_by_its_end() -> None:
    release, ended = threading.Event(), threading.Event()

    def blocked() -> str:
        release.wait(timeout=10)
        ended.set()
        return "late"

    errors: list[dict] = []

    async def run() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        task = asyncio.ensure_future(in_daemon_thread(blocked))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        assert await asyncio.to_thread(ended.wait, 10)
        await asyncio.sleep(0.05)  # the late result reaches a cancelled future: it must be dropped

    asyncio.run(run())
    assert not errors, errors


def test_a_lasting_thread_runs_every_call_on_one_daemon_thread_that_outlives_them() -> None:
    lasting = LastingThread("loraplex-test-lasting")
    order: list[int] = []

    def record(value: int) -> threading.Thread:
        order.append(value)
        return threading.current_thread()

    async def run() -> list[threading.Thread]:
        with pytest.raises(ValueError, match="no replica fits"):
            await lasting.run(_fail)
        return list(await asyncio.gather(*(lasting.run(record, value) for value in range(5))))

    threads = asyncio.run(run())
    assert order == list(range(5))  # in the order given
    assert {thread.ident for thread in threads} == {threads[0].ident}
    assert threads[0].name == "loraplex-test-lasting" and threads[0].daemon
    assert threads[0].is_alive()  # after its calls, and after the event loop that awaited them closed
