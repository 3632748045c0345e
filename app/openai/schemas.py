"""Request and response bodies of the OpenAI API, as msgspec Structs (OpenAI's field names).

Requests forbid unknown fields, so a parameter this server does not support is a 400 naming it
rather than being silently ignored.

The limits on values (``temperature`` within [0, 2], one prompt per request...) are checked in
app/openai/params.py, whose errors say what to send instead; here they are only stated, as JSON Schema
in ``extra_json_schema``, so that the OpenAPI schema tells clients the same.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

MAX_STOP_SEQUENCES = 4  # OpenAI's limit on `stop`
MAX_TOKEN_ID = 2**31  # token ids travel as int32 on the engine's side
MAX_SEED = 2**63 - 1  # seeds feed torch.Generator.manual_seed, which takes a signed 64-bit value


def _documented(**json_schema: Any) -> Meta:
    """A constraint stated in the OpenAPI schema only (params.py enforces it with its own message)."""
    return Meta(extra_json_schema=json_schema)


_TOKEN_ID: dict[str, Any] = {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID - 1}
_TOKEN_IDS: dict[str, Any] = {"type": "array", "items": _TOKEN_ID, "minItems": 1}
PROMPT_DESCRIPTION = "One prompt: a text, a list of token ids, or a list holding one of either."
PROMPT_SCHEMA: dict[str, Any] = {
    "description": PROMPT_DESCRIPTION,
    "anyOf": [
        {"type": "string", "minLength": 1},
        _TOKEN_IDS,
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
        {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": 1},
    ],
}
MaxTokens = Annotated[int, _documented(minimum=1)]
StopText = Annotated[str, _documented(minLength=1)]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _SamplingFields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str
    max_tokens: Annotated[
        MaxTokens | None,
        Meta(description="Tokens to generate at most; the prompt and these must fit the model's context."),
    ] = None
    temperature: Annotated[float, _documented(minimum=0, maximum=2)] | None = None
    top_p: Annotated[float, _documented(exclusiveMinimum=0, maximum=1)] | None = None
    stop: StopText | Annotated[list[StopText], _documented(maxItems=MAX_STOP_SEQUENCES)] | None = None
    seed: Annotated[int, _documented(minimum=-MAX_SEED, maximum=MAX_SEED)] | None = None
    stream: bool = False
    stream_options: Annotated[StreamOptions | None, Meta(description="Only with `stream: true`.")] = None
    user: str | None = None
    n: Annotated[int, _documented(minimum=1, maximum=1, description="Choices per request: only 1.")] = 1


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], _documented(minItems=1)]
    max_completion_tokens: MaxTokens | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    # OpenAI takes a string, token ids, or a list of either; msgspec allows one list type per union,
    # so the list's items are checked when the prompt is encoded. PROMPT_SCHEMA states what passes; the
    # OpenAPI schema shows it in place of msgspec's looser one (app/openapi_schema.py).
    prompt: Annotated[str | list[str | int | list[int]], Meta(description=PROMPT_DESCRIPTION)]


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class AssistantMessage(msgspec.Struct):
    role: Literal["assistant"]
    content: str


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"
    system_fingerprint: str | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None
    logprobs: None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    system_fingerprint: str | None = None


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: None = None


class Completion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: Literal["text_completion"] = "text_completion"
    system_fingerprint: str | None = None


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str
    object: Literal["model"] = "model"
    parent: str | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"
