"""Rendering console pages: the shared context every template gets, redirects, and errors as pages."""

from __future__ import annotations

import logging
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException
from litestar.response import Redirect, Template
from litestar.status_codes import HTTP_303_SEE_OTHER

from app.admin.guards import CALLER_STATE
from app.console.access import (
    CSRF_FIELD,
    SESSION_COOKIE,
    SESSION_STATE,
    CsrfRefused,
    SignInRequired,
    session_cookie,
    sessions_of,
)
from app.console.forms import FormError
from app.web.errors import ApiError

logger = logging.getLogger(__name__)

HX_REDIRECT = "HX-Redirect"  # htmx follows this header with a full page load


def render(request: Request, template: str, *, status_code: int = 200, **context: Any) -> Template:
    """``template`` with the session's CSRF token, the signed-in key and the notices waiting for it.

    ``admin`` is the signed-in key (None on the sign-in page), ``tenant_scope`` the one tenant it manages (a
    tenant admin's; None for a platform admin), so pages offer only what the key may do.
    """
    session = request.state.get(SESSION_STATE)
    caller = request.state.get(CALLER_STATE)
    return Template(
        template,
        context={
            "csrf_field": CSRF_FIELD,
            "csrf_token": None if session is None else session.csrf_token,
            "admin": None if caller is None else caller.principal,
            "tenant_scope": None if caller is None else caller.tenant_scope,
            "notices": [] if session is None else session.take_notices(),
            "new_secrets": [] if session is None else session.take_secrets(),
            "path": request.url.path,
            **context,
        },
        status_code=status_code,
    )


def see_other(path: str, notice: str | None = None, request: Request | None = None) -> Redirect:
    """After a successful POST: 303 to ``path`` (Post/Redirect/Get), with ``notice`` shown there once."""
    if notice is not None and request is not None:
        request.state[SESSION_STATE].notices.append(notice)
    return Redirect(path, status_code=HTTP_303_SEE_OTHER)


def sign_in_required_handler(request: Request, error: SignInRequired) -> Response:
    """No session: to the sign-in page (a full page load when htmx asked), clearing the cookie if one was sent
    (a stale one; a request from another site carries none, and must not sign the admin out)."""
    target = "/console/sign-in"
    if request.headers.get("hx-request"):
        response: Response = Response(content=b"", status_code=204, headers={HX_REDIRECT: target})
    else:
        response = Redirect(target, status_code=HTTP_303_SEE_OTHER)
    if request.cookies.get(SESSION_COOKIE):
        response.set_cookie(session_cookie(request, None))
    return response


def csrf_refused_handler(request: Request, _: CsrfRefused) -> Template:
    return _error_page(
        request,
        403,
        "This form was refused: it did not carry this session's security token. It may have come from another "
        "site, or from a page older than your sign-in. Reload the page and try again.",
    )


def api_error_handler(request: Request, error: ApiError) -> Template:
    return _error_page(request, error.status, error.message)


def form_error_handler(request: Request, error: FormError) -> Template:
    return _error_page(request, error.status, error.message)


def http_error_handler(request: Request, error: HTTPException) -> Template:
    status = error.status_code
    message = "No console page is at this address; use the menu." if status == 404 else str(error.detail)
    return _error_page(request, status, message)


def internal_error_handler(request: Request, error: Exception) -> Template:
    logger.exception("console: unexpected error on %s %s", request.method, request.url.path, exc_info=error)
    return _error_page(request, 500, "Something went wrong on the server; the log says what. Try again.")


def _error_page(request: Request, status: int, message: str) -> Template:
    session = sessions_of(request).find(request.cookies.get(SESSION_COOKIE))
    if session is not None:
        request.state[SESSION_STATE] = session
    return render(request, "error.html", status_code=status, status=status, message=message)


CONSOLE_EXCEPTION_HANDLERS = {
    SignInRequired: sign_in_required_handler,
    CsrfRefused: csrf_refused_handler,
    ApiError: api_error_handler,
    FormError: form_error_handler,
    HTTPException: http_error_handler,
    Exception: internal_error_handler,
}
