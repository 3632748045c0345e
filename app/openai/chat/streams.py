"""The SSE streams of the two completion routes: one chunk per choice's delta, ``data: [DONE]`` last.

Each chunk carries one choice, by its ``index``; with ``n`` > 1 the choices' chunks interleave as the
engine produces them. Chat opens every choice with a chunk whose delta has the role, and closes each
with a chunk of its own that has the finish reason; completions put the finish reason on a choice's
last text chunk. With ``tool_choice: auto`` a choice's calls stream as they are written
(app/openai/chat/tool_stream.py); with ``required`` or a named function they are sent whole when the choice
ends. With ``stream_options.include_usage``, a chunk with ``usage`` and no choices comes
before ``[DONE]``. A run that fails midway ends with an error body as the last event.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator

import msgspec

from app.openai.chat.replies import CompletionPiece, Reply, assistant_message
from app.openai.chat.reply_schemas import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    Completion,
    ToolCallDelta,
    Usage,
)
from app.openai.chat.tool_stream import ToolCallStreamer
from app.tool_calls import ToolCallFormat
from app.web.errors import ApiError, ServiceUnavailableError
from engine import RequestOutput
from engine.errors import EngineDeadError, RequestError

SSE_DONE = b"data: [DONE]\n\n"

Choices = AsyncIterator[tuple[int, RequestOutput]]


def sse(chunk: msgspec.Struct) -> bytes:
    return b"data: " + msgspec.json.encode(chunk) + b"\n\n"


def _sse_error(error: Exception) -> bytes:
    api_error = error if isinstance(error, ApiError) else ServiceUnavailableError(f"The request failed: {error}.")
    return b"data: " + msgspec.json.encode(api_error.body()) + b"\n\n"


async def _chain(first: tuple[int, RequestOutput], outputs: Choices) -> Choices:
    yield first
    async for item in outputs:
        yield item


async def chat_stream(reply: Reply, first: tuple[int, RequestOutput], outputs: Choices) -> AsyncIterator[bytes]:
    def chunk(index: int, delta: ChatDelta, finish_reason: str | None, output: RequestOutput | None = None) -> bytes:
        logprobs = None if output is None else reply.chat_logprobs(output, delta=True)
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason, logprobs=logprobs)
        return sse(ChatCompletionChunk(id=reply.id, created=reply.created, model=reply.model, choices=[choice]))

    def chunks(index: int, output: RequestOutput) -> Iterator[bytes]:
        if reply.tool_plan is not None and reply.tool_plan.tool_format is not None:  # ``auto``: calls as written
            yield from auto_chunks(index, output, reply.tool_plan.tool_format)
            return
        if reply.tool_plan is not None:  # a call is whole or not at all: it is sent when its choice ends
            yield from tool_call_chunks(index, output)
            return
        if output.delta_text or (wants_logprobs and output.delta_token_ids):
            yield chunk(index, ChatDelta(content=output.delta_text), None, output)
        if output.finished:
            yield chunk(index, ChatDelta(), output.finish_reason)

    def auto_chunks(index: int, output: RequestOutput, tool_format: ToolCallFormat) -> Iterator[bytes]:
        streamer = streamers.get(index) or streamers.setdefault(index, ToolCallStreamer(tool_format))
        for delta in streamer.deltas(output.delta_text, output.finished):
            yield chunk(index, delta, None, output if delta.content else None)
        if output.finished:
            yield chunk(index, ChatDelta(), streamer.finish_reason(output.finish_reason))

    def tool_call_chunks(index: int, output: RequestOutput) -> Iterator[bytes]:
        if not output.finished:
            return
        message, finish_reason = assistant_message(reply.tool_plan, output)
        if message.tool_calls is None:
            yield chunk(index, ChatDelta(content=message.content), None)
        for number, call in enumerate(message.tool_calls or []):
            named = ToolCallDelta(number, call.id, "function", {"name": call.function.name, "arguments": ""})
            yield chunk(index, ChatDelta(tool_calls=[named]), None)
            arguments = ToolCallDelta(number, function={"arguments": call.function.arguments})
            yield chunk(index, ChatDelta(tool_calls=[arguments]), None)
        yield chunk(index, ChatDelta(), finish_reason)

    def usage_chunk(usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=reply.id, created=reply.created, model=reply.model, choices=[], usage=usage)

    for index in range(reply.shown.n * len(reply.prompts)):
        yield chunk(index, ChatDelta(role="assistant", content=""), None)
    wants_logprobs = reply.shown.logprobs is not None
    streamers: dict[int, ToolCallStreamer] = {}
    async with contextlib.aclosing(_framed(reply, first, outputs, chunks, usage_chunk)) as framed:
        async for data in framed:  # closed at once when the client goes away: the engine aborts now
            yield data


async def completion_stream(reply: Reply, first: tuple[int, RequestOutput], outputs: Choices) -> AsyncIterator[bytes]:
    pieces: dict[int, CompletionPiece] = {}

    def chunks(index: int, output: RequestOutput) -> Iterator[bytes]:
        piece = pieces.get(index) or pieces.setdefault(index, CompletionPiece(reply, index))
        choice = piece.chunk(output)
        if choice is not None:
            yield sse(Completion(id=reply.id, created=reply.created, model=reply.model, choices=[choice]))

    def usage_chunk(usage: Usage) -> Completion:
        return Completion(id=reply.id, created=reply.created, model=reply.model, choices=[], usage=usage)

    async with contextlib.aclosing(_framed(reply, first, outputs, chunks, usage_chunk)) as framed:
        async for data in framed:  # closed at once when the client goes away: the engine aborts now
            yield data


async def _framed(
    reply: Reply,
    first: tuple[int, RequestOutput],
    outputs: Choices,
    chunks: Callable[[int, RequestOutput], Iterator[bytes]],
    usage_chunk: Callable[[Usage], msgspec.Struct],
) -> AsyncIterator[bytes]:
    """Every output's ``chunks``, then the usage chunk (when asked) and ``[DONE]``; an error event ends a failed run."""
    last: dict[int, RequestOutput] = {}
    try:
        async for index, output in _chain(first, outputs):
            last[index] = output
            for data in chunks(index, output):
                yield data
    except (RequestError, EngineDeadError, ApiError) as error:
        yield _sse_error(error)
        return
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]  # a client gone: abort the sequences, meter them now
    if reply.include_usage:
        yield sse(usage_chunk(reply.usage(last)))
    yield SSE_DONE
