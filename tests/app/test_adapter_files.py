"""Adapter files live in PostgreSQL by digest; the data folder is a cache that heals itself.

On the real default model and a real PostgreSQL: an upload's files land in ``adapter_files``; with the
cache folder gone or holding other bytes, a request still answers and the folder comes back with the
uploaded bytes; the files row goes with the last live adapter that has its digest.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from sqlalchemy import delete, select, update

from app.adapters.local_cache import ensure_local
from app.db.tables import AdapterFile
from app.keys.service import Scope
from engine.errors import AdapterMismatchError, AdapterNotFoundError
from tests.app.gateway_fixtures import chat_body, gateway_client, make_tenant
from tests.app.test_admin_adapters import CHAT, upload

pytestmark = pytest.mark.anyio

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


async def files_row(gateway, digest: str) -> AdapterFile | None:
    async with gateway.database.sessions() as session:
        return await session.get(AdapterFile, digest)


async def test_upload_stores_the_files_in_postgres(gateway_settings, default_engine, tenant_adapters):
    source = tenant_adapters["alpha"]
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin = await make_tenant(gateway, "admin", scopes=(Scope.ADMIN,))
        acme = await make_tenant(gateway, "acme")
        adapter = (await upload(client, admin, acme.tenant_id, "alpha", source)).json()
        row = await files_row(gateway, adapter["digest"])
        assert row is not None
        assert row.config == (source / CONFIG).read_bytes() and row.weights == (source / WEIGHTS).read_bytes()
        assert row.size_bytes == len(row.config) + len(row.weights)


@pytest.mark.parametrize("damage", ["missing", "other bytes", "one file gone"])
async def test_a_lost_or_damaged_cache_folder_is_refilled_from_postgres(
    gateway_settings, default_engine, tenant_adapters, damage
):
    source = tenant_adapters["alpha"]
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin = await make_tenant(gateway, "admin", scopes=(Scope.ADMIN,))
        acme = await make_tenant(gateway, "acme")
        adapter = (await upload(client, admin, acme.tenant_id, "alpha", source)).json()
        unloaded = await client.post(f"/admin/adapters/{adapter['id']}/unload", headers=admin.headers)
        assert unloaded.status_code == 200 and not default_engine.has_adapter(adapter["id"])
        folder = gateway_settings.home / "adapters" / adapter["digest"]
        if damage == "missing":
            shutil.rmtree(folder)
        elif damage == "other bytes":
            weights = bytearray((folder / WEIGHTS).read_bytes())
            weights[-1] ^= 0xFF  # same size, one flipped byte in the last tensor
            (folder / WEIGHTS).write_bytes(bytes(weights))
        else:
            (folder / CONFIG).unlink()

        chat = await client.post(CHAT, json=chat_body("alpha", max_tokens=1), headers=acme.headers)
        assert chat.status_code == 200, chat.text
        assert default_engine.has_adapter(adapter["id"])
        assert (folder / CONFIG).read_bytes() == (source / CONFIG).read_bytes()
        assert (folder / WEIGHTS).read_bytes() == (source / WEIGHTS).read_bytes()


async def test_files_gone_from_the_database_and_the_cache_are_a_503_that_says_so(
    gateway_settings, default_engine, tenant_adapters
):
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin = await make_tenant(gateway, "admin", scopes=(Scope.ADMIN,))
        acme = await make_tenant(gateway, "acme")
        adapter = (await upload(client, admin, acme.tenant_id, "alpha", tenant_adapters["alpha"])).json()
        await client.post(f"/admin/adapters/{adapter['id']}/unload", headers=admin.headers)
        shutil.rmtree(gateway_settings.home / "adapters" / adapter["digest"])
        async with gateway.database.sessions() as session, session.begin():
            await session.execute(delete(AdapterFile).where(AdapterFile.digest == adapter["digest"]))

        chat = await client.post(CHAT, json=chat_body("alpha", max_tokens=1), headers=acme.headers)
    assert chat.status_code == 503, chat.text
    assert "upload the adapter again" in chat.json()["error"]["message"]


async def test_files_row_goes_with_the_last_live_adapter_of_its_digest(
    gateway_settings, default_engine, tenant_adapters
):
    source = tenant_adapters["beta"]
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin = await make_tenant(gateway, "admin", scopes=(Scope.ADMIN,))
        acme = await make_tenant(gateway, "acme")
        globex = await make_tenant(gateway, "globex")
        first = (await upload(client, admin, acme.tenant_id, "beta", source)).json()
        second = (await upload(client, admin, globex.tenant_id, "beta", source)).json()
        assert first["digest"] == second["digest"]

        assert (await client.delete(f"/admin/adapters/{first['id']}", headers=admin.headers)).status_code == 200
        await gateway.adapters.wait_for_removals(5.0)
        assert await files_row(gateway, first["digest"]) is not None  # globex's adapter still has these bytes
        assert (await client.delete(f"/admin/adapters/{second['id']}", headers=admin.headers)).status_code == 200
        await gateway.adapters.wait_for_removals(5.0)
        assert await files_row(gateway, first["digest"]) is None
        assert not (gateway_settings.home / "adapters" / first["digest"]).exists()


async def test_ensure_local_refuses_unknown_digests_and_damaged_rows(
    gateway_settings, default_engine, tenant_adapters, tmp_path: Path
):
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin = await make_tenant(gateway, "admin", scopes=(Scope.ADMIN,))
        acme = await make_tenant(gateway, "acme")
        adapter = (await upload(client, admin, acme.tenant_id, "alpha", tenant_adapters["alpha"])).json()
        digest = adapter["digest"]
        cache = tmp_path / "replica"
        with pytest.raises(AdapterNotFoundError):
            await ensure_local(gateway.database, cache, "0" * 64)
        with pytest.raises(AdapterNotFoundError):
            await ensure_local(gateway.database, cache, "../../etc")
        assert await ensure_local(gateway.database, cache, digest) == cache / "adapters" / digest

        async with gateway.database.sessions() as session, session.begin():
            await session.execute(update(AdapterFile).where(AdapterFile.digest == digest).values(config=b"{}"))
        shutil.rmtree(cache / "adapters" / digest)
        with pytest.raises(AdapterMismatchError):
            await ensure_local(gateway.database, cache, digest)
        assert not (cache / "adapters" / digest).exists()  # nothing unverified is cached
        async with gateway.database.sessions() as session:
            assert await session.scalar(select(AdapterFile.digest).where(AdapterFile.digest == digest)) == digest
