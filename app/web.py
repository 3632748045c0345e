"""What every handler shares: reaching the gateway, the request id, JSON responses, error bodies."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException
from litestar.openapi.datastructures import ResponseSpec

from app.errors import ApiError, InternalError
from app.gateway import Gateway

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


ERROR_RESPONSES = {
    400: ResponseSpec(
        ErrorBody, description="Invalid request: `param` names the field to fix", generate_examples=False
    ),
    401: ResponseSpec(ErrorBody, description="Missing, unknown, revoked or expired API key", generate_examples=False),
    403: ResponseSpec(
        ErrorBody, description="The key lacks the scope, or its tenant is disabled", generate_examples=False
    ),
    404: ResponseSpec(ErrorBody, description="Not found, or not yours", generate_examples=False),
}
"""The error responses every authenticated route documents in the OpenAPI schema."""


def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway


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
    """Litestar's own errors (unknown path, wrong method, a body that fails validation) in OpenAI's shape."""
    message, param = error.detail, None
    problems = error.extra if isinstance(error.extra, list) else []
    if problems and isinstance(problems[0], dict):
        first = problems[0]
        param = first.get("key") or None
        text = str(first.get("message", ""))
        if "`" in text and ("unknown field" in text or "missing required field" in text):
            param = text.split("`")[1]  # the field itself, not "data"
        details = "; ".join(str(problem.get("message", problem)) for problem in problems)
        message = f"Invalid request body: {details}."
        if "unknown field" in text:
            message = f"Unsupported parameter: `{param}`. This server does not support it; remove it from the request."
        elif "missing required field" in text:
            message = f"Missing required parameter: `{param}`."
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}
    count_error(request, error.status_code, None)
    return json_response(body, error.status_code)


def internal_error_handler(request: Request, error: Exception) -> Response:
    """Anything unexpected: logged with its traceback, answered without it."""
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    message = f"The server had an error while processing your request (request id {request_id_of(request)})."
    count_error(request, InternalError.status, InternalError.code)
    return json_response(InternalError(message).body(), InternalError.status)
