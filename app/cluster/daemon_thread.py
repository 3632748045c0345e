"""Blocking calls awaited from the event loop on daemon threads, for the two kinds of call the default executor
serves badly.

- ``in_daemon_thread``: a call that may never return (Serve's deployment waits for resources without end) on
  a thread of its own; a caller that gives up leaves the thread behind, and nothing at the interpreter's exit
  waits for it, as it would for the default executor's threads.
- ``LastingThread``: calls whose effects last as long as the thread that made them, on one thread that ends
  only with the process. Linux ends a child process when the *thread* that started it ends, if the child
  asked for it (``PR_SET_PDEATHSIG``), and every process Ray starts asks for it: Ray started on a thread
  that then ends is killed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def _job(
    loop: asyncio.AbstractEventLoop, done: asyncio.Future[T], call: Callable[..., T], args: tuple
) -> Callable[[], None]:
    """``call(*args)`` whose result or exception settles ``done`` on ``loop`` (dropped if the caller gave up)."""

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result, error = call(*args), None
        except BaseException as raised:  # handed to the awaiting task, as asyncio.to_thread does
            result, error = None, raised
        with contextlib.suppress(RuntimeError):  # the loop has closed: no one waits any more
            loop.call_soon_threadsafe(settle, result, error)

    return run


async def in_daemon_thread(call: Callable[..., T], *args: Any) -> T:
    """``call(*args)`` on a new daemon thread; its result or its exception once it ends."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()
    name = f"loraplex-{getattr(call, '__name__', 'call')}"
    threading.Thread(target=_job(loop, done, call, args), name=name, daemon=True).start()
    return await done


class LastingThread:
    """One daemon thread, started on first use, that runs the calls given to it in turn until the process exits."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    async def run(self, call: Callable[..., T], *args: Any) -> T:
        """``call(*args)`` on this thread, after the calls given before it; its result or its exception."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                self._thread.start()
        self._jobs.put(_job(loop, done, call, args))
        return await done

    def _serve(self) -> None:
        while True:
            self._jobs.get()()
