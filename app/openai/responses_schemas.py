"""OpenAI's Responses API, stateless: the request body, the response object and the stream's events.

Only what a stateless text generator can honour is accepted; ``store: true``, ``previous_response_id``,
``conversation``, ``background``, prompt templates and tools are refused by app/openai/responses.py with a
400 that says what to send instead.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from app.openai.schemas import TOOL_NAME, StreamOptions, _documented, _null_only


class InputText(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    type: Literal["message"] = "message"
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


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
    input: Annotated[str | list[InputMessage], Meta(description="A text, or message items.")]
    instructions: Annotated[str | None, Meta(description="A system message put before the input.")] = None
    max_output_tokens: Annotated[int, _documented(minimum=1)] | None = None
    temperature: Annotated[float, _documented(minimum=0, maximum=2)] | None = None
    top_p: Annotated[float, _documented(exclusiveMinimum=0, maximum=1)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    text: TextOptions | None = None
    store: Annotated[bool, _documented(const=False, description="Nothing is stored; absent means false.")] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: Annotated[str, _documented(enum=["auto", "default"])] | None = None
    truncation: Annotated[str, _documented(enum=["disabled"])] | None = None
    parallel_tool_calls: bool | None = None
    tool_choice: Annotated[str, _documented(enum=["none", "auto"])] | None = None
    tools: Annotated[list[dict[str, Any]], _documented(maxItems=0, description="Use chat completions.")] | None = None
    include: Annotated[list[str], _documented(maxItems=0)] | None = None
    reasoning: Reasoning | None = None
    previous_response_id: _null_only("responses are not stored.") = None
    conversation: _null_only("conversations are not stored.") = None
    background: Annotated[bool, _documented(const=False, description="No background mode.")] | None = None
    prompt: _null_only("prompt templates are not offered.") = None
    max_tool_calls: _null_only("no tools on this route.") = None
    top_logprobs: Annotated[int, _documented(const=0)] | None = None


class OutputText(msgspec.Struct):
    text: str
    type: Literal["output_text"] = "output_text"
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class OutputMessage(msgspec.Struct):
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"


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
    output: list[OutputMessage]
    usage: ResponseUsage | None
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    text: dict[str, Any]
    metadata: dict[str, str]
    incomplete_details: dict[str, str] | None = None
    error: dict[str, str] | None = None
    object: Literal["response"] = "response"
    tool_choice: str = "none"
    tools: list[Any] = msgspec.field(default_factory=list)
    parallel_tool_calls: bool = False
    store: bool = False
    background: bool = False
    truncation: str = "disabled"
