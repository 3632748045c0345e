"""The OpenAI-compatible routes (DESIGN.md §8); each handler authenticates, decodes, and delegates."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

import msgspec
from litestar import Request, Response, get, post
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import Example
from litestar.params import Body
from litestar.response import Stream

from app.disconnect import cancel_on_disconnect
from app.keys.service import Scope
from app.openai.schemas import ChatCompletion, ChatCompletionRequest, Completion, CompletionRequest, ModelList
from app.web import ERROR_RESPONSES, gateway_of, request_id_of

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_DESCRIPTION = (
    "With `stream: true`: `text/event-stream`, one `data: {chunk}` event per delta, ending in `data: [DONE]`; "
    "with `stream_options.include_usage`, a last chunk with `usage` and no choices."
)

CHAT_EXAMPLE = Example(
    summary="Ask one of your adapters",
    value={
        "model": "pirate",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 48,
        "temperature": 0.7,
        "stream": False,
    },
)
COMPLETION_EXAMPLE = Example(
    summary="Continue a text with the base model",
    value={"model": "SmolLM2-135M-Instruct", "prompt": "The three primary colours are", "max_tokens": 16},
)


@post(
    "/v1/chat/completions",
    status_code=200,
    summary="Create a chat completion",
    description="OpenAI's chat completions, with the model's chat template. " + SSE_DESCRIPTION,
    tags=["openai"],
    responses={200: ResponseSpec(ChatCompletion, description="The completion (or an SSE stream)"), **ERROR_RESPONSES},
)
async def chat_completions(
    request: Request, data: Annotated[ChatCompletionRequest, Body(examples=[CHAT_EXAMPLE])]
) -> Response:
    gateway = gateway_of(request)
    principal = await gateway.authenticator.authenticate(request.headers.get("authorization"), Scope.INFERENCE)
    return _respond(await cancel_on_disconnect(request, gateway.openai.chat(principal, data, request_id_of(request))))


@post(
    "/v1/completions",
    status_code=200,
    summary="Create a completion",
    description="OpenAI's legacy completions; `prompt` is a string or a list of token ids. " + SSE_DESCRIPTION,
    tags=["openai"],
    responses={200: ResponseSpec(Completion, description="The completion (or an SSE stream)"), **ERROR_RESPONSES},
)
async def completions(
    request: Request, data: Annotated[CompletionRequest, Body(examples=[COMPLETION_EXAMPLE])]
) -> Response:
    gateway = gateway_of(request)
    principal = await gateway.authenticator.authenticate(request.headers.get("authorization"), Scope.INFERENCE)
    return _respond(
        await cancel_on_disconnect(request, gateway.openai.completion(principal, data, request_id_of(request)))
    )


@get(
    "/v1/models",
    summary="List models",
    description="The base model and the caller's tenant's adapters (never another tenant's).",
    tags=["openai"],
    responses=ERROR_RESPONSES,
)
async def list_models(request: Request) -> ModelList:
    gateway = gateway_of(request)
    principal = await gateway.authenticator.authenticate(request.headers.get("authorization"), Scope.INFERENCE)
    return await gateway.openai.models(principal)


def _respond(result: msgspec.Struct | AsyncIterator[bytes]) -> Response:
    if isinstance(result, msgspec.Struct):
        return Response(content=result)
    return Stream(result, media_type="text/event-stream", headers=SSE_HEADERS)


OPENAI_ROUTES = [chat_completions, completions, list_models]
