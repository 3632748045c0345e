"""The admin API for tenants over HTTP, on a real PostgreSQL: every route, its refusals and its audit rows."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from alembic import command
from sqlalchemy import select

from app.admin.tenants.controller import TENANT_ROUTES
from app.db.migrate import alembic_config, upgrade
from app.db.tables import Adapter, ApiKey, AuditLog, Tenant
from app.services import Gateway
from tests.app.gateway_fixtures import TenantKey, chat_body, gateway_client, make_tenant, usage_rows

pytestmark = pytest.mark.anyio

PROPAGATION_S = 1.1  # the authenticator's promise (1 s) and a little slack for the request itself
TENANT_FIELDS = {
    "id",
    "name",
    "status",
    "rpm_limit",
    "tpm_limit",
    "max_concurrent",
    "monthly_token_budget",
    "fair_share_weight",
    "created_at",
}
NO_SUCH_ID = "00000000-0000-4000-8000-000000000000"


# Helpers (test_admin_keys.py uses them too) ------------------------------------------------------------------


async def make_admin(gateway: Gateway, name: str = "admin") -> tuple[TenantKey, uuid.UUID]:
    """A tenant with an admin key, and that key's id (the actor its audit rows name)."""
    admin = await make_tenant(gateway, name, scopes=("admin",))
    async with gateway.database.sessions() as session:
        key_id = await session.scalar(select(ApiKey.id).where(ApiKey.tenant_id == admin.tenant_id))
    assert key_id is not None
    return admin, key_id


async def audit_rows(gateway: Gateway) -> list[AuditLog]:
    async with gateway.database.sessions() as session:
        return list(await session.scalars(select(AuditLog).order_by(AuditLog.id)))


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    """The OpenAI-shaped error of `response`, checked for its status and (when given) the field it names."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


async def wait_for_status(client: httpx.AsyncClient, path: str, headers: dict[str, str], status: int) -> httpx.Response:
    """Call `path` until it answers `status`; fail if that takes longer than PROPAGATION_S."""
    deadline = time.monotonic() + PROPAGATION_S
    while (response := await client.get(path, headers=headers)).status_code != status:
        assert time.monotonic() < deadline, f"{path} still answered {response.status_code}: {response.text}"
        await asyncio.sleep(0.05)
    return response


async def call(client: httpx.AsyncClient, method: str, path: str, headers: dict[str, str], body: Any = None):
    return await client.request(method, path, headers=headers, json=body)


# Tests --------------------------------------------------------------------------------------------------------


async def test_create_get_and_list_tenants(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin, admin_key_id = await make_admin(gateway)
        body = {"name": "zeta", "rpm_limit": 60, "tpm_limit": 10_000, "max_concurrent": 4, "fair_share_weight": 2.5}
        response = await client.post(
            "/admin/tenants", json=body | {"monthly_token_budget": 5_000_000_000}, headers=admin.headers
        )
        assert response.status_code == 201, response.text
        zeta = response.json()
        assert set(zeta) == TENANT_FIELDS
        assert zeta | {"id": None, "created_at": None} == {
            **body,
            "id": None,
            "created_at": None,
            "status": "active",
            "monthly_token_budget": 5_000_000_000,
        }
        acme = (await client.post("/admin/tenants", json={"name": "acme"}, headers=admin.headers)).json()
        assert (acme["rpm_limit"], acme["tpm_limit"], acme["max_concurrent"], acme["monthly_token_budget"]) == (
            None,
            None,
            None,
            None,
        )
        assert acme["fair_share_weight"] == 1.0

        assert (await client.get(f"/admin/tenants/{zeta['id']}", headers=admin.headers)).json() == zeta
        listing = await client.get("/admin/tenants", headers=admin.headers)
        assert listing.status_code == 200
        assert [tenant["name"] for tenant in listing.json()["data"]] == ["acme", "admin", "zeta"]
        assert listing.json()["data"][2] == zeta

        rows = await audit_rows(gateway)
        assert [(row.action, row.target_type, row.target_id) for row in rows] == [
            ("tenant.create", "tenant", zeta["id"]),
            ("tenant.create", "tenant", acme["id"]),
        ]
        assert all(row.actor_key_id == admin_key_id for row in rows)
        assert rows[0].before is None
        assert rows[0].after == zeta


async def test_create_tenant_refuses_bad_fields_naming_them(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin, _ = await make_admin(gateway)
        cases = [
            ({"name": ""}, "name"),
            ({"name": "x" * 65}, "name"),
            ({"name": "two words"}, "name"),
            ({}, "name"),
            ({"name": "acme", "rpm_limit": -1}, "rpm_limit"),
            ({"name": "acme", "tpm_limit": -5}, "tpm_limit"),
            ({"name": "acme", "max_concurrent": -1}, "max_concurrent"),
            ({"name": "acme", "monthly_token_budget": -1}, "monthly_token_budget"),
            ({"name": "acme", "rpm_limit": 2**31}, "rpm_limit"),
            ({"name": "acme", "rpm_limit": "many"}, "rpm_limit"),
            ({"name": "acme", "colour": "blue"}, "colour"),
            ({"name": "acme", "fair_share_weight": 0}, "fair_share_weight"),
            ({"name": "acme", "fair_share_weight": 1001}, "fair_share_weight"),
        ]
        for body, param in cases:
            assert_error(await client.post("/admin/tenants", json=body, headers=admin.headers), 400, param)
        assert [
            tenant["name"] for tenant in (await client.get("/admin/tenants", headers=admin.headers)).json()["data"]
        ] == ["admin"]
        assert await audit_rows(gateway) == []


async def test_tenant_names_are_unique_among_all_tenants(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin, _ = await make_admin(gateway)
        acme = (await client.post("/admin/tenants", json={"name": "acme"}, headers=admin.headers)).json()
        globex = (await client.post("/admin/tenants", json={"name": "globex"}, headers=admin.headers)).json()

        error = assert_error(
            await client.post("/admin/tenants", json={"name": "acme"}, headers=admin.headers), 409, "name"
        )
        assert "acme" in error["message"]
        assert_error(
            await client.patch(f"/admin/tenants/{globex['id']}", json={"name": "acme"}, headers=admin.headers),
            409,
            "name",
        )
        renamed = await client.patch(f"/admin/tenants/{globex['id']}", json={"name": "initech"}, headers=admin.headers)
        assert renamed.json()["name"] == "initech"

        # A deleted tenant's name stays taken: its usage and audit history keep meaning one tenant.
        assert (await client.delete(f"/admin/tenants/{acme['id']}", headers=admin.headers)).status_code == 200
        assert_error(await client.post("/admin/tenants", json={"name": "acme"}, headers=admin.headers), 409, "name")


async def test_unknown_tenant_is_404(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin, _ = await make_admin(gateway)
        for method, body in (("GET", None), ("PATCH", {"rpm_limit": 1}), ("DELETE", None)):
            error = assert_error(await call(client, method, f"/admin/tenants/{NO_SUCH_ID}", admin.headers, body), 404)
            assert NO_SUCH_ID in error["message"]
        assert (await client.get("/admin/tenants/not-a-uuid", headers=admin.headers)).status_code == 404


async def test_patch_changes_given_fields_and_null_clears_a_limit(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin, admin_key_id = await make_admin(gateway)
        body = {"name": "acme", "rpm_limit": 60, "tpm_limit": 1000, "max_concurrent": 2, "monthly_token_budget": 9}
        acme = (await client.post("/admin/tenants", json=body, headers=admin.headers)).json()
        path = f"/admin/tenants/{acme['id']}"

        change = {"rpm_limit": None, "tpm_limit": 2000, "fair_share_weight": 2.0}
        response = await client.patch(path, json=change, headers=admin.headers)
        assert response.status_code == 200, response.text
        changed = response.json()
        assert changed == acme | change  # absent fields kept, null cleared
        assert (await client.get(path, headers=admin.headers)).json() == changed

        # No change, no audit row.
        assert (await client.patch(path, json={}, headers=admin.headers)).json() == changed
        assert (await client.patch(path, json={"tpm_limit": 2000}, headers=admin.headers)).json() == changed

        for bad, param in (
            ({"status": "deleted"}, "status"),
            ({"name": None}, "name"),
            ({"max_concurrent": -1}, "max_concurrent"),
            ({"fair_share_weight": None}, "fair_share_weight"),
            ({"fair_share_weight": -1.0}, "fair_share_weight"),
            ({"id": acme["id"]}, "id"),
        ):
            assert_error(await client.patch(path, json=bad, headers=admin.headers), 400, param)

        rows = await audit_rows(gateway)
        assert [row.action for row in rows] == ["tenant.create", "tenant.update"]
        assert (rows[1].actor_key_id, rows[1].target_id) == (admin_key_id, acme["id"])
        assert (rows[1].before, rows[1].after) == (acme, changed)


async def test_disabled_tenant_keys_are_refused_within_a_second(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin, _ = await make_admin(gateway)
        acme = await make_tenant(gateway, "acme")
        assert (await client.get("/v1/models", headers=acme.headers)).status_code == 200

        response = await client.patch(
            f"/admin/tenants/{acme.tenant_id}", json={"status": "disabled"}, headers=admin.headers
        )
        assert response.json()["status"] == "disabled"
        error = assert_error(await wait_for_status(client, "/v1/models", acme.headers, 403), 403)
        assert "disabled" in error["message"]

        await client.patch(f"/admin/tenants/{acme.tenant_id}", json={"status": "active"}, headers=admin.headers)
        await wait_for_status(client, "/v1/models", acme.headers, 200)


async def test_delete_revokes_keys_deletes_adapters_and_keeps_usage(
    gateway_settings, default_engine, tenant_adapters
) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin, admin_key_id = await make_admin(gateway)
        acme = await make_tenant(gateway, "acme", adapters={"alpha": tenant_adapters["alpha"]})
        async with gateway.database.sessions() as session:
            adapter_id = str(await session.scalar(select(Adapter.id).where(Adapter.tenant_id == acme.tenant_id)))
        response = await client.post("/v1/chat/completions", json=chat_body("alpha"), headers=acme.headers)
        assert response.status_code == 200, response.text
        assert default_engine.has_adapter(adapter_id)
        assert len(await usage_rows(gateway)) == 1
        before = (await client.get(f"/admin/tenants/{acme.tenant_id}", headers=admin.headers)).json()

        response = await client.delete(f"/admin/tenants/{acme.tenant_id}", headers=admin.headers)
        assert response.status_code == 200, response.text
        deleted = response.json()
        assert deleted == before | {"status": "deleted"}

        assert not default_engine.has_adapter(adapter_id)
        async with gateway.database.sessions() as session:
            adapter = await session.get(Adapter, uuid.UUID(adapter_id))
            assert adapter.status == "deleted"
            assert not Path(adapter.storage_path).exists()  # no other adapter shares its files
            keys = list(await session.scalars(select(ApiKey).where(ApiKey.tenant_id == acme.tenant_id)))
            assert keys and all(key.revoked_at is not None for key in keys)
            assert (await session.get(Tenant, acme.tenant_id)).status == "deleted"
        assert [row.tenant_id for row in await usage_rows(gateway)] == [acme.tenant_id]
        error = assert_error(await wait_for_status(client, "/v1/models", acme.headers, 401), 401)
        assert "revoked" in error["message"]

        # Listed only on request; still readable by id; frozen.
        names = [
            tenant["name"] for tenant in (await client.get("/admin/tenants", headers=admin.headers)).json()["data"]
        ]
        assert names == ["admin"]
        listing = await client.get("/admin/tenants", params={"include_deleted": "true"}, headers=admin.headers)
        assert [tenant["name"] for tenant in listing.json()["data"]] == ["acme", "admin"]
        assert (await client.get(f"/admin/tenants/{acme.tenant_id}", headers=admin.headers)).json() == deleted
        assert_error(
            await client.patch(f"/admin/tenants/{acme.tenant_id}", json={"status": "active"}, headers=admin.headers),
            409,
        )
        assert_error(
            await client.post(f"/admin/tenants/{acme.tenant_id}/keys", json={"name": "again"}, headers=admin.headers),
            409,
        )
        again = await client.delete(f"/admin/tenants/{acme.tenant_id}", headers=admin.headers)
        assert (again.status_code, again.json()) == (200, deleted)

        rows = await audit_rows(gateway)
        assert [row.action for row in rows] == ["tenant.delete"]  # deleting twice changed nothing the second time
        assert rows[0].actor_key_id == admin_key_id
        assert rows[0].before == before
        assert rows[0].after == deleted | {
            "revoked_key_ids": sorted(str(key.id) for key in keys),
            "deleted_adapter_ids": [adapter_id],
            "deleted_stored_responses": 0,
        }


async def test_the_admin_tenant_cannot_be_disabled_deleted_or_renamed(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin, _ = await make_admin(gateway)
        path = f"/admin/tenants/{admin.tenant_id}"
        for method, body in (("PATCH", {"status": "disabled"}), ("PATCH", {"name": "platform"}), ("DELETE", None)):
            error = assert_error(await call(client, method, path, admin.headers, body), 409)
            assert "holds the platform's admin keys" in error["message"]
        assert (await client.patch(path, json={"rpm_limit": 100}, headers=admin.headers)).status_code == 200
        assert (await client.get("/admin/tenants", headers=admin.headers)).status_code == 200
        assert [row.action for row in await audit_rows(gateway)] == ["tenant.update"]


async def test_every_tenant_route_needs_an_admin_key(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin, _ = await make_admin(gateway)
        acme = await make_tenant(gateway, "acme")  # an inference key
        tenant = f"/admin/tenants/{acme.tenant_id}"
        routes = [
            ("POST", "/admin/tenants", {"name": "globex"}),
            ("GET", "/admin/tenants", None),
            ("GET", tenant, None),
            ("PATCH", tenant, {"rpm_limit": 1}),
            ("DELETE", tenant, None),
        ]
        assert len(routes) == len(TENANT_ROUTES)
        for method, path, body in routes:
            assert_error(await call(client, method, path, {}, body), 401)
            assert_error(await call(client, method, path, {"Authorization": "Bearer nonsense"}, body), 401)
            error = assert_error(await call(client, method, path, acme.headers, body), 403)
            assert "admin" in error["message"]
            if body is not None:  # the key is checked before the body: a caller without one learns nothing of it
                assert_error(await call(client, method, path, acme.headers, {"bogus": True}), 403)
                assert_error(await call(client, method, path, {}, {"bogus": True}), 401)
        listing = await client.get("/admin/tenants", headers=admin.headers)
        assert [tenant["name"] for tenant in listing.json()["data"]] == ["acme", "admin"]
        assert (await client.get("/v1/models", headers=acme.headers)).status_code == 200
        assert await audit_rows(gateway) == []


async def test_openapi_documents_the_tenant_bodies(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, _):
        schema = (await client.get("/schema/openapi.json")).json()
        create = schema["paths"]["/admin/tenants"]["post"]
        assert create["tags"] == ["admin"] and create["summary"] and create["description"]
        body = create["requestBody"]["content"]["application/json"]["schema"]
        assert body["allOf"] == [{"$ref": "#/components/schemas/TenantCreate"}]
        assert {"name": "acme"} in body["examples"]
        assert set(schema["components"]["schemas"]["TenantOut"]["properties"]) == TENANT_FIELDS
        update = schema["paths"]["/admin/tenants/{tenant_id}"]["patch"]["requestBody"]["content"]["application/json"]
        assert update["schema"]["allOf"] == [{"$ref": "#/components/schemas/TenantUpdate"}]


def test_migration_0002_admits_deleted_tenants_and_downgrades(database_url: str) -> None:
    async def execute(statement: str) -> list[asyncpg.Record]:
        connection = await asyncpg.connect(database_url)
        try:
            return await connection.fetch(statement)
        finally:
            await connection.close()

    asyncio.run(execute("INSERT INTO tenants (id, name, status) VALUES (gen_random_uuid(), 'gone', 'deleted')"))
    command.downgrade(alembic_config(database_url), "0001")
    try:
        # The narrower check cannot hold a deleted tenant: it comes back disabled, never active.
        assert [tuple(row) for row in asyncio.run(execute("SELECT name, status FROM tenants"))] == [
            ("gone", "disabled")
        ]
        with pytest.raises(asyncpg.CheckViolationError):
            asyncio.run(execute("UPDATE tenants SET status = 'deleted'"))
    finally:
        upgrade(database_url)
    asyncio.run(execute("UPDATE tenants SET status = 'deleted'"))
    with pytest.raises(asyncpg.CheckViolationError):
        asyncio.run(execute("UPDATE tenants SET status = 'archived'"))
