"""A blocking call awaited from the event loop on a daemon thread of its own, for calls that may never return
(Serve's deployment waits for resources without end): a caller that gives up leaves the thread behind, and
nothing at the interpreter's exit waits for it, as the event loop's default executor would."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def in_daemon_thread(call: Callable[..., T], *args: Any) -> T:
    """``call(*args)`` on a new daemon thread; its result or its exception once it ends."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

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

    threading.Thread(target=run, name=f"loraplex-{getattr(call, '__name__', 'call')}", daemon=True).start()
    return await done
