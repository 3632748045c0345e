"""The output items of a Responses stream whose model may call tools (``auto``), sent as they are generated.

The text is read with the tool-call format's streaming parser: text outside calls opens a ``message`` item
(``output_item.added``, ``content_part.added``) and streams as ``output_text.delta``; a call that opens
closes the message item and opens a ``function_call`` item (``output_item.added`` with its name and empty
arguments); its arguments stream as ``function_call_arguments.delta`` as the model writes them; when the
call closes, ``function_call_arguments.done`` and ``output_item.done``. Whitespace between or after calls
is not a message. A call still open when the answer ends (cut by ``max_output_tokens``) is closed with
status ``incomplete``: its arguments are not a whole call and must not be run.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from app.openai.responses.items import OutputFunctionCall, OutputItem, OutputText, output_message
from app.tool_calls import CallArguments, CallStarted, StreamingParser, TextPart, ToolCallFormat
from app.tool_calls.streaming import CallEnded

Event = Callable[..., bytes]


@dataclass(slots=True)
class _OpenMessage:
    item_id: str
    number: int
    text: str = ""


@dataclass(slots=True)
class _OpenCall:
    item_id: str
    call_id: str
    number: int
    name: str
    arguments: list[str] = field(default_factory=list)


class ToolItemStream:
    """One answer's items, event by event, as its text arrives."""

    def __init__(self, event: Event, tool_format: ToolCallFormat, first_message_id: str) -> None:
        self._event = event
        self._parser = StreamingParser(tool_format)
        self._first_message_id = first_message_id
        self._message: _OpenMessage | None = None
        self._call: _OpenCall | None = None
        self.items: list[OutputItem] = []

    def feed(self, text: str) -> Iterator[bytes]:
        for parsed in self._parser.feed(text):
            yield from self._on(parsed)

    def finish(self, message_status: str) -> Iterator[bytes]:
        """What the parser still held, then every open item closed (an open call as ``incomplete``)."""
        for parsed in self._parser.finish():
            yield from self._on(parsed)
        yield from self._close_message(message_status)
        if self._call is not None:
            yield from self._close_call(self._call, "".join(self._call.arguments), "incomplete")
        if not self.items:  # an empty answer is still one (empty) message, as without tools
            yield from self._open_message()
            yield from self._close_message(message_status)

    def _on(self, parsed: Any) -> Iterator[bytes]:
        if isinstance(parsed, TextPart):
            if self._message is None and not parsed.text.strip():
                return
            if self._message is None:
                yield from self._open_message()
            message = self._message or _OpenMessage("", 0)  # opened just above
            message.text += parsed.text
            where = {"output_index": message.number, "content_index": 0, "item_id": message.item_id}
            yield self._event("response.output_text.delta", **where, delta=parsed.text, logprobs=[])
        elif isinstance(parsed, CallStarted):
            yield from self._close_message("completed")
            item_id, call_id = f"fc_{secrets.token_hex(12)}", f"call_{secrets.token_hex(12)}"
            call = self._call = _OpenCall(item_id, call_id, self._next_number(), parsed.name)
            added = OutputFunctionCall(call.item_id, call.call_id, call.name, "", "in_progress")
            yield self._event("response.output_item.added", output_index=call.number, item=added)
        elif isinstance(parsed, CallArguments) and self._call is not None:
            self._call.arguments.append(parsed.fragment)
            where = {"output_index": self._call.number, "item_id": self._call.item_id}
            yield self._event("response.function_call_arguments.delta", **where, delta=parsed.fragment)
        elif isinstance(parsed, CallEnded) and self._call is not None:
            yield from self._close_call(self._call, parsed.arguments, "completed")

    def _next_number(self) -> int:
        return len(self.items) + (self._message is not None) + (self._call is not None)

    def _open_message(self) -> Iterator[bytes]:
        item_id = self._first_message_id if not self.items else f"msg_{secrets.token_hex(12)}"
        self._message = _OpenMessage(item_id, self._next_number())
        opening = output_message(item_id, "", "in_progress")
        yield self._event("response.output_item.added", output_index=self._message.number, item=opening)
        where = {"output_index": self._message.number, "content_index": 0, "item_id": item_id}
        yield self._event("response.content_part.added", **where, part=OutputText(text=""))

    def _close_message(self, status: str) -> Iterator[bytes]:
        message = self._message
        if message is None:
            return
        self._message = None
        text = message.text.strip()
        item = output_message(message.item_id, text, status)
        where = {"output_index": message.number, "content_index": 0, "item_id": message.item_id}
        yield self._event("response.output_text.done", **where, text=text, logprobs=[])
        yield self._event("response.content_part.done", **where, part=item.content[0])
        yield self._event("response.output_item.done", output_index=message.number, item=item)
        self.items.append(item)

    def _close_call(self, call: _OpenCall, arguments: str, status: str) -> Iterator[bytes]:
        self._call = None
        item = OutputFunctionCall(call.item_id, call.call_id, call.name, arguments, status)  # type: ignore[arg-type]
        where = {"output_index": call.number, "item_id": call.item_id}
        yield self._event("response.function_call_arguments.done", **where, arguments=arguments)
        yield self._event("response.output_item.done", output_index=call.number, item=item)
        self.items.append(item)
