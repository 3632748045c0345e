"""``/v1/responses``, stateless: a Responses request runs as the chat completion it amounts to, shaped back.

The request becomes a :class:`ChatCompletionRequest` (``instructions`` a system message first, ``input`` the
messages, ``max_output_tokens`` the token limit, ``text.format`` the response format), so tenancy, limits,
metering (endpoint ``responses``, one usage row) and structured output are the chat route's own. What a
stateless server cannot do is refused here with a 400 that says what to send instead.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec

from app.openai.replies import Reply
from app.openai.responses_schemas import (
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from app.openai.schemas import ChatCompletionRequest, ChatMessage, JsonSchemaFormat, ResponseFormat
from app.openai.tools import TOOL_NAME
from app.web.errors import ApiError, BadRequestError
from engine import RequestOutput
from engine.errors import EngineDeadError, RequestError

Choices = AsyncIterator[tuple[int, RequestOutput]]


def as_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion a Responses request asks for (after :func:`refuse_unsupported_responses`)."""
    messages = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    if isinstance(body.input, str):
        messages.append(ChatMessage(role="user", content=body.input))
    else:
        messages += [ChatMessage(role=item.role, content=item.text()) for item in body.input]
    if not messages:
        raise BadRequestError("`input` must hold at least one message.", param="input")
    return ChatCompletionRequest(
        model=body.model,
        messages=messages,
        max_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        stream=body.stream,
        response_format=_response_format(body),
    )


def refuse_unsupported_responses(body: ResponsesRequest) -> None:
    if body.store:
        raise BadRequestError("Responses are not stored; send `store: false` or leave it out.", param="store")
    if body.background:
        raise BadRequestError("Background responses are not offered; leave `background` out.", param="background")
    for name, what in (  # only null fits these
        (
            "previous_response_id",
            "Responses are not stored, so none can be continued; send the whole conversation as `input` items.",
        ),
        ("conversation", "Conversations are not stored; send the whole conversation as `input` items."),
        ("prompt", "Prompt templates are not offered; send the text as `input`."),
        ("max_tool_calls", "There are no tools on this route; leave `max_tool_calls` out."),
    ):
        if getattr(body, name) is not None:
            raise BadRequestError(what, param=name)
    if body.reasoning is not None and body.reasoning.summary is not None:
        raise BadRequestError("This model does not reason; leave `reasoning.summary` out.", param="reasoning")
    if body.tools:
        raise BadRequestError(
            "Tools (hosted or function) are not offered on /v1/responses; call functions through "
            "/v1/chat/completions with `tools` and a named or `required` `tool_choice`.",
            param="tools",
        )
    if body.include:
        raise BadRequestError("Nothing extra can be included; leave `include` out or send [].", param="include")
    for name, value, allowed in (
        ("service_tier", body.service_tier, ("auto", "default")),
        ("truncation", body.truncation, ("disabled",)),
        ("tool_choice", body.tool_choice, ("none", "auto")),
        ("reasoning", body.reasoning.effort if body.reasoning else None, ("none",)),
        ("text", body.text.verbosity if body.text else None, ("medium",)),
        ("top_logprobs", body.top_logprobs, (0,)),
    ):
        if value is not None and value not in allowed:
            raise BadRequestError(
                f"`{name}` {value!r} is not offered; send one of {list(allowed)} or leave it out.", param=name
            )
    if body.stream_options is not None and not body.stream:
        raise BadRequestError("`stream_options` is only allowed when `stream` is true.", param="stream_options")


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


class ResponseShape:
    """One response's object, as the stream builds it and as the final body carries it."""

    def __init__(self, reply: Reply, body: ResponsesRequest) -> None:
        self.reply = reply
        self.body = body
        self.id = reply.id
        self.message_id = f"msg_{reply.id.removeprefix('resp_')}"

    def response(self, output: RequestOutput | None, usage: ResponseUsage | None, status: str) -> ResponseObject:
        body = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        messages = [] if output is None else [self.message(output.text, _item_status(status))]
        text = msgspec.to_builtins(body.text) if body.text is not None else {"format": {"type": "text"}}
        return ResponseObject(
            id=self.id,
            created_at=self.reply.created,
            model=self.reply.model,
            status=status,  # type: ignore[arg-type]  # one of the literal's values
            output=messages,
            usage=usage,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            text=text,
            metadata=body.metadata or {},
            incomplete_details=incomplete,
        )

    def message(self, text: str, status: str) -> OutputMessage:
        return OutputMessage(id=self.message_id, status=status, content=[OutputText(text=text)])  # type: ignore[arg-type]

    def usage(self, last: dict[int, RequestOutput]) -> ResponseUsage:
        usage = self.reply.usage(last)
        return ResponseUsage(
            input_tokens=usage.prompt_tokens,
            input_tokens_details={"cached_tokens": usage.prompt_tokens_details["cached_tokens"]},
            output_tokens=usage.completion_tokens,
            output_tokens_details={"reasoning_tokens": 0},
            total_tokens=usage.total_tokens,
        )


def whole_response(shape: ResponseShape, last: dict[int, RequestOutput]) -> ResponseObject:
    output = last[0]
    return shape.response(output, shape.usage(last), _status(output))


async def response_events(
    shape: ResponseShape, first: tuple[int, RequestOutput], outputs: Choices
) -> AsyncIterator[bytes]:
    """OpenAI's event sequence: created, in_progress, the item and part added, text deltas, their done events,
    and completed (or incomplete) last with the usage; a failure mid-way ends with ``response.failed``."""
    numbers = itertools.count()
    part = {"output_index": 0, "content_index": 0, "item_id": shape.message_id}

    def event(kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": next(numbers), **fields}
        return f"event: {kind}\ndata: {json.dumps(_builtins(data))}\n\n".encode()

    def deltas(output: RequestOutput) -> Iterator[bytes]:
        if output.delta_text:
            yield event("response.output_text.delta", **part, delta=output.delta_text, logprobs=[])

    started = shape.response(None, None, "in_progress")
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    yield event("response.output_item.added", output_index=0, item=shape.message("", "in_progress"))
    yield event("response.content_part.added", **part, part=OutputText(text=""))
    last: dict[int, RequestOutput] = {}
    try:
        index, output = first
        last[index] = output
        for data in deltas(output):
            yield data
        async for index, output in outputs:
            last[index] = output
            for data in deltas(output):
                yield data
    except (RequestError, EngineDeadError, ApiError) as error:
        failed = shape.response(None, None, "failed")
        failed.error = {"code": "server_error", "message": str(error)}
        yield event("response.failed", response=failed)
        return
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]  # a client gone: abort the sequence, meter it now
    output = last[0]
    status = _status(output)
    yield event("response.output_text.done", **part, text=output.text, logprobs=[])
    yield event("response.content_part.done", **part, part=OutputText(text=output.text))
    yield event("response.output_item.done", output_index=0, item=shape.message(output.text, _item_status(status)))
    final = "response.incomplete" if status == "incomplete" else "response.completed"
    yield event(final, response=shape.response(output, shape.usage(last), status))


def _status(output: RequestOutput) -> str:
    return "incomplete" if output.finish_reason == "length" else "completed"


def _item_status(status: str) -> str:
    return "incomplete" if status == "incomplete" else "completed"


def _builtins(value: Any) -> Any:
    return msgspec.to_builtins(value)
