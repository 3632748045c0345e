"""Errors users see, in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every error the app raises on purpose is an :class:`ApiError` subclass carrying its HTTP status,
OpenAI's error type and code, and a message that says what was wrong and what to do about it.
"""

from __future__ import annotations

from typing import ClassVar


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

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


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


class ServiceUnavailableError(ApiError):
    status = 503
    type = "server_error"
    code = "service_unavailable"


class InternalError(ApiError):
    status = 500
    type = "server_error"
    code = "internal_error"
