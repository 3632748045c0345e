"""Two `loraplex serve` processes on loopback sharing one PostgreSQL and one Redis (the multi-replica drill).

A tenant's limits hold across both gateways, not per gateway, and every request still has exactly one
usage row; an adapter uploaded, pinned or deleted through one gateway is served, reported or refused by
the other within a second. Each gateway has its own data folder and its own engine, as replicas on two machines would.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import time
from pathlib import Path

import asyncpg
import httpx
import pytest

from app.cli.admin_client import AdminClient
from app.db.database import Database
from app.db.tables import Tenant
from app.keys.secrets import generate_api_key
from app.keys.service import Scope, create_api_key
from app.model_store import resolve_model
from tests.app.served_process import served

pytestmark = pytest.mark.default_model

logger = logging.getLogger(__name__)

RPM_LIMIT = 10
NUM_RPM_REQUESTS = 30
CONCURRENCY_LIMIT = 2
GRACE_S = 10


@pytest.fixture
def gateway_envs(database_url: str, redis_url: str, data_home: Path, tmp_path: Path) -> list[dict[str, str]]:
    """The environments of gateways A and B: one database, one Redis, one key secret, two data folders."""
    env = {name: value for name, value in os.environ.items() if not name.startswith(("LORAPLEX_", "DATABASE_URL"))}
    shared = env | {
        "LORAPLEX_MODEL": str(resolve_model("default", data_home)),
        "DATABASE_URL": database_url,
        "LORAPLEX_REDIS_URL": redis_url,
        "LORAPLEX_MIGRATE": "0",
        "LORAPLEX_DEMO": "0",
        "LORAPLEX_KEY_SECRET": secrets.token_hex(32),
        "LORAPLEX_MAX_NUM_SEQS": "16",
        "LORAPLEX_POOL_MB": "256",
    }
    return [shared | {"LORAPLEX_HOME": str(tmp_path / name)} for name in ("a", "b")]


def _tenant_key(database_url: str, secret: str, name: str, **limits: int) -> str:
    async def create() -> str:
        database = Database(database_url)
        try:
            async with database.sessions() as session, session.begin():
                tenant = Tenant(name=name, **limits)
                session.add(tenant)
                await session.flush()
                _, key = await create_api_key(
                    session,
                    tenant_id=tenant.id,
                    name=f"{name}-key",
                    scopes=[Scope.INFERENCE],
                    key_secret=secret.encode(),
                )
            return key
        finally:
            await database.close()

    return asyncio.run(create())


def _usage_counts(database_url: str) -> dict[str, int]:
    async def query() -> dict[str, int]:
        connection = await asyncpg.connect(database_url)
        try:
            rows = await connection.fetch("SELECT request_id, count(*) AS n FROM usage_events GROUP BY request_id")
        finally:
            await connection.close()
        return {row["request_id"]: row["n"] for row in rows}

    return asyncio.run(query())


def _body(model: str, max_tokens: int, stream: bool = False) -> dict[str, object]:
    body: dict[str, object] = {"model": model, "prompt": "The sea is", "max_tokens": max_tokens, "temperature": 0}
    if stream:
        body |= {"stream": True, "ignore_eos": True}
    return body


async def _spread_requests(urls: list[str], key: str, model: str) -> list[httpx.Response]:
    """NUM_RPM_REQUESTS short requests, one after another, alternating between the gateways."""
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=60.0) as client:
        return [
            await client.post(f"{urls[i % 2]}/v1/completions", json=_body(model, 1), headers=headers)
            for i in range(NUM_RPM_REQUESTS)
        ]


async def _concurrency_drill(urls: list[str], key: str, model: str) -> tuple[list[int], int, int]:
    """Two long streams, one on each gateway; while both run, a third request on each gateway; then one more.

    The statuses of the two requests made while both streams ran, the status of the one after they ended,
    and how many streams ended with [DONE].
    """
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=120.0) as client:
        started = [asyncio.Event(), asyncio.Event()]

        async def stream(index: int) -> bool:
            body = _body(model, 64, stream=True)
            async with client.stream("POST", f"{urls[index]}/v1/completions", json=body, headers=headers) as response:
                assert response.status_code == 200, await response.aread()
                last = ""
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        started[index].set()
                        last = line
                return last == "data: [DONE]"

        streams = [asyncio.create_task(stream(index)) for index in (0, 1)]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 60)
        during = [
            (await client.post(f"{url}/v1/completions", json=_body(model, 1), headers=headers)).status_code
            for url in urls
        ]
        num_done = sum(await asyncio.gather(*streams))
        after = (await client.post(f"{urls[1]}/v1/completions", json=_body(model, 1), headers=headers)).status_code
        return during, after, num_done


def test_two_gateways_share_each_tenants_limits_and_bill_each_request_once(
    gateway_envs: list[dict[str, str]], database_url: str, tmp_path: Path
) -> None:
    secret = gateway_envs[0]["LORAPLEX_KEY_SECRET"]
    rpm_key = _tenant_key(database_url, secret, "rpm-tenant", rpm_limit=RPM_LIMIT)
    concurrency_key = _tenant_key(database_url, secret, "concurrency-tenant", max_concurrent=CONCURRENCY_LIMIT)
    model = Path(gateway_envs[0]["LORAPLEX_MODEL"]).name
    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(served(Path(env["LORAPLEX_HOME"]), env, GRACE_S, tmp_path / f"server-{i}.log"))
            for i, env in enumerate(gateway_envs)
        ]
        urls = [url for _, url in servers]
        replies = asyncio.run(_spread_requests(urls, rpm_key, model))
        during, after, num_done = asyncio.run(_concurrency_drill(urls, concurrency_key, model))
        for process, _ in servers:  # a clean stop writes the usage still buffered
            process.send_signal(signal.SIGTERM)
        assert [process.wait(timeout=60) for process, _ in servers] == [-signal.SIGTERM] * 2

    statuses = [reply.status_code for reply in replies]
    assert statuses.count(200) == RPM_LIMIT and statuses.count(429) == NUM_RPM_REQUESTS - RPM_LIMIT, statuses
    assert {200} == {reply.status_code for reply in replies[:RPM_LIMIT]}, "the first ten pass, on both gateways"
    assert during == [429, 429], "two streams run, one per gateway: the limit of 2 holds across both"
    assert (after, num_done) == (200, 2)

    counts = _usage_counts(database_url)
    billed = [reply.headers["x-request-id"] for reply in replies if reply.status_code == 200]
    assert all(counts.get(request_id) == 1 for request_id in billed), "one usage row per request"
    assert sum(counts.values()) == RPM_LIMIT + 3, "the refused requests never reached the engine"


PROPAGATION_S = 1.0


def _until(check, timeout_s: float = 5.0) -> float:
    """Seconds until ``check()`` holds (polled), or AssertionError after ``timeout_s``."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout_s, "the change never reached the other gateway"
        time.sleep(0.02)
    return time.monotonic() - start


def _status(url: str, key: str, model: str) -> int:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{url}/v1/completions", json=_body(model, 1), headers=headers, timeout=30).status_code


def test_adapter_changes_on_one_gateway_reach_the_other_within_a_second(
    gateway_envs: list[dict[str, str]], tenant_adapters: dict[str, Path], tmp_path: Path
) -> None:
    admin_key = generate_api_key().plaintext
    envs = [env | {"LORAPLEX_ADMIN_KEY": admin_key} for env in gateway_envs]
    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(served(Path(env["LORAPLEX_HOME"]), env, GRACE_S, tmp_path / f"server-{i}.log"))
            for i, env in enumerate(envs)
        ]
        (_, url_a), (_, url_b) = servers
        admin_a, admin_b = AdminClient(url_a, admin_key), AdminClient(url_b, admin_key)
        stack.callback(admin_a.close)
        stack.callback(admin_b.close)
        tenant = admin_a.create_tenant("adapter-drill")
        key = admin_a.create_key(tenant["id"], "drill", ["inference"])["key"]

        adapter = admin_a.upload_adapter(tenant["id"], "alpha", tenant_adapters["alpha"])
        answered_on_b = _until(lambda: _status(url_b, key, "alpha") == 200)
        home_b = Path(envs[1]["LORAPLEX_HOME"])
        assert (home_b / "adapters" / adapter["digest"]).is_dir(), "B cached the files it read from PostgreSQL"

        admin_a.pin_adapter(adapter["id"], True)
        pinned_on_b = _until(lambda: _adapter_on(admin_b, tenant["id"], adapter["id"])["pinned"])

        admin_b.delete_adapter(adapter["id"])
        gone_on_a = _until(lambda: _status(url_a, key, "alpha") == 404)

    logger.info(
        "upload on A answered on B in %.3f s, pin reported in %.3f s, delete reached A in %.3f s",
        answered_on_b,
        pinned_on_b,
        gone_on_a,
    )
    assert answered_on_b <= PROPAGATION_S, f"upload on A answered on B after {answered_on_b:.2f} s"
    assert pinned_on_b <= PROPAGATION_S, f"pin on A reported on B after {pinned_on_b:.2f} s"
    assert gone_on_a <= PROPAGATION_S, f"delete on B took {gone_on_a:.2f} s to reach A"


def _adapter_on(admin: AdminClient, tenant_id: str, adapter_id: str) -> dict:
    return next(adapter for adapter in admin.list_adapters(tenant_id) if adapter["id"] == adapter_id)
