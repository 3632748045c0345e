"""The security review as a checklist: one section per property, each test failing if it breaks.

1. Keys are stored as HMAC-SHA256 under the server's secret and compared in constant time.
2. No filesystem path from a request reaches the engine: ``model`` is a name looked up in the caller's
   tenant, uploads are written under fixed names into a folder the server names by digest.
3. Request bodies are capped (LORAPLEX_MAX_REQUEST_KB; uploads by LORAPLEX_MAX_ADAPTER_MB), answered 413.
4. Prompts are limited to the model's context, and a huge one is refused without being tokenized.
5. Every /admin route refuses an inference key (403) and no key (401), before it reads the body.
6. No key plaintext, key secret part or server secret in any log record or error body.
7. A disabled or deleted tenant's keys, and a revoked or rotated-out key, stop working at the next request.

Elsewhere, in more depth: the format and file of the server secret (test_keys.py), every bad upload
(test_adapter_uploads.py), tenants never seeing each other's adapters (test_tenant_isolation.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import hmac
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from sqlalchemy import event, select, update

from app import gateway as gateway_module
from app.admin.routes import ADMIN_ROUTES
from app.db.database import Database
from app.db.tables import Adapter, ApiKey, AuditLog, Tenant
from app.factory import create_app
from app.keys.auth_errors import TenantDisabledError
from app.keys.authenticator import Authenticator
from app.keys.secrets import KEY_PATTERN, PREFIX_LENGTH, generate_api_key
from app.keys.service import Scope
from app.settings import Settings
from tests.app.gateway_fixtures import TenantKey, chat_body, gateway_client, make_tenant
from tests.app.test_admin_adapters import adapter_files, adapters_url
from tests.app.test_admin_tenants import assert_error, make_admin

pytestmark = pytest.mark.anyio

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
KIB = 1024


def _secret_part(plaintext: str) -> str:
    return plaintext[PREFIX_LENGTH + 1 :]


def _wrong_key_with_prefix(plaintext: str) -> str:
    """Another well-formed key with the same stored prefix: only the secret part differs."""
    secret = _secret_part(plaintext)
    return plaintext[: PREFIX_LENGTH + 1] + ("A" if secret[0] != "A" else "B") + secret[1:]


class _Spy:
    """Wraps one method of an object and records the arguments of every call, then calls it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, target: Any, name: str) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        original = getattr(target, name)

        def spy(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((args, kwargs))
            return original(*args, **kwargs)

        monkeypatch.setattr(target, name, spy)


# 1. Keyed hashing and constant-time comparison -------------------------------------------------------------


async def test_the_stored_hash_is_an_hmac_under_the_server_secret(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        async with gateway.database.sessions() as session:
            stored = await session.scalar(select(ApiKey.secret_hash).where(ApiKey.tenant_id == acme.tenant_id))
        assert stored == hmac.new(gateway.key_secret, acme.key.encode(), hashlib.sha256).digest()
        assert stored != hashlib.sha256(acme.key.encode()).digest()
        assert (await client.get("/v1/models", headers=acme.headers)).status_code == 200

    other_secret = dataclasses.replace(gateway_settings, key_secret="a-different-server-secret")
    async with gateway_client(other_secret, default_engine) as (client, _):
        error = assert_error(await client.get("/v1/models", headers=acme.headers), 401)
        assert "Incorrect API key" in error["message"]


async def test_stored_hashes_are_compared_with_compare_digest(gateway_settings, default_engine, monkeypatch) -> None:
    compared = _Spy(monkeypatch, hmac, "compare_digest")
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        expected = hmac.new(gateway.key_secret, acme.key.encode(), hashlib.sha256).digest()

        assert (await client.get("/v1/models", headers=acme.headers)).status_code == 200
        assert ((expected, expected), {}) in compared.calls

        wrong = _wrong_key_with_prefix(acme.key)
        offered = hmac.new(gateway.key_secret, wrong.encode(), hashlib.sha256).digest()
        assert_error(await client.get("/v1/models", headers={"Authorization": f"Bearer {wrong}"}), 401)
        assert ((expected, offered), {}) in compared.calls  # the prefix's row was found; its hash refused the key


# 2. No filesystem path from a request reaches the engine ---------------------------------------------------


async def test_model_names_that_look_like_paths_are_404_and_never_reach_the_engine(
    gateway_settings, default_engine, tenant_adapters, monkeypatch
) -> None:
    added = _Spy(monkeypatch, default_engine, "add_adapter")
    generated = _Spy(monkeypatch, default_engine, "generate")
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme", adapters={"alpha": tenant_adapters["alpha"]})
        async with gateway.database.sessions() as session:
            adapter = (await session.scalars(select(Adapter).where(Adapter.tenant_id == acme.tenant_id))).one()
        home = gateway_settings.home
        store = home / "adapters"
        path_like = [
            "../alpha",
            "alpha/../../x",
            "./alpha",
            "/etc/passwd",
            str(tenant_adapters["alpha"]),  # a real PEFT folder on this machine
            f"file://{tenant_adapters['alpha']}",
            adapter.storage_path,  # the stored copy itself
            adapter.digest,  # its folder's name in the store
            str(adapter.id),  # its name inside the engine
            "..",
            "~/alpha",
        ]
        for model in path_like:
            for path, body in (
                (CHAT, chat_body(model, max_tokens=2)),
                (COMPLETIONS, {"model": model, "prompt": "Hi", "max_tokens": 2}),
            ):
                error = assert_error(await client.post(path, json=body, headers=acme.headers), 404, "model")
                assert error["code"] == "model_not_found"
        assert added.calls == [] and generated.calls == []

        # The one way in: the tenant's adapter by name, loaded from the store by its digest and named by its id.
        assert (await client.post(CHAT, json=chat_body("alpha", max_tokens=2), headers=acme.headers)).status_code == 200
        assert [args for args, _ in added.calls] == [(str(adapter.id), store / adapter.digest)]
        assert (store / adapter.digest).resolve().parent == store.resolve()
        assert [kwargs.get("adapter", args[3] if len(args) > 3 else None) for args, kwargs in generated.calls] == [
            str(adapter.id)
        ]


async def test_upload_file_names_and_adapter_names_never_become_paths(
    gateway_settings, default_engine, tenant_adapters, monkeypatch
) -> None:
    validated = _Spy(monkeypatch, default_engine, "validate_adapter")
    added = _Spy(monkeypatch, default_engine, "add_adapter")
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin, _ = await make_admin(gateway)
        acme = await make_tenant(gateway, "acme")
        url = adapters_url(acme.tenant_id)
        for name in ("../evil", "/etc/passwd", "a/b", "..", "a..b", ".hidden", "a\\b"):
            files = adapter_files(tenant_adapters["alpha"])
            error = assert_error(await client.post(url, data={"name": name}, files=files, headers=admin.headers), 400)
            assert error["param"] == "name"
        traversing = [
            (part, (f"../../../{part}", content, media))
            for part, (_, content, media) in adapter_files(tenant_adapters["alpha"])
        ]
        evil_part = ("../../evil.safetensors", ("/tmp/evil", b"data", "application/octet-stream"))
        refused = await client.post(url, data={"name": "pirate"}, files=[*traversing, evil_part], headers=admin.headers)
        assert_error(refused, 400)
        assert validated.calls == [] and added.calls == []

        response = await client.post(url, data={"name": "pirate"}, files=traversing, headers=admin.headers)
        assert response.status_code == 201, response.text
        store = (gateway_settings.home / "adapters").resolve()
        ((checked,), _) = validated.calls[0]
        assert checked.resolve().parent == store / ".uploads"  # a staging folder the server named
        ((engine_name, folder), _) = added.calls[0]
        assert engine_name == response.json()["id"] and folder.resolve() == store / response.json()["digest"]
        assert re.fullmatch(r"[0-9a-f]{64}", folder.name)
        assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]


# 3. Request body caps -----------------------------------------------------------------------------------------


def test_the_request_cap_is_explicit_and_configurable() -> None:
    assert Settings.from_env({}).max_request_bytes == 4096 * KIB
    assert Settings.from_env({"LORAPLEX_MAX_REQUEST_KB": "64"}).max_request_bytes == 64 * KIB


async def _chunks(data: bytes, size: int = 16 * KIB) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


async def test_a_body_over_the_cap_is_413_in_openai_shape(gateway_settings, default_engine) -> None:
    settings = dataclasses.replace(gateway_settings, max_request_bytes=64 * KIB)
    async with gateway_client(settings, default_engine) as (client, gateway):
        admin, _ = await make_admin(gateway)
        acme = await make_tenant(gateway, "acme")
        big = httpx.Request("POST", "/", json=chat_body(default_engine.model_name, "x" * 80 * KIB)).content
        announced = await client.post(CHAT, content=big, headers={**acme.headers, "content-type": "application/json"})
        chunked = await client.post(
            CHAT, content=_chunks(big), headers={**acme.headers, "content-type": "application/json"}
        )
        assert "content-length" not in chunked.request.headers
        patched = await client.patch(
            f"/admin/tenants/{acme.tenant_id}", json={"name": "y" * 80 * KIB}, headers=admin.headers
        )
        for response in (announced, chunked, patched):
            error = assert_error(response, 413)
            assert error["code"] == "request_too_large" and response.headers["x-request-id"]
            assert "64 KiB" in error["message"] and "LORAPLEX_MAX_REQUEST_KB" in error["message"]

        small = await client.post(CHAT, json=chat_body(default_engine.model_name, max_tokens=2), headers=acme.headers)
        assert small.status_code == 200, small.text


async def test_the_default_cap_is_the_settings_not_litestars_10_mb(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        body = chat_body(default_engine.model_name, "x" * (5 * KIB * KIB))
        error = assert_error(await client.post(CHAT, json=body, headers=acme.headers), 413)
        assert "4096 KiB" in error["message"]


async def test_the_upload_has_its_own_cap_of_adapter_megabytes(
    gateway_settings, default_engine, tenant_adapters
) -> None:
    folder = tenant_adapters["alpha"]
    num_bytes = sum((folder / name).stat().st_size for name in ("adapter_config.json", "adapter_model.safetensors"))
    # The general cap is far below the adapter: uploads are not subject to it.
    settings = dataclasses.replace(gateway_settings, max_request_bytes=16 * KIB, max_adapter_bytes=num_bytes + KIB)
    async with gateway_client(settings, default_engine) as (client, gateway):
        admin, _ = await make_admin(gateway)
        acme = await make_tenant(gateway, "acme")
        files = adapter_files(folder)
        ok = await client.post(adapters_url(acme.tenant_id), data={"name": "a"}, files=files, headers=admin.headers)
        assert ok.status_code == 201, ok.text
    settings = dataclasses.replace(settings, max_adapter_bytes=num_bytes // 2)
    async with gateway_client(settings, default_engine) as (client, gateway):  # the same database: the same key
        response = await client.post(
            adapters_url(acme.tenant_id), data={"name": "b"}, files=files, headers=admin.headers
        )
        error = assert_error(response, 413)
        assert error["code"] == "upload_too_large" and "LORAPLEX_MAX_ADAPTER_MB" in error["message"]


# 4. Prompt-length limits ----------------------------------------------------------------------------------


async def test_a_prompt_longer_than_the_context_is_400_context_length_exceeded(gateway_settings, default_engine):
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        words = "hello " * (default_engine.max_model_len + 10)  # one token a word: past the context, under the cap
        assert len(words) < default_engine.max_prompt_chars
        model = default_engine.model_name
        for path, body, param in (
            (CHAT, chat_body(model, words, max_tokens=1), "messages"),
            (COMPLETIONS, {"model": model, "prompt": words, "max_tokens": 1}, "prompt"),
        ):
            error = assert_error(await client.post(path, json=body, headers=acme.headers), 400, param)
            assert error["code"] == "context_length_exceeded"
            assert f"maximum context length is {default_engine.max_model_len} tokens" in error["message"]


async def test_a_huge_prompt_is_refused_without_being_tokenized(gateway_settings, default_engine, monkeypatch):
    encoded = [_Spy(monkeypatch, default_engine, name) for name in ("encode_chat", "encode_prompt")]
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        model = default_engine.model_name
        huge = "All work and no play. " * (3 * KIB * KIB // 22)  # 3 MiB: tokenizing it takes seconds
        many = {"model": model, "messages": [{"role": "user", "content": ""}] * (default_engine.max_model_len + 1)}
        started = time.monotonic()
        for path, body, param in (
            (CHAT, chat_body(model, huge), "messages"),
            (CHAT, many, "messages"),
            (COMPLETIONS, {"model": model, "prompt": huge}, "prompt"),
        ):
            error = assert_error(await client.post(path, json=body, headers=acme.headers), 400, param)
            assert error["code"] == "context_length_exceeded"
        assert all(spy.calls == [] for spy in encoded)
        assert time.monotonic() - started < 5.0


# 5. Admin paths reject inference keys ----------------------------------------------------------------------


def _admin_calls(settings: Settings, engine: Any) -> list[tuple[str, str]]:
    """Every (method, path) under /admin that the app serves, path parameters filled with fresh ids."""
    app = create_app(settings, engine=engine)  # only its route table: nothing starts before its lifespan
    calls = []
    for route in app.routes:
        if not route.path.startswith("/admin"):
            continue
        path = re.sub(r"\{[^}:]+:uuid\}", lambda _: str(uuid.uuid4()), route.path)
        assert "{" not in path, f"fill in the parameters of {route.path}"
        calls += [(method, path) for method in sorted(route.methods - {"OPTIONS", "HEAD"})]
    return calls


async def test_every_admin_route_refuses_inference_keys_and_anonymous_callers(gateway_settings, default_engine):
    calls = _admin_calls(gateway_settings, default_engine)
    assert len(calls) == len(ADMIN_ROUTES)  # every handler was found, and nothing else
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        both = await make_tenant(gateway, "both", scopes=(Scope.INFERENCE,))  # a second tenant, to be sure
        for method, path in calls:
            # A body no route accepts: a route that read it before checking the key would answer 400.
            body = {"json": {"bogus": True}} if method in ("POST", "PATCH", "PUT") else {}
            for caller in (acme, both):
                response = await client.request(method, path, headers=caller.headers, **body)
                error = assert_error(response, 403)
                assert "`admin` or `tenant-admin` scope" in error["message"], (method, path)
            assert_error(await client.request(method, path, **body), 401)
        async with gateway.database.sessions() as session:
            assert list(await session.scalars(select(AuditLog))) == []


# 6. No plaintext key and no secret in logs or error bodies ------------------------------------------------


def _log_everything(caplog: pytest.LogCaptureFixture) -> None:
    """Every record of every logger at DEBUG, SQLAlchemy's statements and rows included, into caplog."""
    caplog.set_level(logging.DEBUG)
    for name in list(logging.root.manager.loggerDict):
        caplog.set_level(logging.DEBUG, logger=name)  # also those a command quietened (httpx)


def _bearer(key: str) -> str:
    return f"Bearer {key}"


async def test_no_key_or_secret_appears_in_any_log_record_or_error(gateway_settings, default_engine, caplog) -> None:
    _log_everything(caplog)
    admin_key = generate_api_key().plaintext  # stored at start (LORAPLEX_ADMIN_KEY), which logs it was
    settings = dataclasses.replace(gateway_settings, admin_key=admin_key, key_secret=uuid.uuid4().hex)
    responses: list[httpx.Response] = []

    async def send(method: str, path: str, authorization: str | None, **kwargs: Any) -> httpx.Response:
        headers = {} if authorization is None else {"Authorization": authorization}
        responses.append(response := await client.request(method, path, headers=headers, **kwargs))
        return response

    admin = _bearer(admin_key)
    async with gateway_client(settings, default_engine) as (client, _):
        tenant = (await send("POST", "/admin/tenants", admin, json={"name": "acme"})).json()
        keys = f"/admin/tenants/{tenant['id']}/keys"
        created = await send("POST", keys, admin, json={"name": "app"})
        first = created.json()["key"]
        assert (await send("GET", "/v1/models", _bearer(first))).status_code == 200
        chat = chat_body(default_engine.model_name, max_tokens=2)
        assert (await send("POST", CHAT, _bearer(first), json=chat)).status_code == 200
        for wrong in (
            _bearer(_wrong_key_with_prefix(first)),
            _bearer(first + "x"),
            _bearer(first[:-1]),
            f"Token {first}",
            first,  # the key without a scheme
            f"{first} {first}",
            f"Bearer  {first} {first}",
        ):
            assert (await send("GET", "/v1/models", wrong)).status_code == 401
        assert (await send("GET", "/admin/tenants", _bearer(first))).status_code == 403
        rotated = await send("POST", f"/admin/keys/{created.json()['id']}/rotate", admin, json={"grace_period_s": 0})
        second = rotated.json()["key"]
        assert (await send("GET", "/v1/models", _bearer(first))).status_code == 401
        assert (await send("DELETE", f"/admin/keys/{rotated.json()['id']}", admin)).status_code == 200
        assert (await send("POST", CHAT, _bearer(second), json=chat)).status_code == 401
        await send("GET", keys, admin)
        await send("GET", "/admin/usage", admin)

    plaintexts = [admin_key, first, second]
    secrets = [*plaintexts, *map(_secret_part, plaintexts), settings.key_secret]
    logged = caplog.text + "\n".join(record.getMessage() for record in caplog.records)
    assert any(record.name.startswith("sqlalchemy") for record in caplog.records), "the capture missed loggers"
    assert [secret for secret in secrets if secret in logged] == []

    shown_once = {first: created, second: rotated}  # the one response that hands each key over
    for response in responses:
        text = response.text + str(response.headers)
        leaked = [
            secret
            for secret in secrets
            if secret in text and not any(shown_once.get(key) is response and secret in key for key in plaintexts)
        ]
        assert leaked == [], (response.request.method, response.request.url, response.status_code)
    errors = "".join(response.text for response in responses if response.status_code >= 400)
    assert errors.count('"error"') >= 10 and not KEY_PATTERN.search(errors)


# 7. Disabled tenants, deleted tenants, revoked and rotated keys: refused from the next request -------------


@pytest.fixture
def key_cache_for_an_hour(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway's authenticator keeps its answers an hour (not CACHE_TTL_S): a refusal at the next request can
    only come from the change's invalidation, however slow the machine is between the two requests."""
    monkeypatch.setattr(gateway_module, "Authenticator", functools.partial(Authenticator, cache_ttl_s=3600.0))


async def _refused_within_cache_life(
    client: httpx.AsyncClient, key: TenantKey, change: Any, status: int, words: str
) -> None:
    """Warm the key's cache entry, make the change, and check the very next request is refused: with
    ``key_cache_for_an_hour``, while the warmed entry is still alive, so a refusal that only came from its expiry
    cannot pass."""
    assert (await client.get("/v1/models", headers=key.headers)).status_code == 200
    await change()
    error = assert_error(await client.get("/v1/models", headers=key.headers), status)
    assert words in error["message"]


@pytest.mark.usefixtures("key_cache_for_an_hour")
async def test_a_disabled_tenant_is_refused_at_the_next_request(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin, _ = await make_admin(gateway)
        acme = await make_tenant(gateway, "acme")
        path = f"/admin/tenants/{acme.tenant_id}"

        async def disable() -> None:
            assert (await client.patch(path, json={"status": "disabled"}, headers=admin.headers)).is_success

        await _refused_within_cache_life(client, acme, disable, 403, "disabled")
        assert (await client.patch(path, json={"status": "active"}, headers=admin.headers)).is_success
        assert (await client.get("/v1/models", headers=acme.headers)).status_code == 200


@pytest.mark.usefixtures("key_cache_for_an_hour")
async def test_a_deleted_tenant_is_refused_at_the_next_request(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin, _ = await make_admin(gateway)
        acme = await make_tenant(gateway, "acme")

        async def delete() -> None:
            assert (await client.delete(f"/admin/tenants/{acme.tenant_id}", headers=admin.headers)).is_success

        await _refused_within_cache_life(client, acme, delete, 401, "revoked")


async def _key_id(gateway: Any, tenant_id: uuid.UUID) -> uuid.UUID:
    async with gateway.database.sessions() as session:
        return (await session.scalars(select(ApiKey.id).where(ApiKey.tenant_id == tenant_id))).one()


@pytest.mark.usefixtures("key_cache_for_an_hour")
async def test_a_revoked_key_is_refused_at_the_next_request(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin, _ = await make_admin(gateway)
        acme = await make_tenant(gateway, "acme")
        key_id = await _key_id(gateway, acme.tenant_id)

        async def revoke() -> None:
            assert (await client.delete(f"/admin/keys/{key_id}", headers=admin.headers)).is_success

        await _refused_within_cache_life(client, acme, revoke, 401, "revoked")


@pytest.mark.usefixtures("key_cache_for_an_hour")
async def test_a_key_rotated_without_grace_is_refused_at_the_next_request(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin, _ = await make_admin(gateway)
        acme = await make_tenant(gateway, "acme")
        key_id = await _key_id(gateway, acme.tenant_id)
        successor: list[str] = []

        async def rotate() -> None:
            response = await client.post(
                f"/admin/keys/{key_id}/rotate", json={"grace_period_s": 0}, headers=admin.headers
            )
            successor.append(response.json()["key"])

        await _refused_within_cache_life(client, acme, rotate, 401, "expired")
        new = {"Authorization": f"Bearer {successor[0]}"}
        assert (await client.get("/v1/models", headers=new)).status_code == 200


async def test_a_lookup_in_flight_when_a_tenant_is_forgotten_does_not_refill_the_cache(
    gateway_settings, default_engine
) -> None:
    """The race the forget must win: a query that read the tenant before the change, answered after it."""
    async with gateway_client(gateway_settings, default_engine) as (_, gateway):
        acme = await make_tenant(gateway, "acme")
    database = Database(gateway_settings.database_url)
    authenticator = Authenticator(database, gateway.key_secret, cache_ttl_s=3600)  # only a forget refreshes it
    lookups: list[str] = []
    event.listen(
        database.engine.sync_engine,
        "before_cursor_execute",
        lambda *args: lookups.append(args[2]) if "api_keys" in args[2] else None,
    )
    try:
        in_flight = asyncio.ensure_future(authenticator.authenticate(f"Bearer {acme.key}", Scope.INFERENCE))
        while not lookups:
            await asyncio.sleep(0)
        # The query is on its way and, a few microseconds later, not yet answered: forget now, change after.
        authenticator.forget_tenant(acme.tenant_id)
        async with database.sessions() as session, session.begin():
            await session.execute(update(Tenant).where(Tenant.id == acme.tenant_id).values(status="disabled"))
        await asyncio.gather(in_flight, return_exceptions=True)  # its answer (almost surely "active") is not kept
        with pytest.raises(TenantDisabledError):
            await authenticator.authenticate(f"Bearer {acme.key}", Scope.INFERENCE)
        assert len(lookups) == 2
    finally:
        await database.close()
