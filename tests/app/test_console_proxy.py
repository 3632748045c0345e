"""Behind a TLS proxy the console's cookies are Secure: uvicorn believes the proxies LORAPLEX_FORWARDED_ALLOW_IPS
names, and the cookies follow the scheme the client saw."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from app.settings import Settings
from tests.app.live_server import live_server

FROM_THE_PROXY = {"X-Forwarded-Proto": "https", "X-Forwarded-For": "203.0.113.7"}


def _sign_in_cookie(settings: Settings, default_engine, headers: dict[str, str]) -> str:
    with live_server(settings, default_engine) as server, httpx.Client(base_url=server.url, timeout=30.0) as http:
        response = http.get("/console/sign-in", headers=headers)
    assert response.status_code == 200, response.text
    [cookie] = response.headers.get_list("set-cookie")
    return cookie


@pytest.mark.parametrize("allowed", ["127.0.0.1", "10.0.0.0/8, 127.0.0.1", "*"])
def test_cookies_are_secure_when_a_trusted_proxy_says_the_client_used_https(
    gateway_settings, default_engine, allowed: str
) -> None:
    settings = dataclasses.replace(gateway_settings, forwarded_allow_ips=allowed)
    assert "; secure" in _sign_in_cookie(settings, default_engine, FROM_THE_PROXY).lower()
    assert "; secure" not in _sign_in_cookie(settings, default_engine, {}).lower(), "plain http: not Secure"


def test_a_proxy_not_named_is_not_believed(gateway_settings, default_engine) -> None:
    settings = dataclasses.replace(gateway_settings, forwarded_allow_ips="10.9.8.7")  # the proxy, not this client
    assert "; secure" not in _sign_in_cookie(settings, default_engine, FROM_THE_PROXY).lower()
