"""SIGTERM during 50 concurrent streams: the real `loraplex serve` in a subprocess, on loopback.

The server must stop accepting connections at once, let the streams finish within the grace period
(or end them cleanly with an error event that says to retry when it runs out), write their usage, and
exit; after a restart every request has exactly one usage row.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import time
from pathlib import Path

import asyncpg
import httpx
import pytest

from app.db.database import Database
from app.db.tables import Tenant
from app.keys.service import Scope, create_api_key
from app.model_store import resolve_model
from tests.app.served_process import START_TIMEOUT_S, served

NUM_STREAMS = 50
PROMPT = "Write one short sentence about the sea."
# uvicorn re-raises the signal once its shutdown is complete, as a process ended by SIGTERM should.
CLEAN_EXITS = (0, -signal.SIGTERM)


async def _stream(client: httpx.AsyncClient, body: dict, key: str, started: asyncio.Queue) -> tuple[str, list[str]]:
    """The request id and the SSE data payloads of one stream; the id goes to ``started`` at the first event."""
    headers = {"Authorization": f"Bearer {key}"}
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        request_id = response.headers["x-request-id"]
        events: list[str] = []
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                if not events:
                    started.put_nowait(request_id)
                events.append(line.removeprefix("data: "))
    return request_id, events


async def _streams_through_sigterm(
    process: subprocess.Popen, url: str, key: str, model: str, max_tokens: int
) -> tuple[list[tuple[str, list[str]]], bool]:
    """Start NUM_STREAMS streams, SIGTERM the server once all have begun; their outcomes, and whether a new
    connection was refused after the signal."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    started: asyncio.Queue[str] = asyncio.Queue()
    limits = httpx.Limits(max_connections=NUM_STREAMS + 10)
    async with httpx.AsyncClient(base_url=url, timeout=120.0, limits=limits) as client:
        tasks = [asyncio.create_task(_stream(client, body, key, started)) for _ in range(NUM_STREAMS)]
        for _ in range(NUM_STREAMS):
            await asyncio.wait_for(started.get(), timeout=START_TIMEOUT_S)
        process.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)
        try:
            async with httpx.AsyncClient(base_url=url, timeout=2.0) as fresh:
                await fresh.get("/health")
            refused = False
        except httpx.ConnectError:
            refused = True
        return await asyncio.gather(*tasks), refused


def _usage_counts(database_url: str) -> dict[str, tuple[int, str]]:
    async def query() -> dict[str, tuple[int, str]]:
        connection = await asyncpg.connect(database_url)
        try:
            rows = await connection.fetch(
                "SELECT request_id, count(*) AS n, min(status) AS status FROM usage_events GROUP BY request_id"
            )
        finally:
            await connection.close()
        return {row["request_id"]: (row["n"], row["status"]) for row in rows}

    return asyncio.run(query())


def _tenant_key(database_url: str, secret: str) -> str:
    async def create() -> str:
        database = Database(database_url)
        try:
            async with database.sessions() as session, session.begin():
                tenant = Tenant(name="acme")
                session.add(tenant)
                await session.flush()
                _, key = await create_api_key(
                    session, tenant_id=tenant.id, name="acme-key", scopes=[Scope.INFERENCE], key_secret=secret.encode()
                )
            return key
        finally:
            await database.close()

    return asyncio.run(create())


@pytest.fixture
def server_env(database_url: str, data_home: Path, tmp_path: Path) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith(("LORAPLEX_", "DATABASE_URL"))}
    return env | {
        "LORAPLEX_HOME": str(tmp_path / "home"),
        "LORAPLEX_MODEL": str(resolve_model("default", data_home)),
        "DATABASE_URL": database_url,
        "LORAPLEX_MIGRATE": "0",
        "LORAPLEX_DEMO": "0",
        "LORAPLEX_KEY_SECRET": secrets.token_hex(32),
        "LORAPLEX_MAX_NUM_SEQS": str(NUM_STREAMS + 14),
        "LORAPLEX_POOL_MB": "256",
    }


def test_sigterm_during_50_streams_finishes_or_ends_them_and_bills_each_once(
    server_env: dict[str, str], database_url: str, tmp_path: Path
) -> None:
    key = _tenant_key(database_url, server_env["LORAPLEX_KEY_SECRET"])
    model = Path(server_env["LORAPLEX_MODEL"]).name
    log = tmp_path / "server.log"

    # A grace period long enough for short answers: every stream finishes.
    with served(tmp_path, server_env, grace_s=60, log=log) as (process, url):
        finished, refused = asyncio.run(_streams_through_sigterm(process, url, key, model, max_tokens=8))
        assert process.wait(timeout=90) in CLEAN_EXITS, log.read_text()[-3000:]
    assert refused, "a new connection was accepted after SIGTERM"
    for request_id, events in finished:
        assert events[-1] == "[DONE]", (request_id, events[-3:])

    # The restart, with a grace period far shorter than the answers: every stream is ended cleanly.
    with served(tmp_path, server_env, grace_s=3, log=log) as (process, url):
        counts = _usage_counts(database_url)
        assert {request_id: counts.get(request_id) for request_id, _ in finished} == {
            request_id: (1, "ok") for request_id, _ in finished
        }, "after a restart every request has exactly one usage row"
        signalled_at = time.monotonic()
        ended, refused = asyncio.run(_streams_through_sigterm(process, url, key, model, max_tokens=2000))
        assert process.wait(timeout=60) in CLEAN_EXITS, log.read_text()[-3000:]
        shutdown_s = time.monotonic() - signalled_at
    assert refused
    for request_id, events in ended:
        error = json.loads(events[-1])["error"]
        assert error["code"] == "service_unavailable" and "shutting down" in error["message"], (request_id, events[-3:])
    counts = _usage_counts(database_url)
    assert {request_id: counts.get(request_id) for request_id, _ in ended} == {
        request_id: (1, "cancelled") for request_id, _ in ended
    }
    assert shutdown_s < 60
    assert log.read_text().count("gateway stopped: usage written") == 2, "the lifespan (usage flush) ran both times"
