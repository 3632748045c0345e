"""The OpenAI endpoints' logic: validate, resolve the model, run it metered, shape the response."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec

from app.adapters.resolver import ModelResolver
from app.engine_client import EngineClient
from app.errors import ApiError, BadRequestError, ModelNotFoundError, ServiceUnavailableError
from app.keys.authenticator import Principal
from app.limits.limiter import Limiter
from app.metrics import GatewayMetrics
from app.openai import params as request_params
from app.openai.runs import Run, metered_outputs
from app.openai.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    Completion,
    CompletionChoice,
    CompletionRequest,
    ModelCard,
    ModelList,
    Usage,
)
from app.usage.writer import UsageWriter
from engine import RequestOutput
from engine.errors import EngineDeadError, RequestError, UnknownAdapterError

SSE_DONE = b"data: [DONE]\n\n"
OWNED_BY_SYSTEM = "loraplex"


@dataclass(slots=True)
class OpenAIService:
    engine: EngineClient
    resolver: ModelResolver
    writer: UsageWriter
    metrics: GatewayMetrics
    limiter: Limiter

    async def models(self, principal: Principal) -> ModelList:
        base = self.engine.model_name
        cards = [ModelCard(id=base, created=0, owned_by=OWNED_BY_SYSTEM)]
        for name, created in await self.resolver.list_adapter_names(principal.tenant_id):
            cards.append(ModelCard(id=name, created=created, owned_by=principal.tenant_name, parent=base))
        return ModelList(data=cards)

    async def chat(
        self, principal: Principal, body: ChatCompletionRequest, request_id: str
    ) -> ChatCompletion | AsyncIterator[bytes]:
        prompt_ids = await request_params.chat_prompt_ids(body, self.engine)
        first, outputs = await self._start(principal, body, prompt_ids, request_id, "chat.completions")
        completion_id, created = f"chatcmpl-{request_id}", int(time.time())
        if body.stream:
            return _chat_stream(first, outputs, completion_id, created, body.model, _include_usage(body))
        last = await _last_output(first, outputs)
        message = AssistantMessage(role="assistant", content=last.text)
        choice = ChatChoice(index=0, message=message, finish_reason=last.finish_reason)
        return ChatCompletion(id=completion_id, created=created, model=body.model, choices=[choice], usage=_usage(last))

    async def completion(
        self, principal: Principal, body: CompletionRequest, request_id: str
    ) -> Completion | AsyncIterator[bytes]:
        prompt_ids = await request_params.completion_prompt_ids(body, self.engine)
        first, outputs = await self._start(principal, body, prompt_ids, request_id, "completions")
        completion_id, created = f"cmpl-{request_id}", int(time.time())
        if body.stream:
            return _completion_stream(first, outputs, completion_id, created, body.model, _include_usage(body))
        last = await _last_output(first, outputs)
        choice = CompletionChoice(index=0, text=last.text, finish_reason=last.finish_reason)
        return Completion(id=completion_id, created=created, model=body.model, choices=[choice], usage=_usage(last))

    async def _start(
        self,
        principal: Principal,
        body: ChatCompletionRequest | CompletionRequest,
        prompt_ids: list[int],
        request_id: str,
        endpoint: str,
    ) -> tuple[RequestOutput, AsyncIterator[RequestOutput]]:
        """Resolve, check, admit and submit the run; its first output and the metered stream of the rest."""
        run = await self._prepare(principal, body, prompt_ids, request_id, endpoint)
        outputs = metered_outputs(run, self.engine, self.writer, self.metrics)
        try:
            return await _first_output(outputs, body.model), outputs
        except BaseException:
            run.admission.settle(0)  # the stream settles once started; this covers one that never started
            raise

    async def _prepare(
        self,
        principal: Principal,
        body: ChatCompletionRequest | CompletionRequest,
        prompt_ids: list[int],
        request_id: str,
        endpoint: str,
    ) -> Run:
        if not self.engine.is_ready():
            raise ServiceUnavailableError("The model is still loading; retry in a few seconds.")
        model = await self.resolver.resolve(principal.tenant_id, body.model)
        sampling = request_params.sampling_params(body, len(prompt_ids), self.engine.max_model_len)
        admission = await self.limiter.admit(principal, len(prompt_ids), sampling.max_tokens)
        return Run(request_id, endpoint, principal, model, prompt_ids, sampling, admission)


def _include_usage(body: ChatCompletionRequest | CompletionRequest) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


async def _first_output(outputs: AsyncIterator[RequestOutput], model: str) -> RequestOutput:
    """The run's first output, so that a request the engine refuses gets a 4xx before any byte is sent."""
    try:
        return await anext(outputs)
    except UnknownAdapterError:  # the adapter was removed between resolution and admission
        raise ModelNotFoundError(model) from None
    except RequestError as error:
        raise BadRequestError(str(error)) from None
    except EngineDeadError as error:
        raise ServiceUnavailableError(f"The engine stopped: {error}. Retry later.") from None


async def _last_output(first: RequestOutput, outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = first
    async for output in outputs:
        last = output
    return last


def _usage(output: RequestOutput) -> Usage:
    num_prompt, num_completion = len(output.prompt_token_ids), len(output.token_ids)
    return Usage(
        prompt_tokens=num_prompt,
        completion_tokens=num_completion,
        total_tokens=num_prompt + num_completion,
        prompt_tokens_details={"cached_tokens": output.num_cached_tokens},
    )


def _sse(chunk: msgspec.Struct) -> bytes:
    return b"data: " + msgspec.json.encode(chunk) + b"\n\n"


def _sse_error(error: Exception) -> bytes:
    api_error = error if isinstance(error, ApiError) else ServiceUnavailableError(f"The request failed: {error}.")
    return b"data: " + msgspec.json.encode(api_error.body()) + b"\n\n"


async def _chain(first: RequestOutput, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    yield first
    async for output in outputs:
        yield output


async def _chat_stream(
    first: RequestOutput,
    outputs: AsyncIterator[RequestOutput],
    completion_id: str,
    created: int,
    model: str,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    def chunk(delta: ChatDelta, finish_reason: str | None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=completion_id,
            created=created,
            model=model,
            choices=[ChatChunkChoice(index=0, delta=delta, finish_reason=finish_reason)],
        )

    yield _sse(chunk(ChatDelta(role="assistant", content=""), None))
    last = first
    try:
        async for output in _chain(first, outputs):
            last = output
            if output.delta_text:
                yield _sse(chunk(ChatDelta(content=output.delta_text), None))
    except (RequestError, EngineDeadError, ApiError) as error:
        yield _sse_error(error)
        return
    finally:
        await outputs.aclose()  # a client that went away: abort the sequence and meter it now
    yield _sse(chunk(ChatDelta(), last.finish_reason))
    if include_usage:
        yield _sse(ChatCompletionChunk(id=completion_id, created=created, model=model, choices=[], usage=_usage(last)))
    yield SSE_DONE


async def _completion_stream(
    first: RequestOutput,
    outputs: AsyncIterator[RequestOutput],
    completion_id: str,
    created: int,
    model: str,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    def chunk(text: str, finish_reason: str | None) -> Completion:
        choice = CompletionChoice(index=0, text=text, finish_reason=finish_reason)
        return Completion(id=completion_id, created=created, model=model, choices=[choice])

    last = first
    try:
        async for output in _chain(first, outputs):
            last = output
            if output.delta_text and not output.finished:
                yield _sse(chunk(output.delta_text, None))
            elif output.finished:
                yield _sse(chunk(output.delta_text, output.finish_reason))
    except (RequestError, EngineDeadError, ApiError) as error:
        yield _sse_error(error)
        return
    finally:
        await outputs.aclose()  # a client that went away: abort the sequence and meter it now
    if include_usage:
        yield _sse(Completion(id=completion_id, created=created, model=model, choices=[], usage=_usage(last)))
    yield SSE_DONE
