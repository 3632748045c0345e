"""The admin API for keys over HTTP, and the first admin key: issue, list, revoke, rotate, audit, no secret leaks."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import any_, select

from app.admin.keys.controller import KEY_ROUTES
from app.admin.keys.first_admin import AdminKeyError, create_admin_key, ensure_admin_key
from app.db.database import Database
from app.db.tables import ApiKey, Tenant
from app.gateway import run_gateway
from app.keys.secrets import PREFIX_LENGTH, generate_api_key, hash_api_key
from tests.app.gateway_fixtures import gateway_client, make_tenant
from tests.app.test_admin_tenants import NO_SUCH_ID, assert_error, audit_rows, call, make_admin, wait_for_status

pytestmark = pytest.mark.anyio

LIMIT_FIELDS = {"rpm_limit", "tpm_limit", "max_concurrent", "monthly_token_budget"}
KEY_FIELDS = {
    "id",
    "tenant_id",
    "name",
    "prefix",
    "scopes",
    "created_at",
    "expires_at",
    "revoked_at",
    "last_used_at",
    *LIMIT_FIELDS,
}
CREATED_FIELDS = KEY_FIELDS - {"revoked_at", "last_used_at"} | {"key"}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def secret_part(plaintext: str) -> str:
    """The part after ``lpx_<id>_`` (it may hold `_` itself, so not a split on the last one)."""
    return plaintext[PREFIX_LENGTH + 1 :]


async def test_created_key_works_and_is_shown_once(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin, admin_key_id = await make_admin(gateway)
        acme = await make_tenant(gateway, "acme")
        response = await client.post(
            f"/admin/tenants/{acme.tenant_id}/keys", json={"name": "backend"}, headers=admin.headers
        )
        assert response.status_code == 201, response.text
        created = response.json()
        assert set(created) == CREATED_FIELDS
        assert (created["tenant_id"], created["name"], created["scopes"], created["expires_at"]) == (
            str(acme.tenant_id),
            "backend",
            ["inference"],
            None,
        )
        plaintext = created["key"]
        assert plaintext.startswith(created["prefix"] + "_")
        models = await client.get("/v1/models", headers=bearer(plaintext))
        assert models.status_code == 200, models.text

        listing = await client.get(f"/admin/tenants/{acme.tenant_id}/keys", headers=admin.headers)
        assert listing.status_code == 200
        keys = listing.json()["data"]
        assert [key["name"] for key in keys] == ["acme-key", "backend"]
        assert all(set(key) == KEY_FIELDS for key in keys)
        assert keys[1] | {"revoked_at": None, "last_used_at": None} == {
            field: value for field, value in created.items() if field != "key"
        } | {"revoked_at": None, "last_used_at": None}
        async with gateway.database.sessions() as session:
            stored_hash = await session.scalar(select(ApiKey.secret_hash).where(ApiKey.id == uuid.UUID(created["id"])))
        assert stored_hash == hash_api_key(gateway.key_secret, plaintext)

        rows = await audit_rows(gateway)
        assert [(row.action, row.target_type, row.target_id, row.actor_key_id) for row in rows] == [
            ("key.create", "api_key", created["id"], admin_key_id)
        ]
        assert rows[0].before is None
        assert rows[0].after["prefix"] == created["prefix"]
        for text in (listing.text, json.dumps(rows[0].after)):
            assert secret_part(plaintext) not in text
            assert stored_hash.hex() not in text
            assert "secret" not in text and "hash" not in text


async def test_key_scopes_and_expiry(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin, _ = await make_admin(gateway)
        acme = await make_tenant(gateway, "acme")
        path = f"/admin/tenants/{acme.tenant_id}/keys"
        expires_at = (datetime.now(UTC) + timedelta(days=30)).replace(microsecond=0)
        body = {"name": "both", "scopes": ["tenant-admin", "inference"], "expires_at": expires_at.isoformat()}
        created = (await client.post(path, json=body, headers=admin.headers)).json()
        assert created["scopes"] == ["inference", "tenant-admin"]
        assert datetime.fromisoformat(created["expires_at"]) == expires_at
        assert (await client.get("/v1/models", headers=bearer(created["key"]))).status_code == 200
        assert (await client.get(path, headers=bearer(created["key"]))).status_code == 200

        own = f"/admin/tenants/{admin.tenant_id}/keys"
        admin_only = (await client.post(own, json={"name": "ops", "scopes": ["admin"]}, headers=admin.headers)).json()
        assert (await client.get("/admin/tenants", headers=bearer(admin_only["key"]))).status_code == 200
        assert_error(await client.get("/v1/models", headers=bearer(admin_only["key"])), 403)


async def test_create_key_refuses_bad_fields_naming_them(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin, _ = await make_admin(gateway)
        acme = await make_tenant(gateway, "acme")
        path = f"/admin/tenants/{acme.tenant_id}/keys"
        past = (datetime.now(UTC) - timedelta(minutes=1)).isoformat()
        cases = [
            ({"name": ""}, "name"),
            ({"name": "k" * 129}, "name"),
            ({}, "name"),
            ({"name": "k", "scopes": []}, "scopes"),
            ({"name": "k", "scopes": ["root"]}, "scopes[0]"),
            ({"name": "k", "scopes": "inference"}, "scopes"),
            ({"name": "k", "expires_at": past}, "expires_at"),
            ({"name": "k", "expires_at": "2030-01-01T00:00:00"}, "expires_at"),  # no timezone
            ({"name": "k", "expires_at": "next week"}, "expires_at"),
            ({"name": "k", "tenant_id": str(acme.tenant_id)}, "tenant_id"),
            ({"name": "k", "rpm_limit": -1}, "rpm_limit"),
            ({"name": "k", "monthly_token_budget": "lots"}, "monthly_token_budget"),
        ]
        for body, param in cases:
            assert_error(await client.post(path, json=body, headers=admin.headers), 400, param)
        for method, body in (("POST", {"name": "k"}), ("GET", None)):
            error = assert_error(
                await call(client, method, f"/admin/tenants/{NO_SUCH_ID}/keys", admin.headers, body), 404
            )
            assert NO_SUCH_ID in error["message"]
        keys = (await client.get(path, headers=admin.headers)).json()["data"]
        assert [key["name"] for key in keys] == ["acme-key"]
        assert await audit_rows(gateway) == []


async def test_key_limits_are_set_changed_cleared_audited_and_kept_by_rotation(
    gateway_settings, default_engine
) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin, admin_key_id = await make_admin(gateway)
        acme = await make_tenant(gateway, "acme")
        body = {"name": "batch", "rpm_limit": 30, "tpm_limit": 20_000}
        created = (await client.post(f"/admin/tenants/{acme.tenant_id}/keys", json=body, headers=admin.headers)).json()
        assert {field: created[field] for field in LIMIT_FIELDS} == {
            "rpm_limit": 30,
            "tpm_limit": 20_000,
            "max_concurrent": None,
            "monthly_token_budget": None,
        }
        path = f"/admin/keys/{created['id']}"
        response = await client.patch(path, json={"tpm_limit": None, "max_concurrent": 2}, headers=admin.headers)
        assert response.status_code == 200, response.text
        changed = response.json()
        assert set(changed) == KEY_FIELDS
        assert (changed["rpm_limit"], changed["tpm_limit"], changed["max_concurrent"]) == (30, None, 2)
        assert (await client.patch(path, json={"max_concurrent": 2}, headers=admin.headers)).json() == changed
        for bad, param in (
            ({"rpm_limit": -1}, "rpm_limit"),
            ({"name": "renamed"}, "name"),
            ({"tpm_limit": 2**31}, "tpm_limit"),
        ):
            assert_error(await client.patch(path, json=bad, headers=admin.headers), 400, param)
        assert_error(await client.patch(f"/admin/keys/{NO_SUCH_ID}", json={"rpm_limit": 1}, headers=admin.headers), 404)

        rotated = (await client.post(f"{path}/rotate", json={"grace_period_s": 0}, headers=admin.headers)).json()
        assert {field: rotated[field] for field in LIMIT_FIELDS} == {field: changed[field] for field in LIMIT_FIELDS}
        revoked = await client.delete(path, headers=admin.headers)
        assert revoked.status_code == 200
        assert_error(await client.patch(path, json={"rpm_limit": 1}, headers=admin.headers), 409)

        rows = await audit_rows(gateway)
        assert [(row.action, row.target_id, row.actor_key_id) for row in rows] == [
            ("key.create", created["id"], admin_key_id),
            ("key.update", created["id"], admin_key_id),
            ("key.rotate", created["id"], admin_key_id),
            ("key.revoke", created["id"], admin_key_id),
        ]
        assert (rows[1].before["tpm_limit"], rows[1].after["tpm_limit"]) == (20_000, None)
        assert rows[1].after == changed | {"last_used_at": None}


async def test_revoked_key_is_refused_within_a_second(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin, admin_key_id = await make_admin(gateway)
        acme = await make_tenant(gateway, "acme")
        key = (await client.get(f"/admin/tenants/{acme.tenant_id}/keys", headers=admin.headers)).json()["data"][0]
        assert (await client.get("/v1/models", headers=acme.headers)).status_code == 200

        response = await client.delete(f"/admin/keys/{key['id']}", headers=admin.headers)
        assert response.status_code == 200, response.text
        revoked = response.json()
        assert set(revoked) == KEY_FIELDS
        assert revoked["revoked_at"] is not None
        assert revoked | {"revoked_at": None, "last_used_at": None} == key | {"last_used_at": None}
        error = assert_error(await wait_for_status(client, "/v1/models", acme.headers, 401), 401)
        assert "revoked" in error["message"]

        again = await client.delete(f"/admin/keys/{key['id']}", headers=admin.headers)
        assert again.json()["revoked_at"] == revoked["revoked_at"]  # the first revocation time stays
        assert_error(await client.delete(f"/admin/keys/{NO_SUCH_ID}", headers=admin.headers), 404)

        rows = await audit_rows(gateway)
        assert [(row.action, row.target_id, row.actor_key_id) for row in rows] == [
            ("key.revoke", key["id"], admin_key_id)
        ]
        assert rows[0].before["revoked_at"] is None
        assert rows[0].after["revoked_at"] is not None


async def test_rotated_key_works_alongside_the_old_one_until_the_grace_ends(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin, admin_key_id = await make_admin(gateway)
        acme = await make_tenant(gateway, "acme")
        old = (await client.get(f"/admin/tenants/{acme.tenant_id}/keys", headers=admin.headers)).json()["data"][0]

        response = await client.post(
            f"/admin/keys/{old['id']}/rotate", json={"grace_period_s": 1}, headers=admin.headers
        )
        assert response.status_code == 201, response.text
        new = response.json()
        assert set(new) == CREATED_FIELDS
        assert new["id"] != old["id"]
        assert (new["tenant_id"], new["name"], new["scopes"], new["expires_at"]) == (
            old["tenant_id"],
            old["name"],
            old["scopes"],
            None,
        )
        assert (await client.get("/v1/models", headers=bearer(new["key"]))).status_code == 200
        assert (await client.get("/v1/models", headers=acme.headers)).status_code == 200

        await asyncio.sleep(1.1)
        error = assert_error(await client.get("/v1/models", headers=acme.headers), 401)
        assert "expired" in error["message"]
        assert (await client.get("/v1/models", headers=bearer(new["key"]))).status_code == 200

        keys = (await client.get(f"/admin/tenants/{acme.tenant_id}/keys", headers=admin.headers)).json()["data"]
        assert [key["id"] for key in keys] == [old["id"], new["id"]]
        assert keys[0]["expires_at"] is not None and keys[1]["expires_at"] is None

        rows = await audit_rows(gateway)
        assert [(row.action, row.target_id, row.actor_key_id) for row in rows] == [
            ("key.rotate", old["id"], admin_key_id)
        ]
        assert rows[0].before == old
        assert rows[0].after == keys[0] | {"replaced_by": keys[1]}
        assert secret_part(new["key"]) not in json.dumps(rows[0].after)


async def test_rotation_keeps_an_earlier_expiry_and_refuses_revoked_keys(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin, _ = await make_admin(gateway)
        acme = await make_tenant(gateway, "acme")
        path = f"/admin/tenants/{acme.tenant_id}/keys"
        soon = (datetime.now(UTC) + timedelta(minutes=5)).replace(microsecond=0)
        expiring = (
            await client.post(path, json={"name": "ci", "expires_at": soon.isoformat()}, headers=admin.headers)
        ).json()
        await client.post(f"/admin/keys/{expiring['id']}/rotate", json={"grace_period_s": 3600}, headers=admin.headers)
        keys = {key["id"]: key for key in (await client.get(path, headers=admin.headers)).json()["data"]}
        assert datetime.fromisoformat(keys[expiring["id"]]["expires_at"]) == soon

        default = await client.post(f"/admin/keys/{expiring['id']}/rotate", json={}, headers=admin.headers)
        assert default.status_code == 201  # rotating the old key again is allowed while it is not revoked

        for grace, param in ((-1, "grace_period_s"), (30 * 24 * 3600 + 1, "grace_period_s"), ("1h", "grace_period_s")):
            response = await client.post(
                f"/admin/keys/{expiring['id']}/rotate", json={"grace_period_s": grace}, headers=admin.headers
            )
            assert_error(response, 400, param)
        assert_error(
            await client.post(f"/admin/keys/{expiring['id']}/rotate", json={"grace": 1}, headers=admin.headers),
            400,
            "grace",
        )

        await client.delete(f"/admin/keys/{expiring['id']}", headers=admin.headers)
        error = assert_error(
            await client.post(f"/admin/keys/{expiring['id']}/rotate", json={}, headers=admin.headers), 409
        )
        assert "revoked" in error["message"]
        assert_error(await client.post(f"/admin/keys/{NO_SUCH_ID}/rotate", json={}, headers=admin.headers), 404)


async def test_every_key_route_needs_an_admin_key(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        await make_admin(gateway)
        acme = await make_tenant(gateway, "acme")  # an inference key
        async with gateway.database.sessions() as session:
            key_id = await session.scalar(select(ApiKey.id).where(ApiKey.tenant_id == acme.tenant_id))
        routes = [
            ("POST", f"/admin/tenants/{acme.tenant_id}/keys", {"name": "mine"}),
            ("GET", f"/admin/tenants/{acme.tenant_id}/keys", None),
            ("PATCH", f"/admin/keys/{key_id}", {"rpm_limit": 1}),
            ("DELETE", f"/admin/keys/{key_id}", None),
            ("POST", f"/admin/keys/{key_id}/rotate", {"grace_period_s": 0}),
        ]
        assert len(routes) == len(KEY_ROUTES)
        for method, path, body in routes:
            assert_error(await call(client, method, path, {}, body), 401)
            error = assert_error(await call(client, method, path, acme.headers, body), 403)
            assert "admin" in error["message"]
        assert (await client.get("/v1/models", headers=acme.headers)).status_code == 200  # neither revoked nor rotated
        assert await audit_rows(gateway) == []


async def test_create_admin_key_makes_a_working_admin_key(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        first = await create_admin_key(gateway.database, gateway.key_secret)
        second = await create_admin_key(gateway.database, gateway.key_secret, name="backup")
        assert first != second
        for plaintext in (first, second):
            assert (await client.get("/admin/tenants", headers=bearer(plaintext))).status_code == 200
            assert_error(await client.get("/v1/models", headers=bearer(plaintext)), 403)  # admin scope only
        tenants = (await client.get("/admin/tenants", headers=bearer(first))).json()["data"]
        assert [tenant["name"] for tenant in tenants] == ["admin"]
        keys = (await client.get(f"/admin/tenants/{tenants[0]['id']}/keys", headers=bearer(first))).json()["data"]
        assert [(key["name"], key["scopes"]) for key in keys] == [("admin", ["admin"]), ("backup", ["admin"])]

        rows = await audit_rows(gateway)
        assert [(row.action, row.actor_key_id) for row in rows] == [
            ("tenant.create", None),
            ("key.create", None),
            ("key.create", None),
        ]
        assert all(secret_part(first) not in json.dumps(row.after) for row in rows)

        # A disabled admin tenant is enabled again: the command exists to get an administrator back in.
        async with gateway.database.sessions() as session, session.begin():
            (await session.scalar(select(Tenant).where(Tenant.name == "admin"))).status = "disabled"
        third = await create_admin_key(gateway.database, gateway.key_secret)
        await wait_for_status(client, "/admin/tenants", bearer(third), 200)
        assert (await audit_rows(gateway))[-2].action == "tenant.update"

        # So is a deleted one (the API refuses to delete it; an older database may hold one): admin keys are
        # valid in no other tenant.
        async with gateway.database.sessions() as session, session.begin():
            (await session.scalar(select(Tenant).where(Tenant.name == "admin"))).status = "deleted"
        fourth = await create_admin_key(gateway.database, gateway.key_secret)
        await wait_for_status(client, "/admin/tenants", bearer(fourth), 200)
        assert (await audit_rows(gateway))[-2].before["status"] == "deleted"


async def test_ensure_admin_key_stores_the_configured_key_once(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        database, secret = gateway.database, gateway.key_secret
        configured = generate_api_key().plaintext
        assert await ensure_admin_key(database, secret, configured) is True
        assert await ensure_admin_key(database, secret, configured) is False  # idempotent
        assert (await client.get("/admin/tenants", headers=bearer(configured))).status_code == 200
        assert await _admin_key_count(database) == 1
        rows = await audit_rows(gateway)
        assert [(row.action, row.actor_key_id) for row in rows] == [("tenant.create", None), ("key.create", None)]
        assert secret_part(configured) not in json.dumps(rows[1].after)

        # Another value while an admin key works: nothing stored.
        assert await ensure_admin_key(database, secret, generate_api_key().plaintext) is False
        # Once revoked, the configured key stays revoked across restarts, even with no other admin key left.
        tenant_id = (await client.get("/admin/tenants", headers=bearer(configured))).json()["data"][0]["id"]
        keys = (await client.get(f"/admin/tenants/{tenant_id}/keys", headers=bearer(configured))).json()["data"]
        await client.delete(f"/admin/keys/{keys[0]['id']}", headers=bearer(configured))
        assert await ensure_admin_key(database, secret, configured) is False
        assert_error(await wait_for_status(client, "/admin/tenants", bearer(configured), 401), 401)
        # With no usable admin key left, a new configured value is stored.
        fresh = generate_api_key().plaintext
        assert await ensure_admin_key(database, secret, fresh) is True
        assert (await client.get("/admin/tenants", headers=bearer(fresh))).status_code == 200

        for malformed in ("hunter2", "lpx_short_secret", configured + "x"):
            with pytest.raises(AdminKeyError, match="loraplex admin create-key") as raised:
                await ensure_admin_key(database, secret, malformed)
            assert malformed not in str(raised.value)
        assert await _admin_key_count(database) == 2


async def test_gateway_start_stores_loraplex_admin_key(gateway_settings, default_engine) -> None:
    configured = generate_api_key().plaintext
    settings = dataclasses.replace(gateway_settings, admin_key=configured)
    async with gateway_client(settings, default_engine) as (client, _):
        assert (await client.get("/admin/tenants", headers=bearer(configured))).status_code == 200
    async with gateway_client(settings, default_engine) as (client, gateway):  # a restart changes nothing
        assert (await client.get("/admin/tenants", headers=bearer(configured))).status_code == 200
        assert await _admin_key_count(gateway.database) == 1

    with pytest.raises(AdminKeyError, match="LORAPLEX_ADMIN_KEY"):
        async with run_gateway(dataclasses.replace(gateway_settings, admin_key="not-a-key"), default_engine):
            pass


async def _admin_key_count(database: Database) -> int:
    async with database.sessions() as session:
        keys = await session.scalars(select(ApiKey).where(any_(ApiKey.scopes) == "admin"))
        return len(list(keys))
