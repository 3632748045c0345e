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

from app.errors import ApiError

T = TypeVar("T")


class ClientDisconnectedError(ApiError):
    """The client closed the connection before the answer was ready (nobody reads this response)."""

    status = 499
    code = "client_closed_request"


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client disconnects first (the request body must be read)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    if task.cancelled():
        raise ClientDisconnectedError("The client closed the connection before the answer was ready.")
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
