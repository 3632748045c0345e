"""Stop work for a client that went away: a handler's coroutine is cancelled when its client disconnects.

Streams notice a disconnect when a write fails; a non-streaming completion writes nothing until it is
done, so without this a client that hung up would keep its sequence running to the end.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from litestar import Request

from app.web.errors import ApiError

T = TypeVar("T")


class ClientDisconnectedError(ApiError):
    """The client closed the connection before the answer was ready (nobody reads this response)."""

    status = 499
    code = "client_closed_request"


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` in this task, cancelling it if the client disconnects first (the request body must be read).

    One watcher task per request, and ``work`` runs inline: no second task and no ``asyncio.wait`` on the path
    of every completion.
    """
    current = asyncio.current_task()
    assert current is not None, "cancel_on_disconnect runs inside a task"
    watcher = asyncio.ensure_future(_cancel_on_disconnect(request, current))
    try:
        return await work
    except asyncio.CancelledError:
        if not (watcher.done() and not watcher.cancelled()):
            raise  # cancelled for another reason: the server is stopping
        current.uncancel()
        raise ClientDisconnectedError("The client closed the connection before the answer was ready.") from None
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


async def _cancel_on_disconnect(request: Request, task: asyncio.Task) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    task.cancel()
