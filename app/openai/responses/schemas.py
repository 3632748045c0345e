"""OpenAI's Responses API: the request body, the response object and its output items.

``input`` is typed loosely here (a text, or a list of objects) because its items are told apart by a ``type``
that a message may leave out; app/openai/responses/items.py checks each item, and INPUT_SCHEMA states for the
OpenAPI schema exactly what passes. ``tools`` is stated the same way, so that a hosted tool gets a 400 that says
only function tools are offered. What a request asks for that this server lacks (``conversation``,
``background``, prompt templates, logprobs) is refused by app/openai/responses/input.py with a 400 that says what
to send instead.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from app.openai.chat.request_schemas import TOOL_NAME, Metadata, StreamOptions, _documented, _null_only
from app.openai.responses.items import FunctionCallItem, FunctionCallOutputItem, MessageItem, OutputItem

# OpenAI's `include` values: all but logprobs name parts of items this server never makes (hosted tools'
# results, images, encrypted reasoning), so asking for them includes nothing and is accepted.
INCLUDABLE = (
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
)
LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_LISTED_ITEMS = 100  # OpenAI's most input items a page


class FunctionTool(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A function the model may call; checked by ``msgspec.convert`` (so its name's pattern is enforced here)."""

    type: Literal["function"]
    name: Annotated[str, Meta(**TOOL_NAME)]
    parameters: Annotated[
        dict[str, Any] | None, Meta(description="A JSON schema of the arguments object; none: no arguments.")
    ] = None
    strict: bool | None = None
    description: str | None = None


class FunctionToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    name: str


class TextFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, _documented(**TOOL_NAME)] | None = None
    schema: Annotated[dict[str, Any] | None, Meta(description="With type `json_schema`: the JSON schema.")] = None
    strict: bool | None = None
    description: str | None = None


class TextOptions(msgspec.Struct, forbid_unknown_fields=True):
    format: TextFormat | None = None
    verbosity: Annotated[str, _documented(enum=["medium"])] | None = None


class Reasoning(msgspec.Struct, forbid_unknown_fields=True):
    effort: Annotated[str, _documented(enum=["none"])] | None = None
    summary: _null_only("the model does not reason.") = None


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str
    input: Annotated[
        str | list[dict[str, Any]],
        Meta(description="A text, or items: messages, `function_call` and `function_call_output`."),
    ]
    instructions: Annotated[str | None, Meta(description="A system message put before the input.")] = None
    max_output_tokens: Annotated[int, _documented(minimum=1)] | None = None
    temperature: Annotated[float, _documented(minimum=0, maximum=2)] | None = None
    top_p: Annotated[float, _documented(exclusiveMinimum=0, maximum=1)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    text: TextOptions | None = None
    tools: Annotated[list[dict[str, Any]] | None, Meta(description="Function tools.")] = None
    tool_choice: Annotated[
        Literal["none", "auto", "required"] | FunctionToolChoice | None,
        Meta(description="`auto` (the default with tools), `required`, `none`, or one function by name."),
    ] = None
    parallel_tool_calls: bool | None = None
    store: Annotated[bool | None, Meta(description="Keep the response to read and continue it (default true).")] = None
    previous_response_id: Annotated[
        str | None, Meta(description="A stored response of yours to continue: its input and output come first.")
    ] = None
    metadata: Metadata | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Annotated[str, _documented(enum=["in_memory", "in-memory"])] | None = None
    service_tier: Annotated[str, _documented(enum=["auto", "default"])] | None = None
    truncation: Annotated[str, _documented(enum=["disabled"])] | None = None
    include: (
        Annotated[
            list[Annotated[str, _documented(enum=list(INCLUDABLE))]],
            Meta(description="Accepted: these name parts of items this server never makes, so nothing is added."),
        ]
        | None
    ) = None
    reasoning: Reasoning | None = None
    max_tool_calls: (
        Annotated[
            int, _documented(minimum=1, description="Accepted: it bounds hosted tools' calls, and there are none.")
        ]
        | None
    ) = None
    conversation: _null_only("conversations are not offered; use `previous_response_id`.") = None
    background: Annotated[bool, _documented(const=False, description="No background mode.")] | None = None
    prompt: _null_only("prompt templates are not offered.") = None
    top_logprobs: Annotated[int, _documented(const=0)] | None = None


def _item_schema(item_type: type[msgspec.Struct]) -> dict[str, Any]:
    schema = msgspec.json.schema(item_type)
    definitions = schema.pop("$defs", {})
    body = definitions.pop(item_type.__name__)
    return _inline(body, definitions)


def _inline(value: Any, definitions: dict[str, Any]) -> Any:
    """``value`` with every ``$ref`` to ``definitions`` replaced by the definition itself."""
    if isinstance(value, dict):
        ref = value.get("$ref")
        if isinstance(ref, str):
            return _inline(definitions[ref.rsplit("/", 1)[-1]], definitions)
        return {key: _inline(item, definitions) for key, item in value.items()}
    if isinstance(value, list):
        return [_inline(item, definitions) for item in value]
    return value


INPUT_SCHEMA: dict[str, Any] = {
    "description": "A text, or items: messages (`type` may be left out), `function_call` and `function_call_output`.",
    "anyOf": [
        {"type": "string"},
        {
            "type": "array",
            "minItems": 1,
            "items": {"anyOf": [_item_schema(t) for t in (MessageItem, FunctionCallItem, FunctionCallOutputItem)]},
        },
    ],
}
TOOLS_SCHEMA: dict[str, Any] = {
    "anyOf": [{"type": "array", "items": _item_schema(FunctionTool)}, {"type": "null"}],
    "description": "Function tools (hosted tools are not offered).",
}


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(msgspec.Struct):
    id: str
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    output: list[OutputItem]
    usage: ResponseUsage | None
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    text: dict[str, Any]
    metadata: dict[str, str]
    tool_choice: str | dict[str, str]
    tools: list[dict[str, Any]]
    parallel_tool_calls: bool
    store: bool
    previous_response_id: str | None
    incomplete_details: dict[str, str] | None = None
    error: dict[str, str] | None = None
    object: Literal["response"] = "response"
    background: bool = False
    truncation: str = "disabled"


class DeletedResponse(msgspec.Struct):
    id: str
    deleted: bool = True
    object: Literal["response.deleted"] = "response.deleted"


class InputItemList(msgspec.Struct):
    """A page of a stored response's input items, as OpenAI lists them."""

    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: Literal["list"] = "list"
