"""Errors users see, in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every error the app raises on purpose is an :class:`ApiError` subclass carrying its HTTP status,
OpenAI's error type and code, and a message that says what was wrong and what to do about it.
"""

from __future__ import annotations

import math
from typing import ClassVar

SHOULD_RETRY_HEADER = "x-should-retry"  # OpenAI's client libraries retry a 429 unless it says "false"


class ApiError(Exception):
    """An error answered to the client with ``status`` and OpenAI's error body."""

    status: ClassVar[int] = 400
    type: ClassVar[str] = "invalid_request_error"
    code: ClassVar[str | None] = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code  # type: ignore[misc]  # an instance may narrow the class's default code
        self.retry_after_s: float | None = None
        """When set, the response says how long to wait: ``Retry-After`` (whole seconds) and ``retry-after-ms``."""
        self.headers: dict[str, str] = {}
        """More response headers (the rate-limit state, for the OpenAI routes)."""

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response_headers(self) -> dict[str, str]:
        headers = dict(self.headers)
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
            headers["retry-after-ms"] = str(max(1, math.ceil(self.retry_after_s * 1000)))
        return headers


class BadRequestError(ApiError):
    status = 400


class AuthenticationError(ApiError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class PermissionDeniedError(ApiError):
    status = 403
    type = "invalid_request_error"
    code = "insufficient_permissions"


class NotFoundError(ApiError):
    status = 404
    code = "not_found"


class ConflictError(ApiError):
    """The request contradicts the current state (a name already taken, a change to a deleted record)."""

    status = 409
    code = "conflict"


class ModelNotFoundError(NotFoundError):
    code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist or you do not have access to it.", param="model")


class RateLimitError(ApiError):
    """A rate or concurrency limit refused the request (429), as OpenAI's: ``type`` names what ran out.

    ``retry_after_s`` None means waiting cannot help (the request alone is over a limit): the response then
    carries ``x-should-retry: false``, which OpenAI's client libraries obey instead of retrying.
    """

    status = 429
    type = "requests"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: float | None, kind: str = "requests") -> None:
        super().__init__(message)
        self.type = kind  # type: ignore[misc]  # OpenAI's "requests" or "tokens"
        self.retry_after_s = retry_after_s
        if retry_after_s is None:
            self.headers[SHOULD_RETRY_HEADER] = "false"


class InsufficientQuotaError(ApiError):
    """The monthly token budget cannot hold the request (429); it renews ``retry_after_s`` from now."""

    status = 429
    type = "insufficient_quota"
    code = "insufficient_quota"

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.headers[SHOULD_RETRY_HEADER] = "false"  # a client retrying in seconds only gets the same answer


class ServiceUnavailableError(ApiError):
    status = 503
    type = "server_error"
    code = "service_unavailable"


class InternalError(ApiError):
    status = 500
    type = "server_error"
    code = "internal_error"
