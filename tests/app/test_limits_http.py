"""Limits over HTTP with the real app, model and PostgreSQL: 429s, headers, a PATCH that holds, budgets, streams.

Each test runs twice: with the limits in the gateway's process, and in a real Redis (``LORAPLEX_REDIS_URL``).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from sqlalchemy import update

from app.db.tables import Tenant, UsageEvent
from app.services import Gateway
from app.settings import Settings
from tests.app import gateway_fixtures
from tests.app.gateway_fixtures import chat_body, gateway_client, make_tenant, sse_events, usage_rows
from tests.app.live_server import LiveServer, live_server
from tests.app.test_admin_tenants import PROPAGATION_S, assert_error, make_admin

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
WAIT_S = 10.0  # a hung-up stream is noticed, and its slot freed, well within this on a busy machine
DURATION = re.compile(r"^(\d+m)?(\d+(\.\d+)?s|\d+ms)$")  # OpenAI's "1m0s", "6s", "8.64s", "250ms"
REQUEST_HEADERS = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests")
TOKEN_HEADERS = ("x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens")
# A raw completion of a count goes on counting for as long as max_tokens lets it.
COUNTING = {"prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 400, "temperature": 0, "stream": True}


@pytest.fixture(params=["memory", "redis"])
def gateway_settings(request: pytest.FixtureRequest, tmp_path: Path, database_url: str) -> Settings:
    """The test settings, with the limits in this process or in the session's Redis."""
    settings = gateway_fixtures.test_settings(tmp_path, database_url)  # imported by name, pytest would collect it
    if request.param == "redis":
        settings = replace(settings, redis_url=request.getfixturevalue("redis_url"))
    return settings


async def set_tenant(gateway: Gateway, tenant_id: uuid.UUID, **fields: object) -> None:
    """Change the tenant's row directly (before its key's first request, so that no cached lookup hides it)."""
    async with gateway.database.sessions() as session, session.begin():
        await session.execute(update(Tenant).where(Tenant.id == tenant_id).values(**fields))


async def add_usage(gateway: Gateway, tenant_id: uuid.UUID, num_tokens: int, started_at: datetime) -> None:
    async with gateway.database.sessions() as session, session.begin():
        session.add(
            UsageEvent(
                request_id=uuid.uuid4().hex,
                tenant_id=tenant_id,
                model="earlier",
                prompt_tokens=num_tokens - num_tokens // 4,
                cached_prompt_tokens=0,
                completion_tokens=num_tokens // 4,
                status="ok",
                finish_reason="stop",
                started_at=started_at,
                finished_at=started_at,
            )
        )


def limit_headers(response: httpx.Response) -> dict[str, str]:
    return {name: value for name, value in response.headers.items() if name.startswith("x-ratelimit-")}


async def test_headers_on_success_and_the_429_once_the_rpm_is_spent(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        await set_tenant(gateway, acme.tenant_id, rpm_limit=3, tpm_limit=5000)
        model = default_engine.model_name

        first = await client.post(CHAT, json=chat_body(model), headers=acme.headers)
        assert first.status_code == 200, first.text
        headers = limit_headers(first)
        assert set(headers) == {*REQUEST_HEADERS, *TOKEN_HEADERS}
        assert (headers["x-ratelimit-limit-requests"], headers["x-ratelimit-remaining-requests"]) == ("3", "2")
        assert headers["x-ratelimit-limit-tokens"] == "5000"
        used = first.json()["usage"]["total_tokens"]  # answered after the run: its reservation is settled
        assert headers["x-ratelimit-remaining-tokens"] == str(5000 - used)
        assert DURATION.match(headers["x-ratelimit-reset-requests"]) and DURATION.match(
            headers["x-ratelimit-reset-tokens"]
        )

        body = chat_body(model, stream=True, stream_options={"include_usage": True}, max_tokens=6)
        stream = await client.post(CHAT, json=body, headers=acme.headers)
        assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
        headers = limit_headers(stream)
        assert headers["x-ratelimit-remaining-requests"] == "1"
        prompt_tokens = json.loads(sse_events(stream.text)[-2])["usage"]["prompt_tokens"]
        # A stream's headers leave before its end: the request still holds its prompt plus max_tokens.
        assert headers["x-ratelimit-remaining-tokens"] == str(5000 - used - prompt_tokens - 6)

        assert (await client.post(CHAT, json=chat_body(model), headers=acme.headers)).status_code == 200
        refused = await client.post(CHAT, json=chat_body(model), headers=acme.headers)
        error = assert_error(refused, 429)
        assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
        assert "Limit 3, Used 3" in error["message"]
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        assert 0 < int(refused.headers["retry-after-ms"]) <= 60_000
        headers = limit_headers(refused)
        assert set(headers) == {*REQUEST_HEADERS, *TOKEN_HEADERS}
        assert headers["x-ratelimit-remaining-requests"] == "0"
        assert len(await usage_rows(gateway)) == 3  # the refused request never reached the engine

        models = await client.get("/v1/models", headers=acme.headers)  # every OpenAI route carries them
        assert models.status_code == 200 and limit_headers(models)["x-ratelimit-remaining-requests"] == "0"

        unlimited = await make_tenant(gateway, "globex")
        answer = await client.post(CHAT, json=chat_body(model), headers=unlimited.headers)
        assert answer.status_code == 200 and limit_headers(answer) == {}


async def test_a_request_over_the_tpm_limit_is_refused_for_good(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        await set_tenant(gateway, acme.tenant_id, tpm_limit=100)
        response = await client.post(
            CHAT, json=chat_body(default_engine.model_name, max_tokens=100), headers=acme.headers
        )
        error = assert_error(response, 429)
        assert (error["type"], error["code"]) == ("tokens", "rate_limit_exceeded")
        assert "Request too large" in error["message"] and "never pass" in error["message"]
        assert "retry-after" not in response.headers and response.headers["x-should-retry"] == "false"
        assert limit_headers(response)["x-ratelimit-remaining-tokens"] == "100"
        small = await client.post(CHAT, json=chat_body(default_engine.model_name, max_tokens=4), headers=acme.headers)
        assert small.status_code == 200, small.text


async def test_a_patched_rpm_holds_within_a_second(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin, _ = await make_admin(gateway)
        acme = await make_tenant(gateway, "acme")
        await set_tenant(gateway, acme.tenant_id, rpm_limit=100)
        model = default_engine.model_name
        assert (await client.post(CHAT, json=chat_body(model), headers=acme.headers)).status_code == 200

        patched = await client.patch(f"/admin/tenants/{acme.tenant_id}", json={"rpm_limit": 1}, headers=admin.headers)
        assert patched.status_code == 200, patched.text
        deadline = time.monotonic() + PROPAGATION_S
        while limit_headers(await client.get("/v1/models", headers=acme.headers))["x-ratelimit-limit-requests"] != "1":
            assert time.monotonic() < deadline, "the new rpm limit did not hold within a second"
            await asyncio.sleep(0.05)
        refused = await client.post(CHAT, json=chat_body(model), headers=acme.headers)
        error = assert_error(refused, 429)  # the request made before the change is still in the window
        assert "Limit 1, Used 1" in error["message"]


async def test_a_key_limit_narrows_its_tenant(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin, _ = await make_admin(gateway)
        acme = await make_tenant(gateway, "acme")
        await set_tenant(gateway, acme.tenant_id, rpm_limit=10)
        created = await client.post(
            f"/admin/tenants/{acme.tenant_id}/keys", json={"name": "batch", "rpm_limit": 1}, headers=admin.headers
        )
        narrow = {"Authorization": f"Bearer {created.json()['key']}"}
        first = await client.post(CHAT, json=chat_body(default_engine.model_name), headers=narrow)
        assert first.status_code == 200 and limit_headers(first)["x-ratelimit-limit-requests"] == "1"
        error = assert_error(await client.post(CHAT, json=chat_body(default_engine.model_name), headers=narrow), 429)
        assert "this API key" in error["message"]
        other = await client.post(CHAT, json=chat_body(default_engine.model_name), headers=acme.headers)
        assert other.status_code == 200  # the tenant's other key: 2 of the tenant's 10
        assert limit_headers(other)["x-ratelimit-remaining-requests"] == "8"


async def test_the_budget_holds_across_a_restart(gateway_settings, default_engine) -> None:
    budget, headroom = 100_000, 200
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        await set_tenant(gateway, acme.tenant_id, monthly_token_budget=budget)
        now = datetime.now(UTC)
        await add_usage(gateway, acme.tenant_id, budget - headroom, now - timedelta(seconds=1))
        last_month = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0) - timedelta(seconds=1)
        await add_usage(gateway, acme.tenant_id, 10 * budget, last_month)  # another month: never counted
        first = await client.post(CHAT, json=chat_body(default_engine.model_name), headers=acme.headers)
        assert first.status_code == 200, first.text
        usage = first.json()["usage"]

    left = headroom - usage["total_tokens"]  # what a restarted gateway must know is left
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        over = chat_body(default_engine.model_name, max_tokens=left - usage["prompt_tokens"] + 1)
        refused = await client.post(CHAT, json=over, headers=acme.headers)
        error = assert_error(refused, 429)
        assert (error["type"], error["code"]) == ("insufficient_quota", "insufficient_quota")
        assert f"has used {budget - left} of its {budget} tokens" in error["message"]
        next_month = (now.replace(day=28) + timedelta(days=4)).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        assert abs(int(refused.headers["retry-after"]) - (next_month - datetime.now(UTC)).total_seconds()) < 60
        assert refused.headers["x-should-retry"] == "false"
        exactly = chat_body(default_engine.model_name, max_tokens=left - usage["prompt_tokens"])
        assert (await client.post(CHAT, json=exactly, headers=acme.headers)).status_code == 200


@pytest.fixture
def server(gateway_settings, default_engine) -> Iterator[LiveServer]:
    with live_server(gateway_settings, default_engine) as running:
        yield running


def test_the_concurrency_limit_holds_streams_until_they_end(server: LiveServer, default_engine) -> None:
    acme = server.run(make_tenant(server.gateway, "acme"))
    server.run(set_tenant(server.gateway, acme.tenant_id, max_concurrent=2))
    body = {"model": default_engine.model_name, **COUNTING}
    with httpx.Client(base_url=server.url, timeout=WAIT_S) as http:
        with (
            http.stream("POST", "/v1/completions", json=body, headers=acme.headers) as first,
            http.stream("POST", "/v1/completions", json=body, headers=acme.headers) as second,
        ):
            # Kept until the end: httpx closes the connection when a response's line iterator is dropped.
            lines = [first.iter_lines(), second.iter_lines()]
            for stream, stream_lines in zip((first, second), lines, strict=True):
                assert stream.status_code == 200
                assert next(stream_lines).startswith("data: {")  # running: its first tokens are out
            third = http.post("/v1/completions", json={**body, "stream": False}, headers=acme.headers)
            error = assert_error(third, 429)
            assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
            assert "Limit 2, Running 2" in error["message"] and third.headers["retry-after"] == "1"
        # Both clients hung up: their runs are cancelled and their slots freed.
        deadline = time.monotonic() + WAIT_S
        short = {**body, "stream": False, "max_tokens": 2}
        while (answer := http.post("/v1/completions", json=short, headers=acme.headers)).status_code == 429:
            assert time.monotonic() < deadline, answer.text
            time.sleep(0.05)
        assert answer.status_code == 200, answer.text
