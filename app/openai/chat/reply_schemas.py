"""Response bodies of the OpenAI API, as msgspec Structs (OpenAI's shapes; vLLM's for ``prompt_logprobs``).

``logprobs`` is always present on a choice (null unless asked), as OpenAI sends it; a choice's
``prompt_logprobs`` appears only when asked (``omit_defaults`` on a Struct whose other fields have none).
"""

from __future__ import annotations

from typing import Literal

import msgspec


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class TopLogprob(msgspec.Struct):
    """One likely token at a position (chat): its text, log-probability and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    """One generated token (chat), with the likeliest tokens at its position, best first."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(msgspec.Struct):
    """Completions' logprobs: per token its text, log-probability (null for a prompt's first token), the likeliest
    tokens with theirs (the token itself among them; null where its logprob is), and where it starts in the text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(msgspec.Struct):
    """vLLM's entry of ``prompt_logprobs``: a token's log-probability, its rank (1 = likeliest; null when it is not
    among the alternatives asked for) and its text."""

    logprob: float
    rank: int | None
    decoded_token: str


PromptLogprobs = list[dict[int, PromptLogprob] | None]
"""Per prompt token (the first is null): its token id and the alternatives' ids, each to its entry."""


class ResponseFunctionCall(msgspec.Struct):
    name: str
    arguments: str  # the arguments object as JSON text


class ResponseToolCall(msgspec.Struct):
    id: str
    function: ResponseFunctionCall
    type: Literal["function"] = "function"


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    """A streamed call: the first delta of call ``index`` has its id, type and name; ``arguments`` follow."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: dict[str, str] | None = None


class AssistantMessage(msgspec.Struct, omit_defaults=True):
    role: Literal["assistant"]
    content: str | None  # null when the answer is tool calls
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None


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
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    system_fingerprint: str | None = None


class CompletionChoice(msgspec.Struct, omit_defaults=True):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None
    prompt_logprobs: PromptLogprobs | None = None


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
