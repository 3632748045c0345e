"""The OpenAI-compatible routes (docs/api.md); each handler authenticates, decodes, and delegates.

Every answer to an authenticated caller, errors and streams included, carries OpenAI's ``x-ratelimit-*``
headers for the caller's limits as they stand when the answer starts.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from typing import Annotated

import msgspec
from litestar import Request, Response, get, post
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import Example
from litestar.params import Body
from litestar.response import Stream

from app.keys.authenticator import Principal
from app.keys.service import Scope
from app.openai.chat.reply_schemas import ChatCompletion, Completion, ModelList
from app.openai.chat.request_schemas import ChatCompletionRequest, CompletionRequest
from app.openai.responses.schemas import ResponseObject, ResponsesRequest
from app.services import gateway_of
from app.web.disconnect import cancel_on_disconnect
from app.web.errors import ApiError
from app.web.json_body import strict_json
from app.web.responses import ERROR_RESPONSES, ErrorBody, error_responses, request_id_of

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_DESCRIPTION = (
    "With `stream: true`: `text/event-stream`, one `data: {chunk}` event per delta of one choice (by `index`), "
    "ending in `data: [DONE]`; "
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
OPENAI_ERROR_RESPONSES = {
    **error_responses(400, 401, 403, 404, 413),
    429: ResponseSpec(
        ErrorBody,
        description="A limit of the tenant or key: `rate_limit_exceeded` (type `requests` or `tokens`; `Retry-After` "
        "says when to retry, none when the request alone is over the limit) or `insufficient_quota` (the monthly "
        "token budget)",
        generate_examples=False,
    ),
    500: ResponseSpec(
        ErrorBody,
        description="The engine failed on this request alone; the message names its request id",
        generate_examples=False,
    ),
    503: ResponseSpec(
        ErrorBody,
        description="The model is still loading, or the engine has stopped: retry later",
        generate_examples=False,
    ),
}

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
    before_request=strict_json(ChatCompletionRequest),
    responses={
        200: ResponseSpec(ChatCompletion, description="The completion (or an SSE stream)"),
        **OPENAI_ERROR_RESPONSES,
    },
)
async def chat_completions(
    request: Request, data: Annotated[ChatCompletionRequest, Body(examples=[CHAT_EXAMPLE])]
) -> Response:
    gateway = gateway_of(request)
    principal = await gateway.authenticator.authenticate(request.headers.get("authorization"), Scope.INFERENCE)
    return await _answer(request, principal, gateway.openai.chat(principal, data, request_id_of(request)))


@post(
    "/v1/completions",
    status_code=200,
    summary="Create a completion",
    description="OpenAI's legacy completions; `prompt` is a string, a list of token ids, or a list of either "
    "(several prompts, answered prompt-major then `n`). " + SSE_DESCRIPTION,
    tags=["openai"],
    before_request=strict_json(CompletionRequest),
    responses={
        200: ResponseSpec(Completion, description="The completion (or an SSE stream)"),
        **OPENAI_ERROR_RESPONSES,
    },
)
async def completions(
    request: Request, data: Annotated[CompletionRequest, Body(examples=[COMPLETION_EXAMPLE])]
) -> Response:
    gateway = gateway_of(request)
    principal = await gateway.authenticator.authenticate(request.headers.get("authorization"), Scope.INFERENCE)
    return await _answer(request, principal, gateway.openai.completion(principal, data, request_id_of(request)))


RESPONSES_EXAMPLE = Example(
    summary="Ask with the Responses API",
    value={"model": "SmolLM2-135M-Instruct", "input": "Name three colours.", "max_output_tokens": 32},
)


@post(
    "/v1/responses",
    status_code=200,
    summary="Create a response",
    description="OpenAI's Responses API: `input` a text or items (messages, `function_call`, "
    "`function_call_output`), `instructions`, `max_output_tokens`, `temperature`, `top_p`, `text.format` "
    "(json_schema, json_object), function `tools` with `tool_choice`. Stored for the tenant unless `store` is "
    "false, and continued with `previous_response_id`. With `stream: true`: `text/event-stream` of OpenAI's "
    "events, `response.created` first and `response.completed` (or `response.incomplete`) last.",
    tags=["openai"],
    before_request=strict_json(ResponsesRequest),
    responses={
        200: ResponseSpec(ResponseObject, description="The response (or an SSE stream of events)"),
        **OPENAI_ERROR_RESPONSES,
    },
)
async def responses(
    request: Request, data: Annotated[ResponsesRequest, Body(examples=[RESPONSES_EXAMPLE])]
) -> Response:
    gateway = gateway_of(request)
    principal = await gateway.authenticator.authenticate(request.headers.get("authorization"), Scope.INFERENCE)
    return await _answer(request, principal, gateway.responses.create(principal, data, request_id_of(request)))


@get(
    "/v1/models",
    summary="List models",
    description="The base model and the caller's tenant's adapters (never another tenant's).",
    tags=["openai"],
    responses=ERROR_RESPONSES,
)
async def list_models(request: Request) -> Response[ModelList]:
    gateway = gateway_of(request)
    principal = await gateway.authenticator.authenticate(request.headers.get("authorization"), Scope.INFERENCE)
    return Response(content=await gateway.openai.models(principal), headers=gateway.limiter.headers(principal))


async def _answer(
    request: Request, principal: Principal, work: Awaitable[msgspec.Struct | AsyncIterator[bytes]]
) -> Response:
    """The result of ``work`` (cancelled if the client goes away) as JSON or SSE, with the rate-limit headers."""
    limiter = gateway_of(request).limiter
    try:
        result = await cancel_on_disconnect(request, work)
    except ApiError as error:
        error.headers.update(limiter.headers(principal))
        raise
    headers = limiter.headers(principal)
    if isinstance(result, msgspec.Struct):
        return Response(content=result, headers=headers)
    return Stream(result, media_type="text/event-stream", headers=SSE_HEADERS | headers)


OPENAI_ROUTES = [chat_completions, completions, responses, list_models]
