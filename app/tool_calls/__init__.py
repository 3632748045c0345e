"""Tool-call formats: how a model writes a call, the structural tag that constrains it, and its parsers.

A format (app/tool_calls/formats.py) is a pair: the structural tag xgrammar constrains decoding with
(text is free until the model opens a call, then the call's name is one of the request's tools and its
arguments follow that tool's schema), and the parser that turns the model's text back into calls, whole
(app/tool_calls/parser.py) or as they stream (app/tool_calls/streaming.py).
"""

from app.tool_calls.formats import (
    DEFAULT_FORMAT,
    FORMATS,
    ToolCallFormat,
    ToolCallFormatError,
    ToolSpec,
    get_format,
)
from app.tool_calls.parser import ParsedCall, ParsedReply, parse_reply
from app.tool_calls.streaming import CallArguments, CallStarted, StreamingParser, TextPart

__all__ = [
    "DEFAULT_FORMAT",
    "FORMATS",
    "CallArguments",
    "CallStarted",
    "ParsedCall",
    "ParsedReply",
    "StreamingParser",
    "TextPart",
    "ToolCallFormat",
    "ToolCallFormatError",
    "ToolSpec",
    "get_format",
    "parse_reply",
]
