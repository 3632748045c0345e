"""The cap on request bodies (LORAPLEX_MAX_REQUEST_KB): Litestar refuses a larger body with 413, answered here
in OpenAI's shape with the limit and what to do about it.

The cap matters because the OpenAI routes decode their JSON body before the key is checked, so without it
anyone could make the server read and parse an unbounded body. Litestar enforces it on the announced
``Content-Length`` before reading and on the bytes received, so a chunked body cannot slip past it. The
adapter upload sets no Litestar cap: it counts its bytes as they arrive against LORAPLEX_MAX_ADAPTER_MB.
"""

from __future__ import annotations

from litestar import Request, Response
from litestar.exceptions.http_exceptions import RequestEntityTooLarge

from app.web.errors import ApiError
from app.web.responses import api_error_handler

KIB = 1024


class RequestTooLargeError(ApiError):
    status = 413
    code = "request_too_large"

    def __init__(self, max_bytes: int | None) -> None:
        limit = "the server's limit" if max_bytes is None else f"the limit of {_size(max_bytes)}"
        super().__init__(
            f"The request body is larger than {limit} (LORAPLEX_MAX_REQUEST_KB); send a shorter prompt or fewer "
            "messages, or ask the operator to raise the limit."
        )


def request_too_large_handler(request: Request, error: RequestEntityTooLarge) -> Response:
    """Litestar's 413 as a typed error naming the route's limit."""
    return api_error_handler(request, RequestTooLargeError(request.route_handler.resolve_request_max_body_size()))


def _size(num_bytes: int) -> str:
    if num_bytes % KIB == 0:
        return f"{num_bytes // KIB} KiB"
    return f"{num_bytes} bytes"
