"""Who may use the console: the session guard, CSRF checks, and the cookies that carry them.

Every console route but the sign-in page runs ``console_guard`` first. It finds the session named by the
``lpx_console`` cookie, checks the key it holds with the same authenticator as the admin REST API (an
`admin` or `tenant-admin` key; a revoked key or a disabled tenant ends the session within a second), on a
POST compares the form's ``csrf_token`` field (or the ``X-CSRF-Token`` header the page's scripts send) with
the session's token, and then applies the page's declared access rule, as the admin router does
(app/admin/guards.py): a tenant admin reaches its own tenant's keys, adapters and usage, and gets 404 for
another tenant's and 403 for the platform's pages. The cookie is SameSite=Strict as well, so a form posted
from another site arrives without it.
"""

from __future__ import annotations

import logging

from litestar import Request
from litestar.connection import ASGIConnection
from litestar.datastructures import Cookie
from litestar.handlers import BaseRouteHandler

from app.admin.guards import CALLER_STATE, AdminCaller, authenticate_admin, check_access, lists_methods_only
from app.console.sessions import ConsoleSession, ConsoleSessions, tokens_match
from app.web.errors import AuthenticationError, PermissionDeniedError

logger = logging.getLogger(__name__)

SESSION_COOKIE = "lpx_console"
SIGN_IN_COOKIE = "lpx_console_sign_in"  # the sign-in form's own CSRF token (double submit), before any session
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"
PUBLIC = "console_public"  # handler opt: reachable without a session (the sign-in page and form)
SESSION_STATE = "console_session"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class SignInRequired(Exception):
    """No live session: the browser is sent to the sign-in page, with ``reason`` shown there."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class CsrfRefused(Exception):
    """A POST without the session's CSRF token: answered 403 and nothing is changed."""


def sessions_of(connection: ASGIConnection) -> ConsoleSessions:
    return connection.app.state.console_sessions


def session_cookie(connection: ASGIConnection, session: ConsoleSession | None) -> Cookie:
    """The session cookie to set (``session``) or to clear (None)."""
    sessions = sessions_of(connection)
    return Cookie(
        key=SESSION_COOKIE,
        value="" if session is None else session.session_id,
        path="/console",
        max_age=0 if session is None else int(sessions.lifetime_s),
        httponly=True,
        samesite="strict",
        secure=connection.url.scheme == "https",
    )


def sign_in_cookie(connection: ASGIConnection, token: str | None) -> Cookie:
    """The sign-in form's token cookie to set (``token``) or to clear (None, once signed in)."""
    return Cookie(
        key=SIGN_IN_COOKIE,
        value=token or "",
        path="/console",
        max_age=0 if token is None else int(sessions_of(connection).lifetime_s),
        httponly=True,
        samesite="strict",
        secure=connection.url.scheme == "https",
    )


async def console_guard(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
    """Litestar guard of every console route: a live session, its CSRF token on a POST, the page's access rule."""
    if handler.opt.get(PUBLIC) or lists_methods_only(handler):
        return
    sessions = sessions_of(connection)
    session = sessions.find(connection.cookies.get(SESSION_COOKIE))
    if session is None:
        raise SignInRequired("Sign in with an admin or tenant-admin key to use the console.")
    try:
        caller = await authenticate_admin(connection, f"Bearer {session.api_key}")
    except (AuthenticationError, PermissionDeniedError) as error:
        sessions.end(session.session_id)
        raise SignInRequired(f"Your session ended: {error.message}") from None
    method = connection.scope["method"]  # type: ignore[typeddict-item]  # console routes are HTTP routes
    if method not in SAFE_METHODS and not await _csrf_ok(connection, session):
        logger.warning("console: refused a %s to %s without its CSRF token", method, connection.url.path)
        raise CsrfRefused
    connection.state[SESSION_STATE] = session
    connection.state[CALLER_STATE] = caller
    await check_access(connection, handler, caller)


async def _csrf_ok(connection: ASGIConnection, session: ConsoleSession) -> bool:
    header = connection.headers.get(CSRF_HEADER)
    if header is not None:
        return tokens_match(session.csrf_token, header)
    if not isinstance(connection, Request) or not connection.content_type[0].startswith("application/x-www-form"):
        return False
    form = await connection.form()
    value = form.get(CSRF_FIELD)
    return tokens_match(session.csrf_token, value if isinstance(value, str) else None)


def session_of(request: Request) -> ConsoleSession:
    return request.state[SESSION_STATE]


def home_of(caller: AdminCaller) -> str:
    """Where the console opens: the tenants for a platform admin, its own tenant's keys for a tenant admin."""
    return "/console/tenants" if caller.tenant_scope is None else f"/console/tenants/{caller.tenant_scope}/keys"
