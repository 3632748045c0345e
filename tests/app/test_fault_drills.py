"""Fault drills on loopback: an engine fault in one request, the database away for 10 s, clients that vanish.

Each drill runs the real app on the real default model and a real PostgreSQL, bounded in count and time.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import pytest

from app.db.embedded import EmbeddedPostgres
from app.db.migrate import upgrade
from app.engine_clients.thread import LocalEngineClient
from engine import Engine
from engine.output.outputs import EngineStats
from tests.app.gateway_fixtures import (
    chat_body,
    gateway_client,
    make_tenant,
    on_both_engines,
    sse_events,
    usage_rows,
)
from tests.app.gateway_fixtures import test_settings as settings_on
from tests.app.live_server import LiveServer, live_server

pytestmark = pytest.mark.anyio

POISON_TOKEN = 30000  # a token id no other prompt of these drills holds
OUTAGE_S = 10.0
MIN_OUTAGE_REQUESTS = 6  # however slow the machine, this many requests run while the database is away
QUIET_WAIT_S = 15.0


def _step_engine(client: LocalEngineClient) -> Engine:
    return client.engine.engine


@pytest.fixture
def poisoned_forward(default_engine: LocalEngineClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model raises on any batch holding POISON_TOKEN, as a kernel fault tied to one request would."""
    model = _step_engine(default_engine).model
    forward = model.forward

    def faulty(batch, pool):
        if (batch.input_ids == POISON_TOKEN).any():
            raise RuntimeError("injected fault in the forward pass")
        return forward(batch, pool)

    monkeypatch.setattr(model, "forward", faulty)


async def test_an_engine_fault_fails_its_request_with_a_500_and_the_others_finish(
    gateway_settings, default_engine, poisoned_forward
) -> None:
    model = default_engine.model_name
    good = {"model": model, "prompt": [504, 2063, 314, 260], "max_tokens": 12, "temperature": 0}
    poisoned = {**good, "prompt": [504, POISON_TOKEN, 314]}
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")

        def post(body: dict) -> asyncio.Task[httpx.Response]:
            return asyncio.ensure_future(client.post("/v1/completions", json=body, headers=acme.headers))

        responses = await asyncio.gather(
            post(good), post(poisoned), post({**poisoned, "stream": True}), post(good), post({**good, "stream": True})
        )
        after = await client.post("/v1/completions", json=good, headers=acme.headers)
        rows = {row.request_id: row for row in await usage_rows(gateway)}

    ok_first, failed, failed_stream, ok_second, ok_stream = responses
    assert failed.status_code == 500
    error = failed.json()["error"]
    request_id = failed.headers["x-request-id"]
    assert error["type"] == "server_error" and error["code"] == "internal_error"
    assert request_id in error["message"] and "injected" not in error["message"], "no internals in the message"
    assert failed_stream.status_code == 500, "the fault hits the prompt, before the stream's first byte"
    assert [r.status_code for r in (ok_first, ok_second, ok_stream, after)] == [200] * 4
    answers = [r.json()["choices"][0] for r in (ok_first, ok_second, after)]
    assert answers[0] == answers[1] == answers[2], "greedy: the fault next to them changed nothing"
    events = sse_events(ok_stream.text)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == answers[0]["finish_reason"]
    assert rows[request_id].status == "error" and rows[request_id].completion_tokens == 0
    statuses = [rows[r.headers["x-request-id"]].status for r in (ok_first, ok_second, ok_stream, after)]
    assert statuses == ["ok"] * 4
    assert len(rows) == 6, "exactly one usage row per request"


async def test_an_engine_fault_mid_stream_ends_the_stream_with_an_error_event(
    gateway_settings, default_engine, monkeypatch
) -> None:
    """A fault after the first tokens: the stream ends with OpenAI's error event, the usage row says error."""
    model = _step_engine(default_engine).model
    forward = model.forward
    poisoned_prompt = [504, 2063, 314, 260, 17]

    def faulty(batch, pool):
        positions = batch.positions.tolist()
        if len(positions) == 1 and positions[0] == len(poisoned_prompt) + 3 and batch.input_ids.numel() == 1:
            raise RuntimeError("injected fault at the fourth generated token")
        return forward(batch, pool)

    monkeypatch.setattr(model, "forward", faulty)
    body = {"model": default_engine.model_name, "prompt": poisoned_prompt, "max_tokens": 12, "stream": True}
    body["temperature"] = 0
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        response = await client.post("/v1/completions", json=body, headers=acme.headers)
        (row,) = await usage_rows(gateway)
    assert response.status_code == 200
    events = sse_events(response.text)
    error = json.loads(events[-1])["error"]
    assert error["code"] == "internal_error" and row.request_id in error["message"]
    assert "[DONE]" not in events
    assert row.status == "error" and row.completion_tokens == 4


@pytest.fixture
def private_postgres() -> Iterator[Path]:
    """A data folder for a PostgreSQL this drill may stop (outside pytest's temp root, which other runs lock)."""
    with tempfile.TemporaryDirectory(prefix="loraplex-outage-drill-") as folder:
        Path(folder).chmod(0o755)
        yield Path(folder) / "pg"


async def test_the_database_away_for_10_s_cached_keys_serve_and_usage_waits(
    private_postgres, tmp_path, default_engine, tenant_adapters
) -> None:
    server = EmbeddedPostgres(private_postgres)
    url = await anyio.to_thread.run_sync(server.start)
    try:
        await anyio.to_thread.run_sync(upgrade, url)
        settings = settings_on(tmp_path, url)
        model = default_engine.model_name
        async with gateway_client(settings, default_engine) as (client, gateway):
            acme = await make_tenant(gateway, "acme", adapters={"alpha": tenant_adapters["alpha"]})
            stranger = await make_tenant(gateway, "stranger")  # a valid key never used before the outage
            request_ids: list[str] = []

            async def chat(model_name: str, key_headers: dict[str, str]) -> httpx.Response:
                response = await client.post(
                    "/v1/chat/completions", json=chat_body(model_name, max_tokens=2), headers=key_headers
                )
                if response.status_code == 200:
                    request_ids.append(response.headers["x-request-id"])
                return response

            for name in (model, "alpha"):
                assert (await chat(name, acme.headers)).status_code == 200  # the caches know the key and adapter
            await gateway.writer.flush()  # so that what is pending below is the outage's own usage

            await anyio.to_thread.run_sync(server.stop)
            outage_ends = time.monotonic() + OUTAGE_S
            during: list[httpx.Response] = []
            while time.monotonic() < outage_ends or len(during) < MIN_OUTAGE_REQUESTS:
                during.append(await chat(model, acme.headers))
                during.append(await chat("alpha", acme.headers))
                await asyncio.sleep(0.5)
            ready = await client.get("/ready")
            metrics = (await client.get("/metrics")).text
            unknown = await chat(model, stranger.headers)
            pending = gateway.writer.num_pending

            server = EmbeddedPostgres(private_postgres)
            assert await anyio.to_thread.run_sync(server.start) == url
            deadline = time.monotonic() + QUIET_WAIT_S
            while gateway.writer.num_pending and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            ready_after = await client.get("/ready")
            rows = await usage_rows(gateway)

        assert [r.status_code for r in during] == [200] * len(during), [r.text for r in during if r.status_code != 200]
        assert ready.status_code == 200 and ready.json() == {
            "status": "degraded",
            "checks": {"model": True, "database": False},
        }
        assert unknown.status_code == 503 and "database" in unknown.json()["error"]["message"]
        assert pending == len(during), "the usage of every request of the outage waited in memory"
        assert f"loraplex_usage_records_pending {float(pending)}" in metrics
        spool_bytes = float(metrics.split("\nloraplex_usage_spool_bytes ")[1].split()[0])
        assert spool_bytes > 100 * pending, "the usage of every request of the outage is on disk, not only in memory"
        assert ready_after.json()["status"] == "ready"
        assert sorted(row.request_id for row in rows) == sorted(request_ids), "each request exactly one row"
    finally:
        await anyio.to_thread.run_sync(server.stop)


@pytest.fixture
def server(gateway_settings, default_engine) -> Iterator[LiveServer]:
    with live_server(gateway_settings, default_engine) as running:
        yield running


def _pool_at_rest(stats: EngineStats) -> dict[str, int]:
    """What must come back after the clients go: no sequence, no KV page; cached prefixes count as free."""
    pages = stats.pages_by_owner
    return {
        "running": stats.num_running,
        "waiting": stats.num_waiting,
        "kv": pages.get("kv", 0),
        "adapter": pages.get("adapter", 0),
        "reusable": pages.get("free", 0) + pages.get("prefix_cache", 0),
    }


@asynccontextmanager
async def _client(url: str, timeout: float | httpx.Timeout) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        yield client


async def _hang_up_mid_stream(url: str, headers: dict[str, str], body: dict, after_events: int) -> None:
    async with (
        _client(url, 30.0) as client,
        client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}, headers=headers) as response,
    ):
        seen = 0
        async for line in response.aiter_lines():
            seen += line.startswith("data: ")
            if seen > after_events:
                return


async def _give_up_waiting(url: str, headers: dict[str, str], body: dict, after_s: float) -> None:
    """Wait ``after_s`` for the answer, then hang up. Connecting has its own 30 s: on a loaded machine 18 clients
    may wait longer than ``after_s`` to connect, and a client that never sent its request drills nothing."""
    async with _client(url, httpx.Timeout(after_s, connect=30.0)) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1/completions", json=body, headers=headers)


def _hang_up_at_once(url: str, headers: dict[str, str], body: dict) -> None:
    """Send the whole request on a raw socket and close it before any answer."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Authorization: {headers['Authorization']}\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port))) as raw:
        raw.sendall(head + payload)


@on_both_engines
def test_clients_that_disconnect_leave_the_pool_as_they_found_it(server, default_engine) -> None:
    acme = server.run(make_tenant(server.gateway, "acme"))
    baseline = _pool_at_rest(server.run(server.gateway.engine.stats()))
    body = chat_body(default_engine.model_name, "Count from one to one hundred.", max_tokens=200)
    # A raw completion of a count goes on counting: far longer than any client here waits.
    counting = {"model": default_engine.model_name, "prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 400, "temperature": 0}
    chooser = random.Random(7)

    async def clients() -> None:
        drills = []
        for index in range(18):
            kind = index % 3
            if kind == 0:
                drills.append(_hang_up_mid_stream(server.url, acme.headers, body, chooser.randint(0, 4)))
            elif kind == 1:
                drills.append(_give_up_waiting(server.url, acme.headers, counting, chooser.uniform(0.2, 1.5)))
            else:
                drills.append(anyio.to_thread.run_sync(_hang_up_at_once, server.url, acme.headers, counting))
        await asyncio.gather(*drills)

    asyncio.run(clients())
    deadline = time.monotonic() + QUIET_WAIT_S
    while (after := _pool_at_rest(server.run(server.gateway.engine.stats()))) != baseline:
        assert time.monotonic() < deadline, f"pool did not return to {baseline}: {after}"
        time.sleep(0.1)
