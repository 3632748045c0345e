"""Signing in to the console over HTTP (httpx) and reading its forms' CSRF tokens, for the console's tests."""

from __future__ import annotations

import re

import httpx

from app.console.access import CSRF_FIELD

TOKEN_PATTERN = re.compile(rf'name="{CSRF_FIELD}" value="([^"]+)"')


def csrf_token(page: str) -> str:
    """The CSRF token of the first form on a console page."""
    match = TOKEN_PATTERN.search(page)
    assert match is not None, "no CSRF token on the page"
    return match.group(1)


async def sign_in(client: httpx.AsyncClient, api_key: str) -> httpx.Response:
    """Post the sign-in form as a browser would (its token from the page, its cookie kept by the client)."""
    page = await client.get("/console/sign-in")
    return await client.post("/console/sign-in", data={CSRF_FIELD: csrf_token(page.text), "api_key": api_key})


async def signed_in_token(client: httpx.AsyncClient, api_key: str) -> str:
    """Sign in and return the session's CSRF token, which every console form carries."""
    response = await sign_in(client, api_key)
    assert response.status_code == 303 and response.headers["location"] == "/console/tenants", response.text
    return csrf_token((await client.get("/console/tenants")).text)
