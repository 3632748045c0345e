"""A chat conversation as the prompt's messages: its tools and calls in the chat template, or as plain text.

With ``auto`` the model must know its tools and how to call them, so the conversation is rendered by a
chat template that renders ``tools`` and calls (the model's tool template, or its adapter's): messages
in the shape Hugging Face templates take (an assistant's ``tool_calls`` with their arguments as objects,
``tool`` messages with their call's id and function name).

Otherwise (no tools, ``none``, ``required`` or a named function) the model's own template renders the
messages, and a conversation's tool parts are written as plain text before it (docs/tools.md): the tools
in the system message, an assistant's calls as their JSON, a tool's result as a user message naming the
call it answers.
"""

from __future__ import annotations

import json
from typing import Any

from app.openai.chat.request_schemas import ChatCompletionRequest, ChatMessage, Tool
from app.openai.chat.tools import ToolPlan, arguments_schema
from app.web.bounded_json import parse_json
from app.web.errors import BadRequestError

DEFAULT_SYSTEM = "You are a helpful assistant."


def render_messages(body: ChatCompletionRequest, plan: ToolPlan | None) -> list[dict[str, str]]:
    """The conversation as role/content pairs the model's own template takes, its tool parts as plain text."""
    names = _call_names(body)
    messages = [_flattened(message, names) for message in body.messages]
    if plan is not None and body.tools:
        listed = "\n".join(json.dumps(_described(tool)) for tool in body.tools)
        tools_text = f"You can call these functions (answer a call as JSON):\n{listed}"
        if messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{tools_text}"}
        else:
            messages.insert(0, {"role": "system", "content": f"{DEFAULT_SYSTEM}\n\n{tools_text}"})
    return messages


def template_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The conversation as a tool-aware chat template takes it."""
    names = _call_names(body)
    messages: list[dict[str, Any]] = []
    for message in body.messages:
        role = "system" if message.role == "developer" else message.role
        entry: dict[str, Any] = {"role": role, "content": message.text()}
        if message.role == "tool":
            entry |= {"tool_call_id": _answered_call(message), "name": names.get(message.tool_call_id or "", "")}
        if message.role == "assistant" and message.tool_calls:
            entry["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": _arguments_object(call.function.arguments)},
                }
                for call in message.tool_calls
            ]
        messages.append(entry)
    return messages


def template_tools(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's tools as a chat template takes them (OpenAI's shape, ``parameters`` always present)."""
    return [{"type": "function", "function": _described(tool)} for tool in body.tools or []]


def _call_names(body: ChatCompletionRequest) -> dict[str, str]:
    return {call.id: call.function.name for m in body.messages for call in m.tool_calls or []}


def _answered_call(message: ChatMessage) -> str:
    if not message.tool_call_id:
        raise BadRequestError("A `tool` message needs `tool_call_id`: the call it answers.", param="messages")
    return message.tool_call_id


def _flattened(message: ChatMessage, names: dict[str, str]) -> dict[str, str]:
    if message.role == "tool":
        call_id = _answered_call(message)
        name = names.get(call_id, "a function")
        return {"role": "user", "content": f"Result of {name} (call {call_id}): {message.text()}"}
    content = message.text()
    if message.role == "assistant" and message.tool_calls:
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls]
        content = "\n".join(part for part in (content, json.dumps(calls)) if part)
    return {"role": "system" if message.role == "developer" else message.role, "content": content}


def _arguments_object(arguments: str) -> Any:
    """A call's arguments as templates render them: the JSON value, or the text when it is not JSON."""
    try:
        return parse_json(arguments, "A tool call's `arguments`", param="messages")
    except ValueError:
        return arguments


def _described(tool: Tool) -> dict[str, Any]:
    function = tool.function
    return {"name": function.name, "description": function.description or "", "parameters": arguments_schema(tool)}
