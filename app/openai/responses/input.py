"""From a Responses request (and the stored conversation it continues) to the chat completion it amounts to.

The conversation is a list of items in OpenAI's listing shape (app/openai/responses/items.py): a continued
response's stored items and output, then this request's input. It becomes chat messages: ``instructions``
a system message first (a continued response's instructions are not carried over, as OpenAI does it),
messages as they are, an assistant's text and the ``function_call`` items after it one assistant message
with ``tool_calls``, and each ``function_call_output`` a ``tool`` message answering its ``call_id``.
Function tools and ``tool_choice`` become chat's, so tool calls are made exactly as on chat completions.
"""

from __future__ import annotations

from typing import Any

import msgspec

from app.openai.chat.request_schemas import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    Tool,
    ToolCall,
)
from app.openai.chat.tools import TOOL_NAME
from app.openai.responses.items import decoded_items, item_text, listed
from app.openai.responses.schemas import (
    INCLUDABLE,
    LOGPROBS_INCLUDE,
    FunctionTool,
    FunctionToolChoice,
    ResponsesRequest,
)
from app.web.errors import BadRequestError
from app.web.json_body import body_error


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """This request's input as listed items (a text is one user message)."""
    raw = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    if not raw:
        raise BadRequestError("`input` must hold at least one item.", param="input")
    return [listed(item) for item in decoded_items(raw)]


def as_chat(body: ResponsesRequest, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completion that answers ``conversation`` as ``body`` asks (after :func:`refuse_unsupported`)."""
    messages = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    messages += chat_messages(conversation)
    tools = function_tools(body.tools)
    return ChatCompletionRequest(
        model=body.model,
        messages=messages,
        max_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        stream=body.stream,
        response_format=_response_format(body),
        tools=tools or None,
        tool_choice=_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
    )


def chat_messages(items: list[dict[str, Any]]) -> list[ChatMessage]:
    messages: list[ChatMessage] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            messages.append(ChatMessage(role=item["role"], content=item_text(item)))
        elif kind == "function_call":
            call = ToolCall(id=item["call_id"], function=FunctionCall(item["name"], item["arguments"]))
            previous = messages[-1] if messages else None
            if previous is not None and previous.role == "assistant":  # the calls follow the text of one answer
                previous.tool_calls = [*(previous.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        else:
            messages.append(ChatMessage(role="tool", content=item["output"], tool_call_id=item["call_id"]))
    return messages


def function_tools(raw_tools: list[dict[str, Any]] | None) -> list[Tool]:
    """The request's tools as chat's; a hosted tool is a 400 that says only function tools are offered."""
    tools = []
    for number, raw in enumerate(raw_tools or []):
        kind = raw.get("type")
        if kind != "function":
            raise BadRequestError(
                f"`tools[{number}]` is a {kind!r} tool; hosted tools are not offered here, only "
                '`{"type": "function", "name": ..., "parameters": {...}}`.',
                param=f"tools[{number}].type",
            )
        try:
            tool = msgspec.convert(raw, FunctionTool, strict=True)
        except msgspec.ValidationError as error:
            text = str(error).replace("- at `$", f"- at `$.tools[{number}]")
            raise body_error(text if " - at `" in text else f"{text} - at `$.tools[{number}]`") from None
        definition = FunctionDefinition(tool.name, tool.description, tool.parameters, tool.strict)
        tools.append(Tool(function=definition))
    return tools


def refuse_unsupported(body: ResponsesRequest) -> None:
    if body.background:
        raise BadRequestError("Background responses are not offered; leave `background` out.", param="background")
    for name, what in (  # only null fits these
        ("conversation", "Conversations are not offered; continue a stored response with `previous_response_id`."),
        ("prompt", "Prompt templates are not offered; send the text as `input`."),
    ):
        if getattr(body, name) is not None:
            raise BadRequestError(what, param=name)
    if body.reasoning is not None and body.reasoning.summary is not None:
        raise BadRequestError("This model does not reason; leave `reasoning.summary` out.", param="reasoning")
    if body.include and LOGPROBS_INCLUDE in body.include:
        raise BadRequestError(
            f"`include` {LOGPROBS_INCLUDE!r} is not offered: responses carry no logprobs.", param="include"
        )
    for name, value, allowed in (
        ("service_tier", body.service_tier, ("auto", "default")),
        ("truncation", body.truncation, ("disabled",)),
        ("reasoning", body.reasoning.effort if body.reasoning else None, ("none",)),
        ("text", body.text.verbosity if body.text else None, ("medium",)),
        ("top_logprobs", body.top_logprobs, (0,)),
        ("prompt_cache_retention", body.prompt_cache_retention, ("in_memory", "in-memory")),
        ("include", next((item for item in body.include or [] if item not in INCLUDABLE), None), INCLUDABLE),
    ):
        if value is not None and value not in allowed:
            raise BadRequestError(
                f"`{name}` {value!r} is not offered; send one of {list(allowed)} or leave it out.", param=name
            )
    if body.max_tool_calls is not None and body.max_tool_calls < 1:
        raise BadRequestError("`max_tool_calls` must be at least 1.", param="max_tool_calls")
    if body.stream_options is not None and not body.stream:
        raise BadRequestError("`stream_options` is only allowed when `stream` is true.", param="stream_options")


def _tool_choice(choice: str | FunctionToolChoice | None) -> str | NamedToolChoice | None:
    if isinstance(choice, FunctionToolChoice):
        return NamedToolChoice(function=NamedFunction(choice.name))
    return choice


def _response_format(body: ResponsesRequest) -> ResponseFormat | None:
    text_format = body.text.format if body.text is not None else None
    if text_format is not None and text_format.name is not None and not TOOL_NAME.match(text_format.name):
        raise BadRequestError("`text.format.name` must match ^[a-zA-Z0-9_-]{1,64}$.", param="text")
    if text_format is None or text_format.type == "text":
        return None
    if text_format.type == "json_object":
        return ResponseFormat(type="json_object")
    if text_format.schema is None or text_format.name is None:
        raise BadRequestError("`text.format` of type `json_schema` needs `name` and `schema`.", param="text")
    schema = JsonSchemaFormat(text_format.name, text_format.schema, text_format.strict, text_format.description)
    return ResponseFormat(type="json_schema", json_schema=schema)
