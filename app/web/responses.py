"""What every handler shares: the request id, JSON responses, error bodies and the error handlers."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException
from litestar.openapi.datastructures import ResponseSpec
from litestar.status_codes import HTTP_404_NOT_FOUND, HTTP_405_METHOD_NOT_ALLOWED

from app.web.errors import ApiError, InternalError

logger = logging.getLogger(__name__)

JSON = "application/json"


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(msgspec.Struct):
    """OpenAI's error shape, which every error of this API has."""

    error: ErrorDetail


ERROR_DESCRIPTIONS = {
    400: "Invalid request: `param` names the field to fix",
    401: "Missing, unknown, revoked or expired API key",
    403: "The key lacks the scope, or its tenant is disabled",
    404: "Not found, or not yours",
    409: "The request contradicts the current state: a name already taken, or a change to a deleted record",
    413: "The request body is larger than the server's limit",
}


def error_responses(*statuses: int) -> dict[int, ResponseSpec]:
    """The OpenAPI responses for these error statuses, each with the ErrorBody schema and its usual meaning."""
    return {
        status: ResponseSpec(ErrorBody, description=ERROR_DESCRIPTIONS[status], generate_examples=False)
        for status in statuses
    }


ERROR_RESPONSES = error_responses(400, 401, 403, 404)
"""The error responses every authenticated route documents in the OpenAPI schema."""


def request_id_of(request: Request) -> str:
    return request.scope["state"]["request_id"]


def json_response(body: Any, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(content=msgspec.json.encode(body), media_type=JSON, status_code=status_code, headers=headers)


def count_error(request: Request, status: int, code: str | None) -> None:
    """Count an error answer in /metrics (refused keys, oversized bodies and rate limits show up nowhere else)."""
    gateway = getattr(request.app.state, "gateway", None)
    if gateway is not None:
        gateway.metrics.errors.labels(str(status), code or "none").inc()


def api_error_handler(request: Request, error: ApiError) -> Response:
    count_error(request, error.status, error.code)
    return json_response(error.body(), error.status, error.response_headers())


def http_error_handler(request: Request, error: HTTPException) -> Response:
    """Litestar's own errors (unknown path, wrong method, a parameter that fails validation) in OpenAI's shape.

    Their headers stay: a 405 says in ``Allow`` which methods the path takes.
    """
    message, param = error.detail, None
    problems = error.extra if isinstance(error.extra, list) else []
    if problems and isinstance(problems[0], dict):
        key = problems[0].get("key")
        param = str(key) if key else None
        source = problems[0].get("source") or "body"
        details = "; ".join(str(problem.get("message", problem)) for problem in problems)
        message = f"Invalid {source} parameter `{param}`: {details}."
    elif error.status_code == HTTP_404_NOT_FOUND:
        message = f"No route matches {request.method} {request.url.path}; ids in paths are UUIDs, see /schema."
    elif error.status_code == HTTP_405_METHOD_NOT_ALLOWED:
        allowed = (error.headers or {}).get("allow", "")
        message = f"{request.method} is not allowed on {request.url.path}; it takes {allowed}."
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}
    count_error(request, error.status_code, None)
    return json_response(body, error.status_code, error.headers)


def internal_error_handler(request: Request, error: Exception) -> Response:
    """Anything unexpected: logged with its traceback, answered without it."""
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    message = f"The server had an error while processing your request (request id {request_id_of(request)})."
    count_error(request, InternalError.status, InternalError.code)
    return json_response(InternalError(message).body(), InternalError.status)
