"""Tool calls on chat, as vLLM makes them for ``required`` and a named function: constrained decoding.

A named ``tool_choice`` constrains the output to that function's ``parameters`` schema: the text is the
call's ``arguments``. ``required`` constrains it to a JSON array (one item when ``parallel_tool_calls``
is false) of ``{"name": <one of the tools>, "parameters": <that tool's arguments>}``, each item one call.
``auto`` would need the model to choose between text and a call in a format its chat template defines;
the default model's template defines none, so ``auto`` with tools is refused with the choices that work.

The default model's chat template knows no tools either, so a conversation's tool parts are rendered as
plain text before the template (docs/api.md#tools): the tools in the system message,
an assistant's calls as their JSON, a tool's result as a user message naming the call it answers.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from app.openai.schemas import ChatCompletionRequest, ChatMessage, NamedToolChoice, Tool
from app.openai.schemas_responses import ResponseFunctionCall, ResponseToolCall
from app.web.errors import BadRequestError
from engine import GrammarConstraint, GrammarError

TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}
DEFAULT_SYSTEM = "You are a helpful assistant."


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How the answer's text becomes tool calls: one named function, or a list of calls (``required``)."""

    constraint: GrammarConstraint
    function: str | None  # the named function; None: ``required``

    @property
    def finish_reason(self) -> str:
        """OpenAI's reason for a complete answer: ``stop`` for a named choice, ``tool_calls`` for ``required``."""
        return "stop" if self.function is not None else "tool_calls"

    def calls(self, text: str) -> list[ResponseToolCall] | None:
        """The calls in a complete answer's text; None when the text is not complete JSON (cut by max_tokens)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.function is not None:
            return [_call(self.function, text)]
        return [_call(item["name"], json.dumps(item["parameters"])) for item in value]


def tool_plan(body: ChatCompletionRequest) -> ToolPlan | None:
    """The request's plan for tool calls, or None when it asks for none (no tools, or ``tool_choice: none``)."""
    tools, choice = body.tools or [], body.tool_choice
    if choice is not None and choice != "none" and not tools:
        raise BadRequestError("`tool_choice` needs `tools`; send the functions it may call.", param="tool_choice")
    if not tools or choice == "none":
        return None
    by_name = _check_tools(tools)
    if choice is None or choice == "auto":
        raise BadRequestError(
            "`tool_choice: auto` is not offered: this model's chat template defines no tool-call format, so it cannot "
            'choose between text and a call. Send `"required"`, a named function '
            '(`{"type": "function", "function": {"name": ...}}`) or `"none"`.',
            param="tool_choice",
        )
    try:
        if isinstance(choice, NamedToolChoice):
            name = choice.function.name
            if name not in by_name:
                raise BadRequestError(f"`tool_choice` names {name!r}, which is not among `tools`.", param="tool_choice")
            return ToolPlan(GrammarConstraint.json_schema(_arguments_schema(by_name[name])), name)
        calls_schema = {
            "type": "array",
            "minItems": 1,
            **({"maxItems": 1} if body.parallel_tool_calls is False else {}),
            "items": {"anyOf": [_call_schema(tool) for tool in tools]},
        }
        return ToolPlan(GrammarConstraint.json_schema(calls_schema), None)
    except GrammarError as error:
        raise BadRequestError(f"`tools`: {error}.", param="tools") from None


def render_messages(body: ChatCompletionRequest, plan: ToolPlan | None) -> list[dict[str, str]]:
    """The conversation as role/content pairs the chat template takes, its tool parts as plain text."""
    names = {call.id: call.function.name for m in body.messages for call in m.tool_calls or []}
    messages = [_rendered(message, names) for message in body.messages]
    if plan is not None and body.tools:
        listed = "\n".join(json.dumps(_described(tool)) for tool in body.tools)
        tools_text = f"You can call these functions (answer a call as JSON):\n{listed}"
        if messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{tools_text}"}
        else:
            messages.insert(0, {"role": "system", "content": f"{DEFAULT_SYSTEM}\n\n{tools_text}"})
    return messages


def _rendered(message: ChatMessage, names: dict[str, str]) -> dict[str, str]:
    if message.role == "tool":
        if not message.tool_call_id:
            raise BadRequestError("A `tool` message needs `tool_call_id`: the call it answers.", param="messages")
        name = names.get(message.tool_call_id, "a function")
        return {"role": "user", "content": f"Result of {name} (call {message.tool_call_id}): {message.text()}"}
    content = message.text()
    if message.role == "assistant" and message.tool_calls:
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls]
        content = "\n".join(part for part in (content, json.dumps(calls)) if part)
    return {"role": "system" if message.role == "developer" else message.role, "content": content}


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


def _arguments_schema(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or NO_ARGUMENTS


def _call_schema(tool: Tool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "parameters": _arguments_schema(tool)},
        "required": ["name", "parameters"],
    }


def _described(tool: Tool) -> dict[str, Any]:
    function = tool.function
    return {"name": function.name, "description": function.description or "", "parameters": _arguments_schema(tool)}


def _call(name: str, arguments: str) -> ResponseToolCall:
    return ResponseToolCall(id=f"call_{secrets.token_hex(12)}", function=ResponseFunctionCall(name, arguments))
