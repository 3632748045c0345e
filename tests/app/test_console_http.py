"""The console over HTTP on a real PostgreSQL: sessions, CSRF, the same audit rows as the REST API, escaping."""

from __future__ import annotations

import dataclasses
import html
import re
import uuid

import pytest
from sqlalchemy import select

from app.admin.guards import ACCESS, Access
from app.console.access import CSRF_FIELD, SESSION_COOKIE
from app.db.tables import Adapter, ApiKey, AuditLog, Tenant
from app.services import Gateway
from tests.app.console_helpers import csrf_token, sign_in, signed_in_token
from tests.app.gateway_fixtures import gateway_client, make_tenant
from tests.app.test_admin_access import fake_adapter

pytestmark = pytest.mark.anyio

SOME_ID = "00000000-0000-4000-8000-000000000000"
HOSTILE = '<script>alert("x")</script><img src=x onerror=alert(1)>'


async def tenant_named(gateway: Gateway, name: str) -> Tenant | None:
    async with gateway.database.sessions() as session:
        return await session.scalar(select(Tenant).where(Tenant.name == name))


def unescaped(page: str) -> str:
    return html.unescape(page)


def scope_boxes(page: str) -> list[str]:
    """The scopes the new-key form offers, in order."""
    return re.findall(r'name="scopes" value="([a-z-]+)"', page)


def console_paths(app) -> list[tuple[str, str]]:
    """(method, path) of every console route but the sign-in page and the static files, ids filled in."""
    routes = []
    for route in app.routes:
        if not route.path.startswith("/console") or route.path.startswith(("/console/static", "/console/sign-in")):
            continue
        path = re.sub(r"\{[a-z_]+:uuid\}", SOME_ID, route.path)
        routes += [(method, path) for method in sorted(route.methods - {"HEAD", "OPTIONS"})]
    return routes


async def test_every_page_and_action_needs_a_session(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        paths = console_paths(client._transport.app)  # type: ignore[attr-defined]
        assert len(paths) >= 18  # every page and action: a new route is checked without touching this test
        for method, path in paths:
            response = await client.request(method, path, data={"name": "sneaky"})
            assert response.status_code == 303, (method, path, response.status_code)
            assert response.headers["location"] == "/console/sign-in"
        assert await tenant_named(gateway, "sneaky") is None


async def test_sign_in_takes_only_admin_keys_and_sign_out_ends_the_session(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin = await make_tenant(gateway, "admin", scopes=("admin",))
        user = await make_tenant(gateway, "acme")
        refused = await sign_in(client, user.key)
        assert refused.status_code == 403 and "lacks the `admin` or `tenant-admin` scope" in unescaped(refused.text)
        wrong = await sign_in(client, admin.key[:-4] + "abcd")
        assert wrong.status_code == 401 and "Sign-in refused" in wrong.text
        assert SESSION_COOKIE not in client.cookies

        response = await sign_in(client, admin.key)
        assert response.status_code == 303
        cookie = response.headers["set-cookie"]
        assert "HttpOnly" in cookie and "samesite=strict" in cookie.lower() and "Max-Age=1800" in cookie
        session_id = client.cookies[SESSION_COOKIE]
        page = await client.get("/console/tenants")
        assert page.status_code == 200 and f"/console/tenants/{admin.tenant_id}" in page.text
        assert page.headers["content-security-policy"].startswith("default-src 'self'")
        assert page.headers["cache-control"] == "no-store"

        signed_out = await client.post("/console/sign-out", data={CSRF_FIELD: csrf_token(page.text)})
        assert signed_out.status_code == 303
        client.cookies.set(SESSION_COOKIE, session_id, path="/console")  # a copy of the old cookie
        assert (await client.get("/console/tenants")).status_code == 303


async def test_a_post_without_the_session_token_is_refused(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin = await make_tenant(gateway, "admin", scopes=("admin",))
        token = await signed_in_token(client, admin.key)
        for data in ({"name": "forged"}, {"name": "forged", CSRF_FIELD: "x" * len(token)}):
            refused = await client.post("/console/tenants", data=data)
            assert refused.status_code == 403 and "security token" in refused.text
        header_wrong = await client.post("/console/tenants", data={"name": "forged"}, headers={"x-csrf-token": "no"})
        assert header_wrong.status_code == 403
        assert await tenant_named(gateway, "forged") is None
        # The sign-in form has its own token: a sign-in posted from elsewhere is refused too.
        client.cookies.clear()
        assert (await client.post("/console/sign-in", data={"api_key": admin.key})).status_code == 403


async def test_console_changes_are_audited_as_the_api_audits_them(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin = await make_tenant(gateway, "admin", scopes=("admin",))
        token = await signed_in_token(client, admin.key)
        created = await client.post("/console/tenants", data={CSRF_FIELD: token, "name": "acme", "rpm_limit": "60"})
        assert created.status_code == 303
        tenant = await tenant_named(gateway, "acme")
        assert tenant is not None and tenant.rpm_limit == 60
        bad = await client.post(f"/console/tenants/{tenant.id}", data={CSRF_FIELD: token, "rpm_limit": "-3"})
        assert bad.status_code == 400 and "Requests a minute: expected a whole number &gt;= 0" in bad.text
        keyed = await client.post(
            f"/console/tenants/{tenant.id}/keys", data={CSRF_FIELD: token, "name": "backend", "scopes": "inference"}
        )
        assert keyed.status_code == 303
        shown = (await client.get(keyed.headers["location"])).text
        secret = re.search(r'data-testid="new-secret">(lpx_[^<]+)<', shown)
        assert secret is not None
        assert secret.group(1) not in (await client.get(keyed.headers["location"])).text  # shown once
        async with gateway.database.sessions() as session:
            admin_key_id = await session.scalar(select(ApiKey.id).where(ApiKey.tenant_id == admin.tenant_id))
            rows = list(await session.scalars(select(AuditLog).order_by(AuditLog.id)))
        assert [row.action for row in rows] == ["tenant.create", "key.create"]
        assert {row.actor_key_id for row in rows} == {admin_key_id}
        assert rows[0].after["rpm_limit"] == 60 and rows[1].after["name"] == "backend"


async def test_tenant_supplied_text_is_escaped_everywhere(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin = await make_tenant(gateway, "admin", scopes=("admin",))
        token = await signed_in_token(client, admin.key)
        tenant = await make_tenant(gateway, "acme")
        made = await client.post(
            f"/console/tenants/{tenant.tenant_id}/keys",
            data={CSRF_FIELD: token, "name": HOSTILE, "scopes": "inference"},
        )
        assert made.status_code == 303
        for path in (f"/console/tenants/{tenant.tenant_id}/keys", "/console/audit", f"/console/audit?q={HOSTILE}"):
            page = (await client.get(path)).text
            assert "<script>alert" not in page and "<img src=x" not in page, path
            assert "&lt;script&gt;alert(" in page, path
        refused = await client.post("/console/tenants", data={CSRF_FIELD: token, "name": HOSTILE})
        assert refused.status_code == 400 and "<script>alert" not in refused.text
        assert "&lt;script&gt;" in refused.text  # the name is put back in the form, escaped


async def test_console_is_off_with_its_setting(gateway_settings, default_engine) -> None:
    settings = dataclasses.replace(gateway_settings, console=False)
    async with gateway_client(settings, default_engine) as (client, _):
        assert (await client.get("/console/sign-in")).status_code == 404
        assert (await client.get("/console/static/htmx.min.js")).status_code == 404


async def test_unknown_ids_and_bad_filters_are_errors_in_words(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin = await make_tenant(gateway, "admin", scopes=("admin",))
        await signed_in_token(client, admin.key)
        missing = await client.get(f"/console/tenants/{uuid.uuid4()}")
        assert missing.status_code == 404 and "No tenant has the id" in missing.text
        bad_dates = await client.get("/console/usage", params={"start": "2026-02-30"})
        assert bad_dates.status_code == 400 and "start must be a date as YYYY-MM-DD" in bad_dates.text


async def test_suspend_resume_and_rotate_from_the_console(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin = await make_tenant(gateway, "admin", scopes=("admin",))
        user = await make_tenant(gateway, "acme")
        token = await signed_in_token(client, admin.key)
        models = {"Authorization": f"Bearer {user.key}"}
        suspended = await client.post(
            f"/console/tenants/{user.tenant_id}/status", data={CSRF_FIELD: token, "status": "disabled"}
        )
        assert suspended.status_code == 303
        assert "Suspended the tenant acme" in (await client.get(suspended.headers["location"])).text
        assert (await client.get("/v1/models", headers=models)).status_code == 403
        await client.post(f"/console/tenants/{user.tenant_id}/status", data={CSRF_FIELD: token, "status": "active"})
        assert (await client.get("/v1/models", headers=models)).status_code == 200

        async with gateway.database.sessions() as session:
            key_id = await session.scalar(select(ApiKey.id).where(ApiKey.tenant_id == user.tenant_id))
        rotated = await client.post(
            f"/console/keys/{key_id}/rotate",
            data={CSRF_FIELD: token, "grace_period_s": "0", "tenant_id": str(user.tenant_id)},
        )
        assert rotated.status_code == 303
        secret = re.search(
            r'data-testid="new-secret">(lpx_[^<]+)<', (await client.get(rotated.headers["location"])).text
        )
        assert secret is not None
        assert (
            await client.get("/v1/models", headers={"Authorization": f"Bearer {secret.group(1)}"})
        ).status_code == 200
        assert (await client.get("/v1/models", headers=models)).status_code == 401  # no grace: the old key is over


async def test_the_key_form_offers_the_scopes_the_tenant_may_hold(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin = await make_tenant(gateway, "admin", scopes=("admin",))
        acme = await make_tenant(gateway, "acme")
        token = await signed_in_token(client, admin.key)
        assert scope_boxes((await client.get(f"/console/tenants/{admin.tenant_id}/keys")).text) == [
            "inference",
            "admin",
        ]
        acme_keys = f"/console/tenants/{acme.tenant_id}/keys"
        assert scope_boxes((await client.get(acme_keys)).text) == ["inference", "tenant-admin"]
        refused = await client.post(acme_keys, data={CSRF_FIELD: token, "name": "ops", "scopes": "admin"})
        assert refused.status_code == 400
        assert "only keys of the `admin` tenant may hold it" in unescaped(refused.text)
        async with gateway.database.sessions() as session:
            assert list(await session.scalars(select(ApiKey.name).where(ApiKey.tenant_id == acme.tenant_id))) == [
                "acme-key"
            ]


async def test_a_tenant_admin_sees_and_changes_only_its_own_tenant(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme", scopes=("tenant-admin",))
        globex = await make_tenant(gateway, "globex")
        async with gateway.database.sessions() as session:
            globex_key = await session.scalar(select(ApiKey.id).where(ApiKey.tenant_id == globex.tenant_id))
        signed_in = await sign_in(client, acme.key)
        home = f"/console/tenants/{acme.tenant_id}/keys"
        assert signed_in.status_code == 303 and signed_in.headers["location"] == home
        page = await client.get(home)
        assert page.status_code == 200 and scope_boxes(page.text) == ["inference", "tenant-admin"]
        assert "/console/audit" not in page.text and "Limits and status" not in page.text
        token = csrf_token(page.text)
        assert (await client.get("/console/")).headers["location"] == home

        for path in ("/console/tenants", "/console/audit", "/console/engine", f"/console/tenants/{acme.tenant_id}"):
            refused = await client.get(path)
            assert refused.status_code == 403 and "manages only its own tenant's (acme)" in unescaped(refused.text), (
                path
            )
        theirs = f"/console/tenants/{globex.tenant_id}"
        for path in (f"{theirs}/keys", f"{theirs}/adapters", f"/console/usage?tenant_id={globex.tenant_id}"):
            assert (await client.get(path)).status_code == 404, path
        stolen = await client.post(f"{theirs}/keys", data={CSRF_FIELD: token, "name": "stolen", "scopes": "inference"})
        assert stolen.status_code == 404
        assert (await client.post(f"/console/keys/{globex_key}/revoke", data={CSRF_FIELD: token})).status_code == 404
        assert (await client.get("/v1/models", headers=globex.headers)).status_code == 200

        made = await client.post(home, data={CSRF_FIELD: token, "name": "backend", "scopes": "inference"})
        assert made.status_code == 303
        usage = await client.get("/console/usage")
        assert usage.status_code == 200 and "All tenants" not in usage.text and "globex" not in usage.text
        async with gateway.database.sessions() as session:
            keys = list(await session.scalars(select(ApiKey).order_by(ApiKey.created_at)))
            rows = list(await session.scalars(select(AuditLog)))
        assert [(key.name, key.tenant_id) for key in keys] == [
            ("acme-key", acme.tenant_id),
            ("globex-key", globex.tenant_id),
            ("backend", acme.tenant_id),
        ]
        assert [(row.action, row.actor_key_id, row.actor_tenant_id) for row in rows] == [
            ("key.create", keys[0].id, acme.tenant_id)
        ]


async def test_every_console_page_refuses_another_tenants_admin(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        globex = await make_tenant(gateway, "globex", scopes=("tenant-admin",))
        async with gateway.database.sessions() as session:
            acme_key = await session.scalar(select(ApiKey.id).where(ApiKey.tenant_id == acme.tenant_id))
        ids = {
            "tenant_id": acme.tenant_id,
            "key_id": acme_key,
            "adapter_id": await fake_adapter(gateway, acme.tenant_id),
        }
        signed_in = await sign_in(client, globex.key)
        token = csrf_token((await client.get(signed_in.headers["location"])).text)
        checked = 0
        for route in client._transport.app.routes:  # type: ignore[attr-defined]
            if not route.path.startswith("/console") or route.path.startswith(("/console/static", "/console/sign-in")):
                continue
            for method, (handler, _) in route.route_handler_map.items():
                if method in ("HEAD", "OPTIONS"):
                    continue
                access = Access(handler.opt[ACCESS])
                path = re.sub(r"\{(\w+):uuid\}", lambda m: str(ids[m[1]]), route.path)
                if access is Access.OWN_TENANT:  # names the tenant in its query instead
                    path = f"{path}?tenant_id={acme.tenant_id}"
                response = await client.request(method, path, data={CSRF_FIELD: token, "name": "x", "pinned": "true"})
                assert response.status_code == (403 if access is Access.PLATFORM else 404), (method, path)
                checked += 1
        assert checked >= 18
        assert (await client.get("/v1/models", headers=acme.headers)).status_code == 200
        async with gateway.database.sessions() as session:
            assert list(await session.scalars(select(AuditLog))) == []
            assert (await session.get(Adapter, ids["adapter_id"])).status == "ready"
