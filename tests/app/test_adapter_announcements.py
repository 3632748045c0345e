"""Two gateway replicas on one PostgreSQL: admin changes made on one reach the other within a second.

Each replica has its own data folder and its own engine on the default model (replica B's engine is a
second one started here), so what B's engine holds shows what B applied. B also serves adapters uploaded
through A, filling its cache folder from the database.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import httpx
import pytest
from sqlalchemy import update

from app.db.tables import Adapter, ApiKey, Tenant
from app.engine_clients.thread import LocalEngineClient
from app.keys.service import Scope
from app.services import Gateway
from app.settings import Settings
from tests.app.gateway_fixtures import (
    TenantKey,
    chat_body,
    gateway_client,
    make_tenant,
    start_default_engine,
)
from tests.app.gateway_fixtures import (
    test_settings as replica_settings,
)
from tests.app.test_admin_adapters import CHAT, upload

pytestmark = pytest.mark.anyio
logger = logging.getLogger(__name__)

MAX_PROPAGATION_S = 1.0  # the documented promise: an admin change reaches every replica within a second
POLL_S = 0.005
SHARED_KEY_SECRET = "f" * 64  # replicas share LORAPLEX_KEY_SECRET, or each refuses the keys the others made


@pytest.fixture(scope="module")
def replica_engine(data_home: Path) -> Iterator[LocalEngineClient]:
    """Replica B's own engine on the default model (replica A uses the session's thread engine)."""
    client = start_default_engine(data_home)
    yield client
    asyncio.run(client.stop())


async def seconds_until(condition: Callable[[], object], since: float | None = None, timeout_s: float = 5.0) -> float:
    """Seconds from ``since`` (a ``perf_counter`` time, default now) until ``condition()`` is true.

    Checked every few milliseconds; fails past ``timeout_s``.
    """
    started = time.perf_counter() if since is None else since
    while not condition():
        if time.perf_counter() - started > timeout_s:
            raise AssertionError(f"still false after {timeout_s} s")
        await asyncio.sleep(POLL_S)
    return time.perf_counter() - started


def engine_pinned(engine: LocalEngineClient, name: str) -> bool:
    return engine.has_adapter(name) and engine.engine.engine.adapters.get(name).pinned


@dataclass(frozen=True, slots=True)
class Replicas:
    client_a: httpx.AsyncClient
    client_b: httpx.AsyncClient
    gateway_b: Gateway
    admin: TenantKey
    acme: TenantKey
    adapter: dict[str, object]
    """The adapter ``alpha`` uploaded through A, served once through B."""


@pytest.fixture
async def replicas(
    tmp_path: Path, database_url: str, default_engine, replica_engine, tenant_adapters
) -> AsyncIterator[Replicas]:
    """Replica A and replica B (each with its own data folder) on one database, ``alpha`` uploaded through A."""

    def settings(home: Path) -> Settings:
        return dataclasses.replace(replica_settings(home, database_url), key_secret=SHARED_KEY_SECRET)

    async with (
        gateway_client(settings(tmp_path / "a"), default_engine) as (client_a, gateway_a),
        gateway_client(settings(tmp_path / "b"), replica_engine) as (client_b, gateway_b),
    ):
        admin = await make_tenant(gateway_a, "admin", scopes=(Scope.ADMIN,))
        acme = await make_tenant(gateway_a, "acme")
        adapter = (await upload(client_a, admin, acme.tenant_id, "alpha", tenant_adapters["alpha"])).json()
        # B never saw the upload: its first request fills B's cache folder from the database.
        served = await client_b.post(CHAT, json=chat_body("alpha", max_tokens=1), headers=acme.headers)
        assert served.status_code == 200, served.text
        assert (gateway_b.settings.home / "adapters" / adapter["digest"]).is_dir()
        yield Replicas(client_a, client_b, gateway_b, admin, acme, adapter)


async def test_delete_on_one_replica_is_404_on_the_other_within_a_second(replicas: Replicas, replica_engine):
    r = replicas
    assert replica_engine.has_adapter(r.adapter["id"])
    asked_at = time.perf_counter()  # measured from the admin's request: an upper bound on the propagation
    assert (await r.client_a.delete(f"/admin/adapters/{r.adapter['id']}", headers=r.admin.headers)).status_code == 200
    await seconds_until(lambda: not replica_engine.has_adapter(r.adapter["id"]), asked_at)
    answer = await r.client_b.post(CHAT, json=chat_body("alpha", max_tokens=1), headers=r.acme.headers)
    elapsed = time.perf_counter() - asked_at
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "model_not_found"
    logger.info("propagated delete in %.3f s", elapsed)
    assert elapsed <= MAX_PROPAGATION_S
    await r.gateway_b.adapters.wait_for_removals(5.0)
    assert not (r.gateway_b.settings.home / "adapters" / r.adapter["digest"]).exists()  # B's cache is cleaned too


async def test_pin_and_unpin_on_one_replica_apply_on_the_other_within_a_second(replicas: Replicas, replica_engine):
    r = replicas
    url, name = f"/admin/adapters/{r.adapter['id']}", r.adapter["id"]
    assert not engine_pinned(replica_engine, name)
    asked_at = time.perf_counter()
    assert (await r.client_a.post(f"{url}/pin", headers=r.admin.headers)).json()["pinned"] is True
    elapsed = await seconds_until(lambda: engine_pinned(replica_engine, name), asked_at)
    assert (await r.client_b.get(url, headers=r.admin.headers)).json()["pinned"] is True  # from the column
    logger.info("propagated pin in %.3f s", elapsed)
    assert elapsed <= MAX_PROPAGATION_S

    asked_at = time.perf_counter()
    assert (await r.client_a.post(f"{url}/pin", json={"pinned": False}, headers=r.admin.headers)).status_code == 200
    elapsed = await seconds_until(lambda: not engine_pinned(replica_engine, name), asked_at)
    logger.info("propagated unpin in %.3f s", elapsed)
    assert elapsed <= MAX_PROPAGATION_S
    assert (await r.client_b.get(url, headers=r.admin.headers)).json()["pinned"] is False
    assert replica_engine.has_adapter(name)  # unpinned, still registered


async def test_unload_on_one_replica_unloads_the_other_within_a_second(replicas: Replicas, replica_engine):
    r = replicas
    asked_at = time.perf_counter()
    unloaded = await r.client_a.post(f"/admin/adapters/{r.adapter['id']}/unload", headers=r.admin.headers)
    assert unloaded.status_code == 200
    elapsed = await seconds_until(lambda: not replica_engine.has_adapter(r.adapter["id"]), asked_at)
    logger.info("propagated unload in %.3f s", elapsed)
    assert elapsed <= MAX_PROPAGATION_S
    again = await r.client_b.post(CHAT, json=chat_body("alpha", max_tokens=1), headers=r.acme.headers)
    assert again.status_code == 200 and replica_engine.has_adapter(r.adapter["id"])  # the next request loads it


async def test_a_replica_that_lost_its_connection_reconnects_and_catches_up(
    replicas: Replicas, replica_engine, database_url, tenant_adapters
):
    r = replicas
    beta = (await upload(r.client_a, r.admin, r.acme.tenant_id, "beta", tenant_adapters["beta"])).json()
    served = await r.client_b.post(CHAT, json=chat_body("beta", max_tokens=1), headers=r.acme.headers)
    assert served.status_code == 200
    listener = r.gateway_b.announcements
    await seconds_until(lambda: listener.backend_pid is not None)
    pid, connections = listener.backend_pid, listener.num_connections

    # Changes nobody announces, as if made while B was not listening: only a catch-up finds them.
    async with r.gateway_b.database.sessions() as session, session.begin():
        await session.execute(update(Adapter).where(Adapter.name == "alpha").values(pinned=True))
        await session.execute(update(Adapter).where(Adapter.name == "beta").values(status="deleted"))
    killer = await asyncpg.connect(database_url)
    try:
        assert await killer.fetchval("SELECT pg_terminate_backend($1)", pid)
    finally:
        await killer.close()
    killed_at = time.perf_counter()
    await seconds_until(lambda: listener.num_connections > connections)
    await seconds_until(lambda: engine_pinned(replica_engine, r.adapter["id"]))
    await seconds_until(lambda: not replica_engine.has_adapter(beta["id"]))
    elapsed = time.perf_counter() - killed_at
    logger.info("reconnected and caught up in %.3f s", elapsed)
    assert elapsed <= MAX_PROPAGATION_S
    assert listener.backend_pid not in (None, pid)
    gone = await r.client_b.post(CHAT, json=chat_body("beta", max_tokens=1), headers=r.acme.headers)
    assert gone.status_code == 404


async def test_a_replacing_upload_retires_the_old_adapter_on_the_other_replica(
    replicas: Replicas, replica_engine, tenant_adapters
):
    r = replicas
    old = r.adapter
    asked_at = time.perf_counter()
    replaced = await upload(r.client_a, r.admin, r.acme.tenant_id, "alpha", tenant_adapters["beta"], replace="true")
    assert replaced.status_code == 201, replaced.text
    elapsed = await seconds_until(lambda: not replica_engine.has_adapter(old["id"]), asked_at)
    logger.info("propagated a replacing upload in %.3f s", elapsed)
    assert elapsed <= MAX_PROPAGATION_S
    answer = await r.client_b.post(CHAT, json=chat_body("alpha", max_tokens=1), headers=r.acme.headers)
    assert answer.status_code == 200 and replica_engine.has_adapter(replaced.json()["id"])  # the new one
    assert r.gateway_b.resolver.is_retired(uuid.UUID(old["id"]))


KEY_CACHE_FOR_GOOD_S = 3600.0  # B's key cache outlives the test: only an announcement can make B drop a key


async def test_a_tenant_deleted_on_one_replica_loses_its_keys_and_adapters_on_the_other_at_once(
    replicas: Replicas, replica_engine
):
    r = replicas
    r.gateway_b.authenticator._cache_ttl_s = KEY_CACHE_FOR_GOOD_S
    served = await r.client_b.post(CHAT, json=chat_body("alpha", max_tokens=1), headers=r.acme.headers)
    assert served.status_code == 200 and replica_engine.has_adapter(r.adapter["id"])  # B caches the key now
    asked_at = time.perf_counter()
    deleted = await r.client_a.delete(f"/admin/tenants/{r.acme.tenant_id}", headers=r.admin.headers)
    assert deleted.status_code == 200, deleted.text
    elapsed = await seconds_until(lambda: not replica_engine.has_adapter(r.adapter["id"]), asked_at)
    logger.info("propagated a tenant deletion in %.3f s", elapsed)
    assert elapsed <= MAX_PROPAGATION_S
    refused = await r.client_b.post(CHAT, json=chat_body("alpha", max_tokens=1), headers=r.acme.headers)
    assert refused.status_code == 401, refused.text


async def test_a_tenant_deleted_while_a_replica_was_not_listening_is_replayed_on_reconnect(
    replicas: Replicas, replica_engine, database_url
):
    r = replicas
    r.gateway_b.authenticator._cache_ttl_s = KEY_CACHE_FOR_GOOD_S
    served = await r.client_b.post(CHAT, json=chat_body("alpha", max_tokens=1), headers=r.acme.headers)
    assert served.status_code == 200
    listener = r.gateway_b.announcements
    await seconds_until(lambda: listener.backend_pid is not None)
    pid, connections = listener.backend_pid, listener.num_connections

    # The deletion as the tables keep it, announced to nobody: only a catch-up finds it.
    async with r.gateway_b.database.sessions() as session, session.begin():
        await session.execute(
            update(ApiKey).where(ApiKey.tenant_id == r.acme.tenant_id).values(revoked_at=datetime.now(UTC))
        )
        await session.execute(update(Adapter).where(Adapter.tenant_id == r.acme.tenant_id).values(status="deleted"))
        await session.execute(update(Tenant).where(Tenant.id == r.acme.tenant_id).values(status="deleted"))
    killer = await asyncpg.connect(database_url)
    try:
        assert await killer.fetchval("SELECT pg_terminate_backend($1)", pid)
    finally:
        await killer.close()
    killed_at = time.perf_counter()
    await seconds_until(lambda: listener.num_connections > connections)
    await seconds_until(lambda: not replica_engine.has_adapter(r.adapter["id"]))
    elapsed = time.perf_counter() - killed_at
    logger.info("reconnected and replayed a tenant deletion in %.3f s", elapsed)
    assert elapsed <= MAX_PROPAGATION_S
    refused = await r.client_b.post(CHAT, json=chat_body("alpha", max_tokens=1), headers=r.acme.headers)
    assert refused.status_code == 401, refused.text
