"""Request bodies of the OpenAI API, as msgspec Structs (OpenAI's field names, and vLLM's for its extensions).

Requests forbid unknown fields, so a parameter this server does not know is a 400 naming it rather than
being silently ignored. Every parameter OpenAI's reference defines for these two endpoints is a field:
those whose value asks for something this server lacks (``store: true``, audio...) are refused by
app/openai/chat/unsupported.py with a 400 that says so.

The limits on values (``temperature`` within [0, 2], ``n`` up to LORAPLEX_MAX_N...) are checked in
app/openai/chat/params.py, whose errors say what to send instead; here they are only stated, as JSON Schema in
``extra_json_schema``, so that the OpenAPI schema tells clients the same. Response bodies are in
app/openai/chat/reply_schemas.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from app.settings_defaults import DEFAULT_MAX_N, DEFAULT_MAX_PROMPTS

MAX_STOP_SEQUENCES = 4  # OpenAI's limit on `stop`
MAX_TOKEN_ID = 2**31  # token ids travel as int32 on the engine's side
MAX_SEED = 2**63 - 1  # seeds feed torch.Generator.manual_seed, which takes a signed 64-bit value
MAX_LOGPROBS = 20  # top alternatives per token: OpenAI's chat limit (its completions stop at 5, vLLM's at 20)
MAX_LOGIT_BIAS = 300  # OpenAI's most logit_bias entries
MAX_ABS_LOGIT_BIAS = 100.0
MAX_ABS_PENALTY = 2.0  # presence_penalty and frequency_penalty, as OpenAI bounds them
MAX_REPETITION_PENALTY = 100.0  # vLLM's extension; above it every seen token is simply forbidden
# OpenAI's bounds on `metadata`: 16 pairs, keys of at most 64 characters, values of at most 512.
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
Metadata = Annotated[
    dict[
        Annotated[str, Meta(max_length=MAX_METADATA_KEY_CHARS)],
        Annotated[str, Meta(max_length=MAX_METADATA_VALUE_CHARS)],
    ],
    Meta(
        max_length=MAX_METADATA_PAIRS,
        description=f"At most {MAX_METADATA_PAIRS} pairs: keys of at most {MAX_METADATA_KEY_CHARS} characters, values "
        f"of at most {MAX_METADATA_VALUE_CHARS}.",
    ),
]


def _documented(**json_schema: Any) -> Meta:
    """A constraint stated in the OpenAPI schema only (params.py enforces it with its own message)."""
    return Meta(extra_json_schema=json_schema)


def _null_only(what: str) -> Any:
    """A parameter only ``null`` fits: what it asks for is not offered (unsupported.py answers 400 otherwise)."""
    return Annotated[Any, _documented(type="null", description=f"Only null: {what}")]


_TOKEN_ID: dict[str, Any] = {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID - 1}
_TOKEN_IDS: dict[str, Any] = {"type": "array", "items": _TOKEN_ID, "minItems": 1}
PROMPT_DESCRIPTION = (
    f"A text, a list of token ids, or a list of up to {DEFAULT_MAX_PROMPTS} (LORAPLEX_MAX_PROMPTS) of either: "
    "several prompts, answered with `n` choices each, prompt-major."
)
PROMPT_SCHEMA: dict[str, Any] = {
    "description": PROMPT_DESCRIPTION,
    "anyOf": [
        {"type": "string", "minLength": 1},
        _TOKEN_IDS,
        {
            "type": "array",
            "items": {"type": "string", "minLength": 1},
            "minItems": 1,
            "maxItems": DEFAULT_MAX_PROMPTS,
        },
        {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": DEFAULT_MAX_PROMPTS},
    ],
}
TOOL_NAME = {"pattern": "^[a-zA-Z0-9_-]{1,64}$"}
StopText = Annotated[str, _documented(minLength=1)]
Penalty = Annotated[float, _documented(minimum=-MAX_ABS_PENALTY, maximum=MAX_ABS_PENALTY)]
NumLogprobs = Annotated[int, _documented(minimum=0, maximum=MAX_LOGPROBS)]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    include_obfuscation: Annotated[
        bool | None, Meta(description="Accepted; chunks carry no obfuscation padding either way.")
    ] = None


class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class FunctionCall(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str


class ToolCall(msgspec.Struct, forbid_unknown_fields=True):
    """A call the assistant made earlier in the conversation."""

    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCall] | None, Meta(description="An assistant's earlier calls.")] = None
    tool_call_id: Annotated[str | None, Meta(description="A `tool` message: the call it answers.")] = None
    refusal: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(msgspec.Struct, forbid_unknown_fields=True):
    name: Annotated[str, _documented(**TOOL_NAME)]
    description: str | None = None
    parameters: Annotated[
        dict[str, Any] | None, Meta(description="A JSON schema of the arguments object; none: no arguments.")
    ] = None
    strict: bool | None = None


class Tool(msgspec.Struct, forbid_unknown_fields=True):
    function: FunctionDefinition
    type: Literal["function"] = "function"


class NamedFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    function: NamedFunction
    type: Literal["function"] = "function"


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's ``structured_outputs``: exactly one of ``json``, ``regex`` and ``choice``."""

    json: Annotated[
        dict[str, Any] | str | None, Meta(description="A JSON schema (object or its text) the output must match.")
    ] = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: _null_only("EBNF grammars are not offered; use json, regex or choice.") = None
    structural_tag: _null_only("structural tags are not offered; use json, regex or choice.") = None


class _SamplingFields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What both endpoints take: OpenAI's sampling parameters and vLLM's extensions of them."""

    model: str
    temperature: Annotated[float, _documented(minimum=0, maximum=2)] | None = None
    top_p: Annotated[float, _documented(exclusiveMinimum=0, maximum=1)] | None = None
    stop: StopText | Annotated[list[StopText], _documented(maxItems=MAX_STOP_SEQUENCES)] | None = None
    seed: Annotated[int, _documented(minimum=-MAX_SEED, maximum=MAX_SEED)] | None = None
    stream: bool | None = False
    stream_options: Annotated[StreamOptions | None, Meta(description="Only with `stream: true`.")] = None
    user: Annotated[str | None, Meta(description="Accepted and ignored (requests are billed to the key).")] = None
    n: (
        Annotated[
            int,
            _documented(
                minimum=1,
                maximum=DEFAULT_MAX_N,
                description=f"Choices per prompt, up to {DEFAULT_MAX_N} (LORAPLEX_MAX_N); they share the prompt's KV.",
            ),
        ]
        | None
    ) = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: (
        Annotated[
            dict[str, float],
            _documented(
                maxProperties=MAX_LOGIT_BIAS,
                propertyNames={"pattern": "^[0-9]{1,10}$"},
                additionalProperties={"type": "number", "minimum": -MAX_ABS_LOGIT_BIAS, "maximum": MAX_ABS_LOGIT_BIAS},
                description="Token id (as a string) to a bias within [-100, 100] added to its logit.",
            ),
        ]
        | None
    ) = None
    # vLLM's extensions.
    top_k: Annotated[int, _documented(minimum=-1, description="Keep the k likeliest tokens; 0 or -1: all.")] | None = (
        None
    )
    min_p: Annotated[float, _documented(minimum=0, maximum=1)] | None = None
    repetition_penalty: Annotated[float, _documented(exclusiveMinimum=0, maximum=MAX_REPETITION_PENALTY)] | None = None
    min_tokens: Annotated[int, _documented(minimum=0, description="At most `max_tokens`.")] | None = None
    stop_token_ids: list[Annotated[int, _documented(minimum=0, maximum=MAX_TOKEN_ID - 1)]] | None = None
    ignore_eos: bool | None = None
    # loraplex's extension.
    speculative: (
        Annotated[
            bool,
            _documented(
                description="false: no speculative decoding for this request (the output is the same either way)."
            ),
        ]
        | None
    ) = None
    best_of: Annotated[int, _documented(minimum=1, description="Only null or equal to `n`.")] | None = None
    structured_outputs: Annotated[
        StructuredOutputs | None,
        Meta(description="vLLM's structured output: exactly one of `json`, `regex`, `choice`."),
    ] = None
    use_beam_search: Annotated[bool, _documented(const=False, description="Beam search is not offered.")] | None = None


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True):
    name: Annotated[str, _documented(**TOOL_NAME)]
    schema: Annotated[dict[str, Any] | None, Meta(description="The JSON schema; none: any JSON object.")] = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Annotated[JsonSchemaFormat | None, Meta(description="With type `json_schema` only.")] = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], _documented(minItems=1)]
    max_tokens: Annotated[
        Annotated[int, _documented(minimum=1)] | None,
        Meta(description="Tokens to generate at most; the prompt and these must fit the model's context."),
    ] = None
    max_completion_tokens: Annotated[int, _documented(minimum=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[NumLogprobs | None, Meta(description="Only with `logprobs: true`.")] = None
    # Accepted as long as they ask for nothing this server lacks.
    store: Annotated[bool, _documented(const=False, description="Nothing is stored.")] | None = None
    metadata: Metadata | None = None
    service_tier: Annotated[str, _documented(enum=["auto", "default"])] | None = None
    modalities: list[Annotated[str, _documented(enum=["text"])]] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: Annotated[str | None, Meta(description="Accepted; prefixes are cached automatically.")] = None
    prompt_cache_retention: Annotated[str, _documented(enum=["in_memory", "in-memory"])] | None = None
    audio: _null_only("audio output is not supported.") = None
    prediction: _null_only("predicted outputs are not supported.") = None
    reasoning_effort: Annotated[str, _documented(enum=["none"])] | None = None
    verbosity: _null_only("the model's verbosity cannot be set.") = None
    web_search_options: _null_only("web search is not offered.") = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool] | None, Meta(description="Function tools (see tool_choice).")] = None
    tool_choice: Annotated[
        Literal["none", "auto", "required"] | NamedToolChoice | None,
        Meta(
            description="`auto` (the default with `tools`): text or calls in the model's tool-call format; "
            "`required` or a named function: constrained calls; `none`: text."
        ),
    ] = None
    parallel_tool_calls: bool | None = None
    functions: Annotated[list[dict[str, Any]], _documented(maxItems=0, description="Use `tools`.")] | None = None
    function_call: Annotated[Any, _documented(enum=["none", "auto", None], description="Use `tool_choice`.")] = None


class CompletionRequest(_SamplingFields, kw_only=True):
    # OpenAI takes a string, token ids, or a list of either; msgspec allows one list type per union,
    # so the list's items are checked when the prompt is encoded. PROMPT_SCHEMA states what passes; the
    # OpenAPI schema shows it in place of msgspec's looser one (app/api_docs/schema.py).
    prompt: Annotated[str | list[str | int | list[int]], Meta(description=PROMPT_DESCRIPTION)]
    max_tokens: Annotated[
        Annotated[int, _documented(minimum=0)] | None,
        Meta(
            description="Tokens to generate at most per choice; 0 only with `echo` or `prompt_logprobs` (scores the "
            "prompt)."
        ),
    ] = None
    logprobs: Annotated[
        NumLogprobs | None, Meta(description="Each generated token's log-probability and this many alternatives.")
    ] = None
    echo: bool | None = None
    suffix: Annotated[str, _documented(maxLength=0, description="Only null or empty.")] | None = None
    prompt_logprobs: Annotated[
        NumLogprobs | None, Meta(description="vLLM's: each prompt token's log-probability and this many alternatives.")
    ] = None
