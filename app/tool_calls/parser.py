"""A whole answer's text read into its text and its tool calls (the streaming parser, fed it at once)."""

from __future__ import annotations

from dataclasses import dataclass

from app.tool_calls.formats import ToolCallFormat
from app.tool_calls.streaming import CallEnded, StreamingParser, TextPart


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # the arguments object's JSON text


@dataclass(frozen=True, slots=True)
class ParsedReply:
    """An answer's text outside its calls, and its calls.

    ``complete`` is false when a call was opened and not closed (the text was cut, or, unconstrained,
    it broke the format): such a call is not among ``calls``.
    """

    content: str
    calls: list[ParsedCall]
    complete: bool


def parse_reply(tool_format: ToolCallFormat, text: str) -> ParsedReply:
    parser = StreamingParser(tool_format)
    events = parser.feed(text) + parser.finish()
    content = "".join(event.text for event in events if isinstance(event, TextPart))
    calls = [ParsedCall(event.name, event.arguments) for event in events if isinstance(event, CallEnded)]
    complete = not parser.is_broken and not parser.broken_text and parser.num_calls == len(calls)
    return ParsedReply(content.strip(), calls, complete)
