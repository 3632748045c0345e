"""The admin adapter routes on the real default model and a real PostgreSQL: upload to first answer, the
load/unload/pin/delete round trip, deletion and unloading while a stream is in flight, and the admin scope."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from app.admin.adapters import residency as adapter_residency
from app.db.tables import Adapter, AuditLog
from app.keys.service import Scope
from tests.app.gateway_fixtures import TenantKey, chat_body, gateway_client, make_tenant, on_both_engines, usage_rows
from tests.app.live_server import LiveServer, live_server

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
WAIT_S = 10.0
MAX_UPLOAD_TO_ANSWER_S = 1.0  # the promise: an uploaded adapter answers within the same second
# The machine running the tests may be shared; a neighbour's burst of CPU must not fail the promise, three
# slow answers in a row would.
LATENCY_ATTEMPTS = 3


def adapter_files(folder: Path) -> list[tuple[str, tuple[str, bytes, str]]]:
    """The two parts of an upload, read from a PEFT folder, for httpx's ``files=``."""
    return [
        (
            "adapter_config.json",
            ("adapter_config.json", (folder / "adapter_config.json").read_bytes(), "application/json"),
        ),
        (
            "adapter_model.safetensors",
            (
                "adapter_model.safetensors",
                (folder / "adapter_model.safetensors").read_bytes(),
                "application/octet-stream",
            ),
        ),
    ]


def adapters_url(tenant_id: uuid.UUID) -> str:
    return f"/admin/tenants/{tenant_id}/adapters"


async def upload(
    client: httpx.AsyncClient, admin: TenantKey, tenant_id: uuid.UUID, name: str, folder: Path, **fields: str
) -> httpx.Response:
    return await client.post(
        adapters_url(tenant_id), data={"name": name, **fields}, files=adapter_files(folder), headers=admin.headers
    )


async def audit_actions(gateway) -> list[str]:
    async with gateway.database.sessions() as session:
        return list(await session.scalars(select(AuditLog.action).order_by(AuditLog.id)))


@on_both_engines
async def test_uploaded_adapter_answers_its_tenant_within_a_second(gateway_settings, default_engine, tenant_adapters):
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin = await make_tenant(gateway, "admin", scopes=(Scope.ADMIN,))
        acme = await make_tenant(gateway, "acme")
        other = await make_tenant(gateway, "globex")
        warm = await client.post(CHAT, json=chat_body(default_engine.model_name, max_tokens=1), headers=acme.headers)
        assert warm.status_code == 200  # the engine's own first-request costs are not the upload's
        timings = []
        for attempt in range(LATENCY_ATTEMPTS):
            name = f"pirate-{attempt}"
            response = await upload(client, admin, acme.tenant_id, name, tenant_adapters["alpha"])
            uploaded_at = time.perf_counter()
            assert response.status_code == 201, response.text
            chat = await client.post(CHAT, json=chat_body(name, max_tokens=1), headers=acme.headers)
            timings.append(time.perf_counter() - uploaded_at)
            assert chat.status_code == 200, chat.text
            if timings[-1] < MAX_UPLOAD_TO_ANSWER_S:
                break
        assert min(timings) < MAX_UPLOAD_TO_ANSWER_S, f"seconds from upload to answer: {timings}"

        adapter = response.json()
        assert adapter["name"] == name and adapter["tenant_id"] == str(acme.tenant_id)
        assert adapter["rank"] == 4 and adapter["alpha"] == 16
        assert sorted(adapter["target_modules"]) == ["q_proj", "v_proj"]
        assert adapter["status"] == "ready" and adapter["loaded"] is True and adapter["pinned"] is False
        assert adapter["base_model"] == default_engine.model_name
        stored = gateway_settings.home / "adapters" / adapter["digest"]
        assert sorted(p.name for p in stored.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        assert (await usage_rows(gateway))[-1].adapter_id == uuid.UUID(adapter["id"])

        foreign = await client.post(CHAT, json=chat_body(name, max_tokens=1), headers=other.headers)
        assert foreign.status_code == 404 and foreign.json()["error"]["code"] == "model_not_found"
        assert await audit_actions(gateway) == ["adapter.upload"] * len(timings)


@on_both_engines
async def test_list_get_load_unload_pin_delete_round_trip(gateway_settings, default_engine, tenant_adapters):
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin = await make_tenant(gateway, "admin", scopes=(Scope.ADMIN,))
        acme = await make_tenant(gateway, "acme")
        first = (await upload(client, admin, acme.tenant_id, "alpha", tenant_adapters["alpha"])).json()
        second = (await upload(client, admin, acme.tenant_id, "beta", tenant_adapters["beta"])).json()
        url = f"/admin/adapters/{first['id']}"

        listed = await client.get(adapters_url(acme.tenant_id), headers=admin.headers)
        assert listed.status_code == 200
        assert [a["name"] for a in listed.json()["data"]] == ["alpha", "beta"]
        assert (await client.get(url, headers=admin.headers)).json() == first

        unloaded = await client.post(f"{url}/unload", headers=admin.headers)
        assert unloaded.status_code == 200 and unloaded.json()["loaded"] is False
        assert not default_engine.has_adapter(first["id"])
        loaded = await client.post(f"{url}/load", headers=admin.headers)
        assert loaded.status_code == 200 and loaded.json()["loaded"] is True
        assert default_engine.has_adapter(first["id"])

        await client.post(f"{url}/unload", headers=admin.headers)
        pinned = await client.post(f"{url}/pin", headers=admin.headers)  # an empty body pins, loading first
        assert pinned.status_code == 200 and pinned.json()["loaded"] is True and pinned.json()["pinned"] is True
        stats = await default_engine.stats()
        assert stats.pages_by_owner.get("adapter", 0) > 0  # pinned means resident in the pool now
        unpinned = await client.post(f"{url}/pin", json={"pinned": False}, headers=admin.headers)
        assert unpinned.json()["pinned"] is False and unpinned.json()["loaded"] is True
        bad = await client.post(f"{url}/pin", json={"pinned": "yes"}, headers=admin.headers)
        assert bad.status_code == 400 and "pinned" in bad.json()["error"]["message"]

        deleted = await client.delete(url, headers=admin.headers)
        assert deleted.status_code == 200
        assert deleted.json()["status"] == "deleted" and deleted.json()["loaded"] is False  # idle: removed at once
        assert not default_engine.has_adapter(first["id"])
        assert (await client.get(url, headers=admin.headers)).json()["status"] == "deleted"
        listed = await client.get(adapters_url(acme.tenant_id), headers=admin.headers)
        assert [a["id"] for a in listed.json()["data"]] == [second["id"]]
        gone = await client.post(CHAT, json=chat_body("alpha", max_tokens=1), headers=acme.headers)
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
        assert not (gateway_settings.home / "adapters" / first["digest"]).exists()
        assert (gateway_settings.home / "adapters" / second["digest"]).is_dir()
        # A request that read the row just before the delete cannot bring the adapter back into the engine.
        assert await gateway.resolver.ensure_loaded(uuid.UUID(first["id"]), second["digest"]) is False
        assert not default_engine.has_adapter(first["id"])
        for action in ("load", "unload", "pin"):
            assert (await client.post(f"{url}/{action}", headers=admin.headers)).status_code == 404
        assert (await client.delete(url, headers=admin.headers)).status_code == 404
        assert (await client.get(f"/admin/adapters/{uuid.uuid4()}", headers=admin.headers)).status_code == 404
        assert (await client.get(adapters_url(uuid.uuid4()), headers=admin.headers)).status_code == 404

        assert await audit_actions(gateway) == [
            "adapter.upload",
            "adapter.upload",
            "adapter.unload",
            "adapter.load",
            "adapter.unload",
            "adapter.pin",
            "adapter.unpin",
            "adapter.delete",
        ]


async def test_taken_name_is_409_unless_replaced(gateway_settings, default_engine, tenant_adapters):
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin = await make_tenant(gateway, "admin", scopes=(Scope.ADMIN,))
        acme = await make_tenant(gateway, "acme")
        old = (await upload(client, admin, acme.tenant_id, "tone", tenant_adapters["alpha"])).json()
        store = gateway_settings.home / "adapters"
        before = sorted(p.name for p in store.iterdir())

        taken = await upload(client, admin, acme.tenant_id, "tone", tenant_adapters["beta"])
        assert taken.status_code == 409 and "replace=true" in taken.json()["error"]["message"]
        assert sorted(p.name for p in store.iterdir()) == before  # the refused upload's files are gone
        assert not any((store / ".uploads").iterdir())

        replaced = await upload(client, admin, acme.tenant_id, "tone", tenant_adapters["beta"], replace="true")
        assert replaced.status_code == 201, replaced.text
        new = replaced.json()
        assert new["id"] != old["id"] and new["rank"] == 8
        chat = await client.post(CHAT, json=chat_body("tone", max_tokens=1), headers=acme.headers)
        assert chat.status_code == 200
        assert (await usage_rows(gateway))[-1].adapter_id == uuid.UUID(new["id"])  # the new version, at once
        assert (await client.get(f"/admin/adapters/{old['id']}", headers=admin.headers)).json()["status"] == "deleted"
        assert not default_engine.has_adapter(old["id"])
        assert not (store / old["digest"]).exists()
        assert await audit_actions(gateway) == ["adapter.upload", "adapter.replace"]


async def test_concurrent_uploads_of_one_name_give_one_adapter(gateway_settings, default_engine, tenant_adapters):
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin = await make_tenant(gateway, "admin", scopes=(Scope.ADMIN,))
        acme = await make_tenant(gateway, "acme")
        first, second = await asyncio.gather(
            upload(client, admin, acme.tenant_id, "twin", tenant_adapters["alpha"]),
            upload(client, admin, acme.tenant_id, "twin", tenant_adapters["beta"]),
        )
        assert sorted([first.status_code, second.status_code]) == [201, 409]
        winner = first if first.status_code == 201 else second
        async with gateway.database.sessions() as session:
            assert (await session.scalars(select(Adapter.id))).all() == [uuid.UUID(winner.json()["id"])]
        store = gateway_settings.home / "adapters"
        assert sorted(p.name for p in store.iterdir() if p.name != ".uploads") == [winner.json()["digest"]]
        assert not any((store / ".uploads").iterdir())
        assert await audit_actions(gateway) == ["adapter.upload"]


async def test_same_bytes_under_two_names_share_files_until_both_are_deleted(
    gateway_settings, default_engine, tenant_adapters
):
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin = await make_tenant(gateway, "admin", scopes=(Scope.ADMIN,))
        acme = await make_tenant(gateway, "acme")
        globex = await make_tenant(gateway, "globex")
        mine = (await upload(client, admin, acme.tenant_id, "shared", tenant_adapters["alpha"])).json()
        theirs = (await upload(client, admin, globex.tenant_id, "shared", tenant_adapters["alpha"])).json()
        folder = gateway_settings.home / "adapters" / mine["digest"]
        assert mine["digest"] == theirs["digest"] and mine["id"] != theirs["id"]

        await client.delete(f"/admin/adapters/{mine['id']}", headers=admin.headers)
        assert folder.is_dir()  # the other tenant's adapter still uses these files
        chat = await client.post(CHAT, json=chat_body("shared", max_tokens=1), headers=globex.headers)
        assert chat.status_code == 200
        await client.delete(f"/admin/adapters/{theirs['id']}", headers=admin.headers)
        assert not folder.exists()


async def test_inference_keys_get_403_on_every_adapter_route(gateway_settings, default_engine, tenant_adapters):
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme", adapters={"alpha": tenant_adapters["alpha"]})
        async with gateway.database.sessions() as session:
            adapter_id = await session.scalar(select(Adapter.id))
        one = f"/admin/adapters/{adapter_id}"
        calls = [
            ("POST", adapters_url(acme.tenant_id)),
            ("GET", adapters_url(acme.tenant_id)),
            ("GET", one),
            ("DELETE", one),
            ("POST", f"{one}/load"),
            ("POST", f"{one}/unload"),
            ("POST", f"{one}/pin"),
        ]
        for method, url in calls:
            files = adapter_files(tenant_adapters["alpha"]) if method == "POST" and url.endswith("adapters") else None
            data = {"name": "sneaky"} if files else None
            response = await client.request(method, url, headers=acme.headers, files=files, data=data)
            assert response.status_code == 403, (method, url, response.text)
            assert response.json()["error"]["code"] == "insufficient_permissions"
            anonymous = await client.request(method, url)
            assert anonymous.status_code == 401, (method, url)
        async with gateway.database.sessions() as session:
            assert (await session.scalars(select(Adapter.name))).all() == ["alpha"]
        assert await audit_actions(gateway) == []


async def test_openapi_documents_the_adapter_routes(gateway_settings, default_engine):
    async with gateway_client(gateway_settings, default_engine) as (client, _):
        schema = (await client.get("/schema/openapi.json")).json()
    upload_op = schema["paths"]["/admin/tenants/{tenant_id}/adapters"]["post"]
    form = upload_op["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert set(form["required"]) == {"name", "adapter_config.json", "adapter_model.safetensors"}
    assert {"201", "400", "403", "404", "409", "413", "422"} <= set(upload_op["responses"])
    assert upload_op["tags"] == ["admin"] and upload_op["summary"]
    for path in ("/admin/adapters/{adapter_id}/pin", "/admin/adapters/{adapter_id}/unload"):
        assert schema["paths"][path]["post"]["tags"] == ["admin"]


# Live server: a stream in flight while the adapter is deleted or unloaded ----------------------------------


@pytest.fixture
def server(gateway_settings, default_engine, monkeypatch) -> Iterator[LiveServer]:
    monkeypatch.setattr(adapter_residency, "UNLOAD_WAIT_S", 0.3)  # answer 409 quickly while the stream runs
    with live_server(gateway_settings, default_engine) as running:
        yield running


def _live_upload(server: LiveServer, http: httpx.Client, folder: Path) -> tuple[TenantKey, TenantKey, dict]:
    admin = server.run(make_tenant(server.gateway, "admin", scopes=(Scope.ADMIN,)))
    acme = server.run(make_tenant(server.gateway, "acme"))
    response = http.post(
        adapters_url(acme.tenant_id), data={"name": "pirate"}, files=adapter_files(folder), headers=admin.headers
    )
    assert response.status_code == 201, response.text
    return admin, acme, response.json()


def _stream_with_admin_call(http: httpx.Client, acme: TenantKey, admin_call) -> tuple[list[dict], str, httpx.Response]:
    """Stream a chat with the adapter; after its first token, make ``admin_call``; read the stream to its end.

    The engine goes on generating while the admin call is made, so the request must outlast the call: 256 tokens
    take seconds, where 64 once ended before a slow admin call answered (an unload then found nothing using it)."""
    body = chat_body("pirate", "Count from one to one hundred.", stream=True, max_tokens=256)
    chunks: list[dict] = []
    last = ""
    admin_response = None
    with http.stream("POST", CHAT, json=body, headers=acme.headers) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            last = line.removeprefix("data: ")
            if last == "[DONE]":
                break
            chunks.append(json.loads(last))
            if admin_response is None and "choices" in chunks[-1] and chunks[-1]["choices"][0]["delta"].get("content"):
                admin_response = admin_call()
    assert admin_response is not None, "the stream ended before its first token"
    return chunks, last, admin_response


def _engine_settles(server: LiveServer, adapter_id: str) -> None:
    engine = server.gateway.engine
    deadline = time.monotonic() + WAIT_S
    while engine.has_adapter(adapter_id) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.has_adapter(adapter_id), "the engine still holds the adapter"
    stats = server.run(engine.stats())
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.pages_by_owner.get("kv", 0) == 0


def test_delete_while_streaming_lets_the_stream_finish(server, tenant_adapters) -> None:
    with httpx.Client(base_url=server.url, timeout=WAIT_S) as http, httpx.Client(base_url=server.url) as admin_http:
        admin, acme, adapter = _live_upload(server, http, tenant_adapters["alpha"])
        url = f"/admin/adapters/{adapter['id']}"
        chunks, last, deleted = _stream_with_admin_call(
            http, acme, lambda: admin_http.delete(url, headers=admin.headers)
        )

        assert deleted.status_code == 200, deleted.text
        assert deleted.json()["status"] == "deleted"
        assert deleted.json()["loaded"] is True  # the stream still held it when the delete answered
        assert last == "[DONE]"  # the stream in flight finished normally
        assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
        assert all("error" not in chunk for chunk in chunks)
        after = http.post(CHAT, json=chat_body("pirate", max_tokens=1), headers=acme.headers)
        assert after.status_code == 404 and after.json()["error"]["code"] == "model_not_found"
        _engine_settles(server, adapter["id"])
        folder = Path(server.gateway.settings.home) / "adapters" / adapter["digest"]
        deadline = time.monotonic() + WAIT_S
        while folder.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not folder.exists(), "the deleted adapter's files stayed in the store"


def test_unload_while_streaming_is_409_then_succeeds(server, tenant_adapters) -> None:
    with httpx.Client(base_url=server.url, timeout=WAIT_S) as http, httpx.Client(base_url=server.url) as admin_http:
        admin, acme, adapter = _live_upload(server, http, tenant_adapters["alpha"])
        url = f"/admin/adapters/{adapter['id']}/unload"
        chunks, last, busy = _stream_with_admin_call(http, acme, lambda: admin_http.post(url, headers=admin.headers))

        assert busy.status_code == 409, busy.text
        error = busy.json()["error"]
        assert error["code"] == "adapter_in_use" and "1 request(s) are using it" in error["message"]
        assert last == "[DONE]" and all("error" not in chunk for chunk in chunks)
        unloaded = admin_http.post(url, headers=admin.headers)
        assert unloaded.status_code == 200 and unloaded.json()["loaded"] is False
        _engine_settles(server, adapter["id"])
        again = http.post(CHAT, json=chat_body("pirate", max_tokens=1), headers=acme.headers)
        assert again.status_code == 200  # unloaded, not deleted: the next request loads it again
