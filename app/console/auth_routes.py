"""Signing in to the console with an admin or tenant-admin key, and signing out."""

from __future__ import annotations

import logging

from litestar import Request, Response, get, post
from litestar.response import Redirect, Template
from litestar.status_codes import HTTP_303_SEE_OTHER

from app.admin.guards import ACCESS, Access, authenticate_admin
from app.console.access import (
    CSRF_FIELD,
    PUBLIC,
    SESSION_COOKIE,
    SIGN_IN_COOKIE,
    home_of,
    session_cookie,
    session_of,
    sessions_of,
    sign_in_cookie,
)
from app.console.forms import MAX_FIELD_CHARS
from app.console.pages import render
from app.console.sessions import new_token, tokens_match
from app.web.errors import ApiError

logger = logging.getLogger(__name__)

HOME = "/console/"  # sends each key to its own start page (app/console/tenant_routes.py)


def _sign_in_page(request: Request, message: str | None, status_code: int = 200) -> Template:
    token = new_token()
    page = render(request, "sign_in.html", status_code=status_code, sign_in_token=token, message=message)
    page.set_cookie(sign_in_cookie(request, token))
    return page


@get("/sign-in", opt={PUBLIC: True}, include_in_schema=False)
async def sign_in_page(request: Request) -> Response:
    if sessions_of(request).find(request.cookies.get(SESSION_COOKIE)) is not None:
        return Redirect(HOME, status_code=HTTP_303_SEE_OTHER)
    signed_out = request.query_params.get("signed_out") is not None
    return _sign_in_page(request, "You are signed out." if signed_out else None)


@post("/sign-in", opt={PUBLIC: True}, include_in_schema=False)
async def sign_in(request: Request) -> Response:
    """A session for an admin or tenant-admin key; any other key is refused in words saying why."""
    form = await request.form()
    token = form.get(CSRF_FIELD)
    expected = request.cookies.get(SIGN_IN_COOKIE)
    if not expected or not tokens_match(expected, token if isinstance(token, str) else None):
        return _sign_in_page(
            request, "The sign-in form had expired or came from another site; enter your key again.", 403
        )
    api_key = form.get("api_key")
    if not isinstance(api_key, str) or not api_key.strip() or len(api_key) > MAX_FIELD_CHARS:
        return _sign_in_page(request, "Enter an admin or tenant-admin API key (it starts with lpx_).", 400)
    api_key = api_key.strip()
    try:
        caller = await authenticate_admin(request, f"Bearer {api_key}")
    except ApiError as error:
        logger.info("console: sign-in refused (%s)", error.code)
        return _sign_in_page(request, f"Sign-in refused: {error.message}", error.status)
    session = sessions_of(request).start(api_key)
    principal = caller.principal
    logger.info("console: key %s of tenant %s signed in", principal.key_id, principal.tenant_name)
    response = Redirect(home_of(caller), status_code=HTTP_303_SEE_OTHER)
    response.set_cookie(session_cookie(request, session))
    response.set_cookie(sign_in_cookie(request, None))
    return response


@post("/sign-out", opt={ACCESS: Access.OWN_TENANT}, include_in_schema=False)
async def sign_out(request: Request) -> Response:
    """Forget the session here (a copy of its cookie stops working too) and clear the cookie."""
    sessions_of(request).end(session_of(request).session_id)
    response = Redirect("/console/sign-in?signed_out", status_code=HTTP_303_SEE_OTHER)
    response.set_cookie(session_cookie(request, None))
    return response


AUTH_ROUTES = [sign_in_page, sign_in, sign_out]
