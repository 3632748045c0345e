"""Tool calls on chat: what each ``tool_choice`` constrains the output to, and how its text becomes calls.

``auto`` (and ``tools`` without ``tool_choice``) constrains the output with the tool-call format's
structural tag (app/tool_calls): the model writes text, or opens a call in its format, and a call once
opened can only be one of ``tools`` with arguments valid against its schema; the answer's text is parsed
back into OpenAI's ``tool_calls``, with the text before them as ``content``. A named ``tool_choice``
constrains the output to that function's ``parameters`` schema: the text is the call's ``arguments``.
``required`` constrains it to a JSON array (one item when ``parallel_tool_calls`` is false) of
``{"name": <one of the tools>, "parameters": <that tool's arguments>}``, each item one call.
How the conversation's tools are put in the prompt is in app/openai/chat/tool_prompts.py.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from app.openai.chat.reply_schemas import ResponseFunctionCall, ResponseToolCall
from app.openai.chat.request_schemas import ChatCompletionRequest, NamedToolChoice, Tool
from app.tool_calls import ToolCallFormat, ToolSpec, parse_reply
from app.tool_calls.formats import NO_ARGUMENTS
from app.web.errors import BadRequestError
from engine import GrammarConstraint, GrammarError

TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How the answer's text becomes tool calls: ``auto`` in a format, one named function, or ``required``'s list."""

    constraint: GrammarConstraint
    function: str | None  # the named function; None: ``required`` or ``auto``
    tool_format: ToolCallFormat | None = None  # ``auto``: the format the model writes its calls in

    @property
    def is_auto(self) -> bool:
        return self.tool_format is not None

    @property
    def finish_reason(self) -> str:
        """OpenAI's reason for a complete answer: ``stop`` for a named choice, ``tool_calls`` for ``required``."""
        return "stop" if self.function is not None else "tool_calls"

    def answer(
        self, text: str, finish_reason: str | None
    ) -> tuple[str | None, list[ResponseToolCall] | None, str | None]:
        """An ``auto`` answer's content, calls and finish reason: calls (and the text before them) if it made any.

        A call cut by ``max_tokens`` is no call: the whole text comes back as content, with ``length``.
        """
        assert self.tool_format is not None
        parsed = parse_reply(self.tool_format, text)
        if not parsed.complete or not parsed.calls:
            return text, None, finish_reason
        calls = [new_call(call.name, call.arguments) for call in parsed.calls]
        return parsed.content or None, calls, "tool_calls" if finish_reason == "stop" else finish_reason

    def calls(self, text: str) -> list[ResponseToolCall] | None:
        """The calls in a complete answer's text; None when the text is not complete JSON (cut by max_tokens)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.function is not None:
            return [new_call(self.function, text)]
        return [new_call(item["name"], json.dumps(item["parameters"])) for item in value]


def tool_plan(body: ChatCompletionRequest, tool_format: ToolCallFormat) -> ToolPlan | None:
    """The request's plan for tool calls, or None when it asks for none (no tools, or ``tool_choice: none``).

    ``auto`` calls are written in ``tool_format`` (the model's or its adapter's).
    """
    tools, choice = body.tools or [], body.tool_choice
    if choice is not None and choice != "none" and not tools:
        raise BadRequestError("`tool_choice` needs `tools`; send the functions it may call.", param="tool_choice")
    if not tools or choice == "none":
        return None
    by_name = _check_tools(tools)
    try:
        if choice is None or choice == "auto":
            specs = [ToolSpec(tool.function.name, arguments_schema(tool)) for tool in tools]
            tag = tool_format.structural_tag(specs, parallel=body.parallel_tool_calls is not False)
            return ToolPlan(GrammarConstraint.structural_tag(tag), None, tool_format)
        if isinstance(choice, NamedToolChoice):
            name = choice.function.name
            if name not in by_name:
                raise BadRequestError(f"`tool_choice` names {name!r}, which is not among `tools`.", param="tool_choice")
            return ToolPlan(GrammarConstraint.json_schema(arguments_schema(by_name[name])), name)
        calls_schema = {
            "type": "array",
            "minItems": 1,
            **({"maxItems": 1} if body.parallel_tool_calls is False else {}),
            "items": {"anyOf": [_call_schema(tool) for tool in tools]},
        }
        return ToolPlan(GrammarConstraint.json_schema(calls_schema), None)
    except GrammarError as error:
        raise BadRequestError(f"`tools`: {error}.", param="tools") from None


def _check_tools(tools: list[Tool]) -> dict[str, Tool]:
    by_name: dict[str, Tool] = {}
    for tool in tools:
        name = tool.function.name
        if not TOOL_NAME.match(name):
            raise BadRequestError(f"Tool name {name!r} must match ^[a-zA-Z0-9_-]{{1,64}}$.", param="tools")
        if name in by_name:
            raise BadRequestError(f"Two tools are named {name!r}; names must be unique.", param="tools")
        parameters = tool.function.parameters
        if parameters is not None and parameters.get("type", "object") != "object":
            raise BadRequestError(f"Tool {name!r}: `parameters` must be an object schema.", param="tools")
        by_name[name] = tool
    return by_name


def arguments_schema(tool: Tool) -> dict[str, Any]:
    """The JSON schema of a tool's arguments object (no ``parameters``: no arguments)."""
    return tool.function.parameters or NO_ARGUMENTS


def _call_schema(tool: Tool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "parameters": arguments_schema(tool)},
        "required": ["name", "parameters"],
    }


def new_call(name: str, arguments: str) -> ResponseToolCall:
    """A call as OpenAI shows it, with a fresh id."""
    return ResponseToolCall(id=f"call_{secrets.token_hex(12)}", function=ResponseFunctionCall(name, arguments))
