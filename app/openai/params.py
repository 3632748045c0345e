"""From an OpenAI request body to what the engine takes: prompt token ids and sampling params.

Every check here answers 400 with the parameter's name and what to send instead.

Tokenizing takes about a microsecond a character, so a prompt is measured before it is tokenized: a
text longer than ``engine.max_prompt_chars``, or more messages than the context has tokens (each takes
at least one), cannot fit and is refused at once with ``context_length_exceeded``. A long text that
may fit is tokenized in a worker thread, so that it never stalls the event loop (and every stream on it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from app.engine_client import EngineClient
from app.errors import BadRequestError, ServiceUnavailableError
from app.openai.schemas import MAX_SEED, MAX_STOP_SEQUENCES, MAX_TOKEN_ID, ChatCompletionRequest, CompletionRequest
from engine import RequestError, SamplingParams

OFF_LOOP_CHARS = 16_384  # longer texts are tokenized in a thread (~15 ms on the loop; a thread hop costs ~0.1)


class ContextLengthError(BadRequestError):
    code = "context_length_exceeded"


async def chat_prompt_ids(body: ChatCompletionRequest, engine: EngineClient) -> list[int]:
    if not body.messages:
        raise BadRequestError("`messages` must hold at least one message.", param="messages")
    _refuse_before_loaded(engine)
    if len(body.messages) > engine.max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {engine.max_model_len} tokens, and each message takes at least "
            f"one, so {len(body.messages)} messages cannot fit. Please send fewer messages.",
            param="messages",
        )
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
    # Stripped: a chat template may trim what surrounds a message's content.
    num_chars = sum(len(m["content"].strip()) for m in messages)
    _refuse_text_beyond_context(num_chars, engine, "messages")
    return await _tokenize(lambda: engine.encode_chat(messages), num_chars)


async def completion_prompt_ids(body: CompletionRequest, engine: EngineClient) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and any(not isinstance(item, int) for item in prompt):
        if len(prompt) != 1:
            raise BadRequestError(
                "Only one prompt per request is supported; send a string or a list of token ids, or send the "
                "prompts as separate requests.",
                param="prompt",
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        _refuse_before_loaded(engine)
        _refuse_text_beyond_context(len(prompt), engine, "prompt")
        ids = await _tokenize(lambda: engine.encode_prompt(prompt), len(prompt)) if prompt else []
    elif isinstance(prompt, list) and all(isinstance(token, int) for token in prompt):
        ids = list(prompt)
    else:
        raise BadRequestError("`prompt` must be a string or a list of token ids.", param="prompt")
    if any(not 0 <= token < MAX_TOKEN_ID for token in ids):
        raise BadRequestError(f"Token ids in `prompt` must be within [0, {MAX_TOKEN_ID}).", param="prompt")
    if not ids:
        raise BadRequestError("`prompt` is empty; send at least one token.", param="prompt")
    return ids


async def _tokenize(encode: Callable[[], list[int]], num_chars: int) -> list[int]:
    return encode() if num_chars < OFF_LOOP_CHARS else await asyncio.to_thread(encode)


def _refuse_before_loaded(engine: EngineClient) -> None:
    if not engine.is_ready():
        raise ServiceUnavailableError("The model is still loading; retry in a few seconds.")


def _refuse_text_beyond_context(num_chars: int, engine: EngineClient, param: str) -> None:
    if num_chars > engine.max_prompt_chars:
        raise ContextLengthError(
            f"This model's maximum context length is {engine.max_model_len} tokens, and no text of more than "
            f"{engine.max_prompt_chars} characters fits in it; your {param} holds {num_chars} characters. Please "
            f"reduce the length of the {param}.",
            param=param,
        )


def sampling_params(
    body: ChatCompletionRequest | CompletionRequest, num_prompt_tokens: int, max_model_len: int
) -> SamplingParams:
    """The engine's sampling params; 400 for n != 1, bad values, or a request longer than the context."""
    if body.n != 1:
        raise BadRequestError("Only n=1 is supported; send several requests for several choices.", param="n")
    if body.stream_options is not None and not body.stream:
        raise BadRequestError("`stream_options` is only allowed when `stream` is true.", param="stream_options")
    max_tokens, param = body.max_tokens, "max_tokens"
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        max_tokens, param = body.max_completion_tokens, "max_completion_tokens"
    room = max_model_len - num_prompt_tokens
    if max_tokens is None:
        max_tokens = room  # as vLLM: whatever room the context leaves
    if max_tokens < 1:
        raise BadRequestError(f"`{param}` must be at least 1, got {max_tokens}.", param=param)
    if num_prompt_tokens + max_tokens > max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for the "
            f"completion). Please reduce the length of the prompt or `{param}`.",
            param=param if room > 0 else "messages" if isinstance(body, ChatCompletionRequest) else "prompt",
        )
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stop) > MAX_STOP_SEQUENCES:
        raise BadRequestError(f"`stop` takes at most {MAX_STOP_SEQUENCES} sequences.", param="stop")
    if not all(stop):
        raise BadRequestError(
            "`stop` sequences must not be empty; leave out `stop` to stop only at the end.", param="stop"
        )
    if body.seed is not None and not -MAX_SEED <= body.seed <= MAX_SEED:
        raise BadRequestError("`seed` must fit in a signed 64-bit integer.", param="seed")
    for name, value, low, high in (("temperature", body.temperature, 0.0, 2.0), ("top_p", body.top_p, 0.0, 1.0)):
        if value is not None and not low <= value <= high:
            raise BadRequestError(f"`{name}` must be within [{low:g}, {high:g}], got {value}.", param=name)
    if body.top_p is not None and body.top_p == 0.0:
        raise BadRequestError("`top_p` must be greater than 0.", param="top_p")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            seed=None if body.seed is None else abs(body.seed),
            stop=stop,
        )
    except RequestError as error:
        raise BadRequestError(str(error)) from None
