"""One ``auto`` choice's stream: its text as content deltas until a call opens, then its calls as OpenAI streams them.

Each call opens with a delta holding its ``index``, a fresh ``id``, ``type`` and the function's ``name``
(``arguments`` empty), then its ``arguments`` in fragments as the model writes them. A choice that made
calls and stopped finishes with ``tool_calls``. Cut by ``max_tokens`` inside a call, it finishes with
``length``: the fragments sent so far are not a whole call, and a client must not run it.
"""

from __future__ import annotations

import secrets

from app.openai.chat.reply_schemas import ChatDelta, ToolCallDelta
from app.tool_calls import CallArguments, CallStarted, StreamingParser, TextPart, ToolCallFormat
from app.tool_calls.streaming import Event


class ToolCallStreamer:
    """Turns one choice's text deltas into chat deltas."""

    def __init__(self, tool_format: ToolCallFormat) -> None:
        self._parser = StreamingParser(tool_format)

    def deltas(self, text: str, finished: bool) -> list[ChatDelta]:
        """The chat deltas of the next ``text``; with ``finished``, what the parser still held back too."""
        events = self._parser.feed(text)
        if finished:
            events += self._parser.finish()
        return [delta for event in events if (delta := self._delta(event)) is not None]

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self._parser.num_calls else reason

    def _delta(self, event: Event) -> ChatDelta | None:
        match event:
            case TextPart(text) if not self._parser.num_calls or text.strip():
                return ChatDelta(content=text)
            case CallStarted(index, name):
                call_id = f"call_{secrets.token_hex(12)}"
                return ChatDelta(
                    tool_calls=[ToolCallDelta(index, call_id, "function", {"name": name, "arguments": ""})]
                )
            case CallArguments(index, fragment):
                return ChatDelta(tool_calls=[ToolCallDelta(index, function={"arguments": fragment})])
        return None
