"""The SSE stream of ``/v1/responses``: OpenAI's typed events, numbered by ``sequence_number``.

``response.created`` and ``response.in_progress`` first. Without tools the answer is one message item whose
text streams as ``response.output_text.delta`` events as it is generated. With ``auto`` tools the text and the
calls stream as they are generated too (app/openai/responses/tool_stream.py). With a ``required`` or named
choice the output is one constrained JSON text that becomes calls only once whole, so each item is sent when
the answer ends: a message item's ``output_item.added``, ``content_part.added``, its text in one delta,
``output_text.done``, ``content_part.done``, ``output_item.done``; a ``function_call`` item's
``output_item.added`` (empty arguments), ``function_call_arguments.delta`` and ``.done``,
``output_item.done``. Last comes
``response.completed`` (or ``response.incomplete``) with the usage; a failure midway ends with
``response.failed``. ``on_finished`` runs (storing the response) before that last event is sent, so a client
that continues the conversation the moment it has the event finds it stored.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import msgspec

from app.openai.responses.items import OutputFunctionCall, OutputItem, OutputMessage, OutputText, output_message
from app.openai.responses.schemas import ResponseObject
from app.openai.responses.shape import ResponseShape, item_status, response_status
from app.openai.responses.tool_stream import ToolItemStream
from app.web.errors import ApiError
from engine import RequestOutput
from engine.errors import EngineDeadError, RequestError

Choices = AsyncIterator[tuple[int, RequestOutput]]
Finished = Callable[[ResponseObject], Awaitable[None]]


async def _chain(first: tuple[int, RequestOutput], outputs: Choices) -> Choices:
    yield first
    async for item in outputs:
        yield item


class _Events:
    def __init__(self) -> None:
        self._numbers = itertools.count()

    def __call__(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": next(self._numbers), **fields}
        return f"event: {kind}\ndata: {json.dumps(msgspec.to_builtins(data))}\n\n".encode()


async def response_events(
    shape: ResponseShape, first: tuple[int, RequestOutput], outputs: Choices, on_finished: Finished
) -> AsyncIterator[bytes]:
    event = _Events()
    plan = shape.reply.tool_plan
    live = plan is None  # without tools the text streams as it comes
    tool_items = (
        ToolItemStream(event, plan.tool_format, shape.message_id) if plan is not None and plan.is_auto else None
    )
    part = {"output_index": 0, "content_index": 0, "item_id": shape.message_id}
    started = shape.response([], None, "in_progress")
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    if live:
        opening = output_message(shape.message_id, "", "in_progress")
        yield event("response.output_item.added", output_index=0, item=opening)
        yield event("response.content_part.added", **part, part=OutputText(text=""))
    last: dict[int, RequestOutput] = {}
    try:
        async for index, output in _chain(first, outputs):
            last[index] = output
            if live and output.delta_text:
                yield event("response.output_text.delta", **part, delta=output.delta_text, logprobs=[])
            elif tool_items is not None:
                for data in tool_items.feed(output.delta_text):
                    yield data
    except (RequestError, EngineDeadError, ApiError) as error:
        failed = shape.response([], None, "failed")
        failed.error = {"code": "server_error", "message": str(error)}
        yield event("response.failed", response=failed)
        return
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]  # a client gone: abort the sequence, meter it now
    output = last[0]
    status = response_status(output)
    if tool_items is not None:
        for data in tool_items.finish(item_status(status)):
            yield data
        items = tool_items.items
    else:
        items = shape.output_items(output)
        for number, item in enumerate(items):
            for data in _item_events(event, number, item, opened=live):
                yield data
    final = shape.response(items, shape.usage(last), status)
    try:
        await on_finished(final)
    except ApiError as error:  # generated, but not stored as asked
        failed = shape.response(items, shape.usage(last), "failed")
        failed.error = {"code": error.code or "server_error", "message": error.message}
        yield event("response.failed", response=failed)
        return
    yield event("response.incomplete" if status == "incomplete" else "response.completed", response=final)


def _item_events(event: _Events, number: int, item: OutputItem, *, opened: bool) -> Iterator[bytes]:
    """The events that finish ``item`` (and, unless ``opened`` already, add it and send its content first)."""
    if isinstance(item, OutputMessage):
        yield from _message_events(event, number, item, opened=opened)
    else:
        yield from _call_events(event, number, item)


def _message_events(event: _Events, number: int, item: OutputMessage, *, opened: bool) -> Iterator[bytes]:
    text = item.content[0].text
    part = {"output_index": number, "content_index": 0, "item_id": item.id}
    if not opened:
        added = output_message(item.id, "", "in_progress")
        yield event("response.output_item.added", output_index=number, item=added)
        yield event("response.content_part.added", **part, part=OutputText(text=""))
        if text:
            yield event("response.output_text.delta", **part, delta=text, logprobs=[])
    yield event("response.output_text.done", **part, text=text, logprobs=[])
    yield event("response.content_part.done", **part, part=item.content[0])
    yield event("response.output_item.done", output_index=number, item=item)


def _call_events(event: _Events, number: int, item: OutputFunctionCall) -> Iterator[bytes]:
    added = OutputFunctionCall(id=item.id, call_id=item.call_id, name=item.name, arguments="", status="in_progress")
    where = {"output_index": number, "item_id": item.id}
    yield event("response.output_item.added", output_index=number, item=added)
    yield event("response.function_call_arguments.delta", **where, delta=item.arguments)
    yield event("response.function_call_arguments.done", **where, arguments=item.arguments)
    yield event("response.output_item.done", output_index=number, item=item)
