"""The OpenAI-compatible routes (DESIGN.md §8); each handler authenticates, decodes, and delegates."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
from litestar import Request, Response, get, post
from litestar.response import Stream

from app.disconnect import cancel_on_disconnect
from app.keys.service import Scope
from app.openai.params import decode_body
from app.openai.schemas import ChatCompletionRequest, CompletionRequest
from app.web import gateway_of, json_response, request_id_of

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@post("/v1/chat/completions", status_code=200, summary="Create a chat completion", tags=["openai"])
async def chat_completions(request: Request) -> Response:
    gateway = gateway_of(request)
    principal = await gateway.authenticator.authenticate(request.headers.get("authorization"), Scope.INFERENCE)
    body = decode_body(await request.body(), ChatCompletionRequest)
    return _respond(await cancel_on_disconnect(request, gateway.openai.chat(principal, body, request_id_of(request))))


@post("/v1/completions", status_code=200, summary="Create a completion", tags=["openai"])
async def completions(request: Request) -> Response:
    gateway = gateway_of(request)
    principal = await gateway.authenticator.authenticate(request.headers.get("authorization"), Scope.INFERENCE)
    body = decode_body(await request.body(), CompletionRequest)
    return _respond(
        await cancel_on_disconnect(request, gateway.openai.completion(principal, body, request_id_of(request)))
    )


@get("/v1/models", summary="List the base model and the caller's adapters", tags=["openai"])
async def list_models(request: Request) -> Response:
    gateway = gateway_of(request)
    principal = await gateway.authenticator.authenticate(request.headers.get("authorization"), Scope.INFERENCE)
    return json_response(await gateway.openai.models(principal))


def _respond(result: msgspec.Struct | AsyncIterator[bytes]) -> Response:
    if isinstance(result, msgspec.Struct):
        return json_response(result)
    return Stream(result, media_type="text/event-stream", headers=SSE_HEADERS)


OPENAI_ROUTES = [chat_completions, completions, list_models]
