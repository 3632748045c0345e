"""From a request's messages or prompt(s) to token ids, checked against the context before tokenizing.

Tokenizing takes about a microsecond a character, so a prompt is measured before it is tokenized: a
text longer than ``engine.max_prompt_chars``, or more messages than the context has tokens (each takes
at least one), cannot fit and is refused at once with ``context_length_exceeded``. A long text that
may fit is tokenized in a worker thread, so that it never stalls the event loop (and every stream on it).

Only the chat template writes special tokens: the text of one in a message or a tool is encoded as the
ordinary text it is (app/engine_clients/special_text.py). A completion's ``prompt`` is the client's whole
prompt, so the special tokens it writes are parsed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from app.engine_clients.interface import EngineClient
from app.engine_clients.special_text import Markers, SpecialTextError
from app.openai.chat.request_schemas import ChatCompletionRequest, CompletionRequest
from app.openai.chat.tool_prompts import render_messages, template_messages, template_tools
from app.openai.chat.tools import ToolPlan
from app.tool_calls.style import ChatStyle
from app.tool_calls.templates import ChatTemplate, ChatTemplateError
from app.web.errors import BadRequestError, ServiceUnavailableError

# Longer texts are tokenized in a thread: on the loop they would hold every other request far longer than the
# thread hop costs (docs/benchmarks.md#gateway-constants-and-choices).
OFF_LOOP_CHARS = 16_384


class ContextLengthError(BadRequestError):
    code = "context_length_exceeded"


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt of a request: its token ids, and its text as sent (None for token ids), for ``echo``."""

    token_ids: list[int]
    text: str | None = None


async def chat_prompt_ids(
    body: ChatCompletionRequest, engine: EngineClient, style: ChatStyle, plan: ToolPlan | None = None
) -> list[int]:
    """The conversation's prompt: by the tool template with ``auto`` tools, else by the model's chat template."""
    if not body.messages:
        raise BadRequestError("`messages` must hold at least one message.", param="messages")
    _refuse_before_loaded(engine)
    if len(body.messages) > engine.max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {engine.max_model_len} tokens, and each message takes at least "
            f"one, so {len(body.messages)} messages cannot fit. Please send fewer messages.",
            param="messages",
        )
    num_chars = sum(len(m.text().strip()) for m in body.messages)  # stripped: a template may trim around content
    _refuse_text_beyond_context(num_chars, engine, "messages")
    if plan is not None and plan.is_auto:
        template, messages, tools = style.tool_template, template_messages(body), template_tools(body)
    elif style.template is not None:
        template, messages, tools = style.template, render_messages(body, plan), None
    else:
        flattened = render_messages(body, plan)
        try:
            return await _tokenize(lambda: engine.encode_chat(flattened), num_chars)
        except SpecialTextError as error:
            raise _unrenderable(error) from None
    if style.tenant_supplied:  # its cost is the tenant's to choose: never on the loop every stream shares
        text, markers = await asyncio.to_thread(_rendered, template, messages, tools, engine)
    else:
        text, markers = _rendered(template, messages, tools, engine)
    num_chars = markers.num_chars(text)
    _refuse_text_beyond_context(num_chars, engine, "messages")
    return await _tokenize(lambda: engine.encode_rendered(text, markers), num_chars)


def _rendered(
    template: ChatTemplate, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, engine: EngineClient
) -> tuple[str, Markers]:
    """The prompt's text, and the markers that stand in it for the special tokens' texts the request held."""
    try:
        marked = engine.mark_special_text(messages, tools, template.source)
        text = template.render(marked.messages, marked.tools, special_tokens=engine.special_tokens())
    except (ChatTemplateError, SpecialTextError) as error:
        raise _unrenderable(error) from None
    return text, marked.markers


def _unrenderable(error: ChatTemplateError | SpecialTextError) -> BadRequestError:
    return BadRequestError(f"This model's chat template cannot render these messages: {error}.", param="messages")


async def completion_prompts(body: CompletionRequest, engine: EngineClient, max_prompts: int) -> list[Prompt]:
    """The request's prompts: one for a text or a list of token ids, one per item of a list of either."""
    prompt = body.prompt
    if isinstance(prompt, str) or all(isinstance(token, int) for token in prompt):
        items: list[str | list[int]] = [prompt]  # type: ignore[list-item]  # a list of ints here
    elif all(isinstance(item, str) for item in prompt) or all(isinstance(item, list) for item in prompt):
        items = list(prompt)  # type: ignore[arg-type]  # strings, or lists of ints (msgspec checked the ints)
    else:
        raise BadRequestError(
            "`prompt` must be a string, a list of token ids, or a list of strings or of token-id lists (not a mix).",
            param="prompt",
        )
    if not items:
        raise BadRequestError("`prompt` is empty; send at least one token.", param="prompt")
    if len(items) > max_prompts:
        raise BadRequestError(
            f"`prompt` holds {len(items)} prompts; at most {max_prompts} are taken per request. Send the rest in "
            "another request.",
            param="prompt",
        )
    _refuse_before_loaded(engine)
    return [await _prompt(item, engine) for item in items]


async def _prompt(item: str | list[int], engine: EngineClient) -> Prompt:
    if isinstance(item, str):
        _refuse_text_beyond_context(len(item), engine, "prompt")
        ids = await _tokenize(lambda: engine.encode_prompt(item), len(item)) if item else []
        text: str | None = item
    else:
        ids, text = list(item), None
    if any(not 0 <= token < engine.vocab_size for token in ids):
        raise BadRequestError(
            f"Token ids in `prompt` must be within [0, {engine.vocab_size}), the model's vocabulary.", param="prompt"
        )
    if not ids:
        raise BadRequestError("`prompt` is empty; send at least one token.", param="prompt")
    return Prompt(ids, text)


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
