"""Who may administer what, on a real PostgreSQL: `admin` only in the admin tenant, `tenant-admin` only its own
tenant, and every admin route (and console page) declaring its rule to the one guard that applies it."""

from __future__ import annotations

import re
import uuid

import pytest
from litestar import get
from sqlalchemy import func, select

from app.admin import routes as admin_routes
from app.admin.guards import ACCESS, Access, UndeclaredAccessError, declared_access
from app.admin.keys.first_admin import warn_of_void_admin_keys
from app.console.access import PUBLIC
from app.console.router import CONSOLE_ROUTES
from app.db.tables import Adapter, ApiKey, AuditLog
from app.factory import create_app
from app.keys.secrets import generate_api_key, hash_api_key
from app.services import Gateway
from tests.app.gateway_fixtures import TenantKey, gateway_client, make_tenant
from tests.app.test_admin_adapters import upload
from tests.app.test_admin_tenants import assert_error, audit_rows, call, make_admin

pytestmark = pytest.mark.anyio

MODELS = "/v1/models"


async def legacy_admin_key(gateway: Gateway, tenant_id: uuid.UUID) -> TenantKey:
    """A key stored with `admin` (and `inference`) in a tenant other than `admin`, as the API once made them."""
    generated = generate_api_key()
    async with gateway.database.sessions() as session, session.begin():
        session.add(
            ApiKey(
                tenant_id=tenant_id,
                name="old-admin",
                prefix=generated.prefix,
                secret_hash=hash_api_key(gateway.key_secret, generated.plaintext),
                scopes=["admin", "inference"],
            )
        )
    return TenantKey(tenant_id, "", generated.plaintext)


async def key_id_of(gateway: Gateway, tenant: TenantKey) -> uuid.UUID:
    """The id of the key make_tenant gave the tenant."""
    async with gateway.database.sessions() as session:
        key_id = await session.scalar(select(ApiKey.id).where(ApiKey.name == f"{tenant.tenant_name}-key"))
    assert key_id is not None
    return key_id


async def fake_adapter(gateway: Gateway, tenant_id: uuid.UUID) -> uuid.UUID:
    """An adapter row of the tenant (no files: the routes that see it here never read them)."""
    async with gateway.database.sessions() as session, session.begin():
        adapter = Adapter(
            tenant_id=tenant_id,
            name="secret-project",
            base_model="base",
            rank=4,
            alpha=8.0,
            target_modules=["q_proj"],
            digest="0" * 64,
            size_bytes=1,
            storage_path="/nowhere",
        )
        session.add(adapter)
    return adapter.id


def admin_calls(app) -> list[tuple[str, str, Access]]:
    """(method, path template, declared rule) of every route the app serves under /admin."""
    calls = []
    for route in app.routes:
        if route.path.startswith("/admin"):
            for method, (handler, _) in route.route_handler_map.items():
                if method not in ("HEAD", "OPTIONS"):
                    calls.append((method, route.path, Access(handler.opt[ACCESS])))
    return sorted(calls)


def test_every_admin_route_and_console_page_declares_its_rule(gateway_settings, default_engine, monkeypatch) -> None:
    app = create_app(gateway_settings, engine=default_engine)  # only its route table: nothing starts
    calls = admin_calls(app)
    assert len(calls) == len(admin_routes.ADMIN_ROUTES)  # one method each: every handler was found
    assert {access for _, _, access in calls} == set(Access)
    for handler in CONSOLE_ROUTES:
        assert handler.opt.get(PUBLIC) or Access(handler.opt[ACCESS]), handler.handler_name

    @get("/forgotten", sync_to_thread=False)
    def forgotten() -> str:
        return "served to any admin key"

    @get("/orphan", opt={ACCESS: Access.TENANT}, sync_to_thread=False)
    def orphan() -> str:
        return "no tenant in the path"

    for handler in (forgotten, orphan):
        with pytest.raises(UndeclaredAccessError):
            declared_access(handler)
        monkeypatch.setattr(admin_routes, "ADMIN_ROUTES", [*admin_routes.ADMIN_ROUTES, handler])
        with pytest.raises(UndeclaredAccessError):  # the app is never built with it
            create_app(gateway_settings, engine=default_engine)
        monkeypatch.undo()


async def test_every_admin_route_refuses_inference_keys_and_other_tenants_admins(
    gateway_settings, default_engine
) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")  # its inference key
        globex = await make_tenant(gateway, "globex", scopes=("tenant-admin",))
        ids = {
            "tenant_id": acme.tenant_id,
            "key_id": await key_id_of(gateway, acme),
            "adapter_id": await fake_adapter(gateway, acme.tenant_id),
        }
        calls = admin_calls(client._transport.app)  # type: ignore[attr-defined]
        assert len(calls) >= 17
        for method, template, access in calls:
            # A body no route accepts: a route that read it before checking the key would answer 400.
            body = {"bogus": True} if method in ("POST", "PATCH") else None
            path = re.sub(r"\{(\w+):uuid\}", lambda m: str(ids[m[1]]), template)
            unknown = re.sub(r"\{(\w+):uuid\}", lambda _: str(uuid.uuid4()), template)
            if access is Access.OWN_TENANT:  # it names a tenant in its query instead
                path, unknown = f"{path}?tenant_id={acme.tenant_id}", f"{unknown}?tenant_id={uuid.uuid4()}"

            error = assert_error(await call(client, method, path, acme.headers, body), 403)
            assert "lacks the `admin` or `tenant-admin` scope" in error["message"], (method, template)

            if access is Access.PLATFORM:
                error = assert_error(await call(client, method, path, globex.headers, body), 403)
                assert "manages only its own tenant's (globex)" in error["message"], (method, template)
                continue
            # Another tenant's record and one that does not exist get the same answer, but for the id.
            theirs = assert_error(await call(client, method, path, globex.headers, body), 404)
            nobodys = assert_error(await call(client, method, unknown, globex.headers, body), 404)
            assert re.sub(r"[0-9a-f-]{36}", "ID", theirs["message"]) == re.sub(
                r"[0-9a-f-]{36}", "ID", nobodys["message"]
            )

        # Litestar's own OPTIONS answers (a path's methods) stay open to anyone, as the OpenAPI schema is.
        for headers in ({}, acme.headers, globex.headers):
            listed = await client.options(f"/admin/tenants/{acme.tenant_id}/keys", headers=headers)
            assert listed.status_code == 204 and "POST" in listed.headers["allow"]
        assert (await client.get(MODELS, headers=acme.headers)).status_code == 200  # not revoked, not rotated
        assert await audit_rows(gateway) == []
        async with gateway.database.sessions() as session:
            assert await session.scalar(select(func.count()).select_from(ApiKey)) == 2
            assert (await session.get(Adapter, ids["adapter_id"])).status == "ready"


async def test_an_admin_key_outside_the_admin_tenant_administers_nothing(
    gateway_settings, default_engine, caplog
) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin, _ = await make_admin(gateway)
        acme = await make_tenant(gateway, "acme")
        globex = await make_tenant(gateway, "globex")

        # The API refuses to make one, saying why and what to use instead.
        for scopes in (["admin"], ["admin", "inference"]):
            body = {"name": "ops", "scopes": scopes}
            response = await client.post(f"/admin/tenants/{acme.tenant_id}/keys", json=body, headers=admin.headers)
            error = assert_error(response, 400, "scopes")
            assert "only keys of the `admin` tenant" in error["message"] and "`tenant-admin`" in error["message"]
        # ... and a tenant-admin key in the admin tenant, which administers the platform with `admin` keys.
        response = await client.post(
            f"/admin/tenants/{admin.tenant_id}/keys",
            json={"name": "x", "scopes": ["tenant-admin"]},
            headers=admin.headers,
        )
        assert_error(response, 400, "scopes")

        # A key stored with the scope in acme is refused on every admin route, for every tenant: the attack of
        # minting keys in another tenant fails, as does listing them.
        legacy = await legacy_admin_key(gateway, acme.tenant_id)
        attempts = [
            ("POST", f"/admin/tenants/{globex.tenant_id}/keys", {"name": "stolen", "scopes": ["inference"]}),
            ("POST", f"/admin/tenants/{acme.tenant_id}/keys", {"name": "mine", "scopes": ["inference"]}),
            ("GET", f"/admin/tenants/{globex.tenant_id}/keys", None),
            ("GET", "/admin/tenants", None),
            ("POST", "/admin/tenants", {"name": "evil"}),
        ]
        for method, path, body in attempts:
            error = assert_error(await call(client, method, path, legacy.headers, body), 403)
            assert "only keys of the `admin` tenant may hold it" in error["message"], (method, path)
        assert (await client.get(MODELS, headers=legacy.headers)).status_code == 200  # its other scope still holds
        # Each start names such keys in the log, with what to do.
        assert await warn_of_void_admin_keys(gateway.database) == 1
        assert f"{legacy.key[:12]} of acme" in caplog.text and "tenant-admin" in caplog.text

        async with gateway.database.sessions() as session:
            names = set(await session.scalars(select(ApiKey.name)))
        assert names == {"admin-key", "acme-key", "globex-key", "old-admin"}
        assert await audit_rows(gateway) == []


async def test_a_tenant_admin_manages_its_own_keys_adapters_and_usage(
    gateway_settings, default_engine, tenant_adapters
) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin, _ = await make_admin(gateway)
        acme = await make_tenant(gateway, "acme")
        # The platform admin hands acme a tenant-admin key.
        made = await client.post(
            f"/admin/tenants/{acme.tenant_id}/keys",
            json={"name": "acme-ops", "scopes": ["tenant-admin"]},
            headers=admin.headers,
        )
        assert made.status_code == 201, made.text
        ops = TenantKey(acme.tenant_id, "acme", made.json()["key"])
        ops_key_id = uuid.UUID(made.json()["id"])
        me = (await client.get("/admin/me", headers=ops.headers)).json()
        assert (me["tenant_name"], me["scopes"], me["tenant_scope"]) == ("acme", ["tenant-admin"], str(acme.tenant_id))
        assert me["key_id"] == str(ops_key_id)
        platform = (await client.get("/admin/me", headers=admin.headers)).json()  # manages every tenant: no scope
        assert (platform["tenant_name"], platform["scopes"], platform["tenant_scope"]) == ("admin", ["admin"], None)
        assert_error(await client.get("/admin/me", headers=acme.headers), 403)  # an inference key administers nothing
        assert_error(await client.get(MODELS, headers=ops.headers), 403)  # no inference scope: it administers only

        # Keys: create (inference, another tenant admin; never admin), list, limit, rotate, revoke.
        keys = f"/admin/tenants/{acme.tenant_id}/keys"
        backend = await client.post(keys, json={"name": "backend"}, headers=ops.headers)
        assert backend.status_code == 201, backend.text
        assert (
            await client.get(MODELS, headers={"Authorization": f"Bearer {backend.json()['key']}"})
        ).status_code == 200
        deputy = await client.post(keys, json={"name": "deputy", "scopes": ["tenant-admin"]}, headers=ops.headers)
        assert deputy.status_code == 201, deputy.text
        assert_error(await client.post(keys, json={"name": "root", "scopes": ["admin"]}, headers=ops.headers), 400)
        listed = (await client.get(keys, headers=ops.headers)).json()["data"]
        assert [key["name"] for key in listed] == ["acme-key", "acme-ops", "backend", "deputy"]
        backend_id = backend.json()["id"]
        assert (await client.patch(f"/admin/keys/{backend_id}", json={"rpm_limit": 5}, headers=ops.headers)).json()[
            "rpm_limit"
        ] == 5
        rotated = await client.post(f"/admin/keys/{backend_id}/rotate", json={"grace_period_s": 0}, headers=ops.headers)
        assert rotated.status_code == 201, rotated.text
        revoked = await client.delete(f"/admin/keys/{deputy.json()['id']}", headers=ops.headers)
        assert revoked.status_code == 200 and revoked.json()["revoked_at"]

        # Adapters: upload, list, read, pin, delete; loading into and unloading from the engine is the platform's.
        uploaded = await upload(client, ops, acme.tenant_id, "pirate", tenant_adapters["alpha"])
        assert uploaded.status_code == 201, uploaded.text
        adapter_id = uploaded.json()["id"]
        listing = (await client.get(f"/admin/tenants/{acme.tenant_id}/adapters", headers=ops.headers)).json()
        assert [adapter["name"] for adapter in listing["data"]] == ["pirate"]
        assert (await client.get(f"/admin/adapters/{adapter_id}", headers=ops.headers)).json()["name"] == "pirate"
        pinned = await client.post(f"/admin/adapters/{adapter_id}/pin", json={"pinned": True}, headers=ops.headers)
        assert pinned.status_code == 200 and pinned.json()["pinned"] is True
        for action in ("load", "unload"):
            assert_error(await client.post(f"/admin/adapters/{adapter_id}/{action}", headers=ops.headers), 403)
        deleted = await client.delete(f"/admin/adapters/{adapter_id}", headers=ops.headers)
        assert deleted.status_code == 200 and deleted.json()["status"] == "deleted"

        # Usage: its own tenant's, whatever it asks for; the tenant's record to read, not to change.
        usage = await client.get("/admin/usage", headers=ops.headers)
        assert usage.status_code == 200 and all(row["tenant_id"] == str(acme.tenant_id) for row in usage.json()["data"])
        assert (await client.get(f"/admin/tenants/{acme.tenant_id}", headers=ops.headers)).json()["name"] == "acme"
        for method, path, body in (
            ("GET", "/admin/tenants", None),
            ("POST", "/admin/tenants", {"name": "mine"}),
            ("PATCH", f"/admin/tenants/{acme.tenant_id}", {"rpm_limit": None}),
            ("DELETE", f"/admin/tenants/{acme.tenant_id}", None),
        ):
            assert_error(await call(client, method, path, ops.headers, body), 403)

        # Every change it made is audited with its key and its tenant.
        rows = [row for row in await audit_rows(gateway) if row.actor_key_id == ops_key_id]
        assert [row.action for row in rows] == [
            "key.create",
            "key.create",
            "key.update",
            "key.rotate",
            "key.revoke",
            "adapter.upload",
            "adapter.pin",
            "adapter.delete",
        ]
        assert {row.actor_tenant_id for row in rows} == {acme.tenant_id}
        async with gateway.database.sessions() as session:
            platform = await session.scalar(select(AuditLog).where(AuditLog.actor_key_id != ops_key_id))
        assert platform is not None and platform.actor_tenant_id == admin.tenant_id
