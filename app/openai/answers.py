"""How the inference routes answer: a body as JSON or a stream as SSE, and the errors they document.

Every answer to an authenticated caller, errors and streams included, carries OpenAI's ``x-ratelimit-*``
headers for the caller's limits as they stand when the answer starts.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable

import msgspec
from litestar import Request, Response
from litestar.openapi.datastructures import ResponseSpec
from litestar.response import Stream

from app.keys.authenticator import Principal
from app.services import gateway_of
from app.web.disconnect import cancel_on_disconnect
from app.web.errors import ApiError
from app.web.responses import ErrorBody, error_responses

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

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


async def answer(
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
