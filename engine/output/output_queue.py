"""One request's outputs on their way from the step loop to the coroutine that reads them."""

import asyncio
import contextlib
from collections.abc import AsyncIterator

from engine.errors import RequestFailedError
from engine.output.outputs import RequestOutput


class OutputQueue:
    """Outputs (or the error that ends them) for one request, read on ``loop``; put from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False
        """The last output was read (or the request failed in the engine): leaving needs no abort."""

    def put(self, item: RequestOutput | BaseException) -> bool:
        """Hand ``item`` to the reader: now on its running loop, else soon; False if its event loop is closed."""
        with contextlib.suppress(RuntimeError):
            if asyncio.get_running_loop() is self.loop:
                self.queue.put_nowait(item)
                return True
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: its server stopped without aborting this request
            return False
        return True

    async def outputs(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Yield the outputs until the request's last; raise the error put instead of an output.

        A request the engine failed on (an output with ``error``) raises RequestFailedError.
        """
        while True:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            self.finished = item.request_finished
            if item.error is not None:
                raise RequestFailedError(f"the engine failed while running request {request_id}: {item.error}")
            yield item
            if self.finished:
                return
