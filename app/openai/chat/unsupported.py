"""OpenAI's parameters that ask for what this server does not offer: accepted when their value asks for
nothing, else a 400 naming the parameter and saying what is not supported.

Accepted and ignored: ``metadata``, ``user``, ``safety_identifier``, ``prompt_cache_key`` (prefixes are
cached automatically), ``stream_options.include_obfuscation`` (chunks
carry no padding). The rest below take only the values listed in their error messages.
"""

from __future__ import annotations

from app.openai.chat.request_schemas import ChatCompletionRequest, CompletionRequest
from app.web.errors import BadRequestError


def refuse_unsupported_chat(body: ChatCompletionRequest) -> None:
    if body.store:
        _refuse("store", "Storing completions is not supported; send `store: false` or leave it out.")
    if body.service_tier not in (None, "auto", "default"):
        _refuse("service_tier", f"Service tier {body.service_tier!r} is not offered; send 'auto' or 'default'.")
    if body.modalities is not None and any(modality != "text" for modality in body.modalities):
        _refuse("modalities", 'Only text output is supported; send `modalities: ["text"]` or leave it out.')
    if body.prompt_cache_retention not in (None, "in_memory", "in-memory"):
        _refuse(
            "prompt_cache_retention",
            "Only in-memory prompt caching is offered (prefixes stay while the pool has room); send 'in_memory'.",
        )
    if body.reasoning_effort not in (None, "none"):
        _refuse("reasoning_effort", "This model does not reason; send 'none' or leave `reasoning_effort` out.")
    for name, what in (
        ("audio", "Audio output is not supported"),
        ("prediction", "Predicted outputs are not supported"),
        ("verbosity", "Setting the model's verbosity is not supported"),
        ("web_search_options", "Web search is not offered"),
    ):
        if getattr(body, name) is not None:
            _refuse(name, f"{what}; leave `{name}` out or send null.")
    if body.functions:
        _refuse("functions", "The legacy `functions` are not supported; send them as `tools`.")
    if body.function_call not in (None, "none", "auto"):
        _refuse("function_call", "The legacy `function_call` is not supported; send `tool_choice`.")


def refuse_unsupported_completion(body: CompletionRequest) -> None:
    if body.suffix:
        _refuse("suffix", "Inserting text before a suffix is not supported; leave `suffix` out or send null.")


def _refuse(param: str, message: str) -> None:
    raise BadRequestError(message, param=param)
