"""The chat completions, completions and models routes (docs/api.md); each handler authenticates, decodes, and
delegates to the chat service, and answers through app/openai/answers.py."""

from __future__ import annotations

from typing import Annotated

from litestar import Request, Response, get, post
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import Example
from litestar.params import Body

from app.keys.service import Scope
from app.openai.answers import OPENAI_ERROR_RESPONSES, answer
from app.openai.chat.reply_schemas import ChatCompletion, Completion, ModelList
from app.openai.chat.request_schemas import ChatCompletionRequest, CompletionRequest
from app.services import gateway_of
from app.web.json_body import strict_json
from app.web.responses import ERROR_RESPONSES, request_id_of

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
    return await answer(request, principal, gateway.openai.chat(principal, data, request_id_of(request)))


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
    return await answer(request, principal, gateway.openai.completion(principal, data, request_id_of(request)))


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


CHAT_ROUTES = [chat_completions, completions, list_models]
