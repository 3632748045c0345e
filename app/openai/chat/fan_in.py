"""Several engine requests' outputs as one stream, in the order they arrive (several prompts in one request).

Each request's stream is read by a task of its own into one queue; the merged stream yields
``(i, output)`` with ``i`` the position of the stream the output came from. The first failure of any
stream ends the merged one with that error, and leaving the merged stream (finished, failed or closed
early) cancels the readers, which closes their streams: the engine aborts what is still running.
A single request needs none of this and is read directly (app/openai/chat/runs.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

from engine import RequestOutput

_DONE = None  # what a reader puts on the queue when its stream has ended


async def fan_in(streams: Sequence[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def read(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async with contextlib.aclosing(stream):  # type: ignore[type-var]  # engine streams are async generators
                async for output in stream:
                    queue.put_nowait((i, output))
        except Exception as error:  # handed to the merged stream, which raises it
            queue.put_nowait((i, error))
        else:
            queue.put_nowait((i, _DONE))

    readers = [asyncio.create_task(read(i, stream)) for i, stream in enumerate(streams)]
    try:
        num_open = len(readers)
        while num_open:
            i, item = await queue.get()
            if item is _DONE:
                num_open -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
