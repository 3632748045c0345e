"""API keys against a real PostgreSQL: the format, hashed storage, every refusal, the 1 s cache, last_used_at."""

from __future__ import annotations

import asyncio
import re
import stat
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, text, update

from app.db.database import Database
from app.db.tables import ApiKey, Tenant
from app.keys.auth_errors import (
    ExpiredApiKeyError,
    IncorrectApiKeyError,
    MalformedAuthorizationError,
    MissingApiKeyError,
    MissingScopeError,
    RevokedApiKeyError,
    ScopeNotValidInTenantError,
    TenantDisabledError,
)
from app.keys.authenticator import OUTAGE_RETRY_S, Authenticator, Principal
from app.keys.secrets import (
    MalformedApiKeyError,
    generate_api_key,
    hash_api_key,
    key_prefix,
    load_or_create_key_secret,
)
from app.keys.service import ADMIN_TENANT, Scope, create_api_key, revoke_api_key
from app.web.errors import (
    ApiError,
    AuthenticationError,
    BadRequestError,
    NotFoundError,
    PermissionDeniedError,
    ServiceUnavailableError,
)

pytestmark = pytest.mark.anyio

KEY_SECRET = b"a-test-key-secret-of-reasonable-length"
TENANT_NAME = "acme"


@pytest.fixture
async def database(database_url: str, anyio_backend: str) -> AsyncIterator[Database]:
    database = Database(database_url)
    yield database
    await database.close()


@pytest.fixture
async def tenant_id(database: Database) -> uuid.UUID:
    async with database.sessions() as session, session.begin():
        tenant = Tenant(name=TENANT_NAME)
        session.add(tenant)
        await session.flush()
        return tenant.id


async def make_key(
    database: Database,
    tenant_id: uuid.UUID,
    scopes: Sequence[str] = (Scope.INFERENCE,),
    expires_at: datetime | None = None,
) -> tuple[ApiKey, str]:
    async with database.sessions() as session, session.begin():
        return await create_api_key(
            session, tenant_id=tenant_id, name="ci", scopes=scopes, key_secret=KEY_SECRET, expires_at=expires_at
        )


async def execute(database: Database, statement: Any) -> None:
    async with database.sessions() as session, session.begin():
        await session.execute(statement)


@contextmanager
def counting_queries(database: Database) -> Iterator[list[str]]:
    """The SQL statements sent to PostgreSQL inside the block."""
    statements: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        statements.append(statement)

    event.listen(database.engine.sync_engine, "before_cursor_execute", record)
    try:
        yield statements
    finally:
        event.remove(database.engine.sync_engine, "before_cursor_execute", record)


def bearer(plaintext: str) -> str:
    return f"Bearer {plaintext}"


# The format and the keyed hash


def test_generated_keys_have_a_recognisable_prefix_and_a_long_random_secret() -> None:
    keys = [generate_api_key() for _ in range(200)]
    for key in keys:
        assert re.fullmatch(r"lpx_[a-z0-9]{8}_[A-Za-z0-9_-]{43}", key.plaintext), key.plaintext
        assert key.prefix == key.plaintext[:12]
        assert key_prefix(key.plaintext) == key.prefix
        assert key.plaintext not in repr(key)
    assert len({key.plaintext for key in keys}) == len(keys)
    assert len({key.prefix for key in keys}) == len(keys)


@pytest.mark.parametrize(
    "plaintext",
    [
        "",
        "sk-proj-abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJ",
        "lpx_ABCDEFGH_" + "a" * 43,  # the id is lowercase
        "lpx_abcdefg_" + "a" * 43,  # the id is one character short
        "lpx_abcdefgh_" + "a" * 42,  # the secret is one character short
        "lpx_abcdefgh_" + "a" * 44,
        "lpx_abcdefgh_" + "a" * 42 + "=",
        " lpx_abcdefgh_" + "a" * 43,
    ],
)
def test_key_prefix_refuses_what_is_not_a_loraplex_key(plaintext: str) -> None:
    with pytest.raises(MalformedApiKeyError) as caught:
        key_prefix(plaintext)
    assert caught.value.status == 401
    assert "lpx_" in caught.value.message


def test_the_hash_depends_on_the_server_secret() -> None:
    plaintext = generate_api_key().plaintext
    digest = hash_api_key(KEY_SECRET, plaintext)
    assert len(digest) == 32
    assert hash_api_key(KEY_SECRET, plaintext) == digest
    assert hash_api_key(b"another secret", plaintext) != digest
    assert hash_api_key(KEY_SECRET, generate_api_key().plaintext) != digest


def test_the_key_secret_file_is_created_once_with_mode_0600(tmp_path: Path) -> None:
    home = tmp_path / "home" / "loraplex"  # missing folders are created
    first = load_or_create_key_secret(home, None)
    path = home / "key-secret"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(first) >= 32
    assert load_or_create_key_secret(home, None) == first
    assert path.read_text().strip().encode() == first  # the file's text works as LORAPLEX_KEY_SECRET
    assert [p.name for p in home.iterdir()] == ["key-secret"]  # no temporary file left behind
    assert load_or_create_key_secret(tmp_path / "other", None) != first


def test_a_configured_key_secret_wins_and_creates_no_file(tmp_path: Path) -> None:
    assert load_or_create_key_secret(tmp_path, "from-the-environment") == b"from-the-environment"
    assert not (tmp_path / "key-secret").exists()


# Creating and revoking


async def test_the_database_keeps_the_prefix_and_a_keyed_hash_never_the_plaintext(
    database: Database, tenant_id: uuid.UUID
) -> None:
    key, plaintext = await make_key(database, tenant_id, scopes=[Scope.TENANT_ADMIN, Scope.INFERENCE])
    assert key.prefix == key_prefix(plaintext)
    assert key.created_at is not None
    async with database.engine.connect() as connection:
        row_text = (await connection.execute(text("SELECT api_keys::text FROM api_keys"))).scalar_one()
        stored = (await connection.execute(text("SELECT prefix, secret_hash, scopes FROM api_keys"))).one()
    secret_part = plaintext[len(key.prefix) + 1 :]
    assert secret_part not in row_text
    assert plaintext not in row_text
    assert stored.prefix == key.prefix
    assert bytes(stored.secret_hash) == hash_api_key(KEY_SECRET, plaintext)
    assert sorted(stored.scopes) == ["inference", "tenant-admin"]


@pytest.mark.parametrize(
    ("scopes", "expires_in", "named"),
    [
        (["inference", "billing"], None, "'billing'"),
        ([], None, "at least one scope"),
        (["inference"], timedelta(hours=-1), "in the past"),
        (["admin"], None, "only keys of the `admin` tenant may hold it"),
        (["inference", "admin"], None, "only keys of the `admin` tenant may hold it"),
    ],
)
async def test_create_api_key_refuses_bad_input_and_says_why(
    database: Database, tenant_id: uuid.UUID, scopes: list[str], expires_in: timedelta | None, named: str
) -> None:
    expires_at = None if expires_in is None else datetime.now(UTC) + expires_in
    with pytest.raises(BadRequestError) as caught:
        await make_key(database, tenant_id, scopes=scopes, expires_at=expires_at)
    assert named in caught.value.message
    async with database.engine.connect() as connection:
        assert (await connection.execute(text("SELECT count(*) FROM api_keys"))).scalar_one() == 0


async def test_create_api_key_refuses_a_naive_expiry_and_an_unknown_tenant(
    database: Database, tenant_id: uuid.UUID
) -> None:
    with pytest.raises(BadRequestError, match="timezone"):
        await make_key(database, tenant_id, expires_at=datetime.now() + timedelta(days=1))
    with pytest.raises(NotFoundError, match="tenant"):
        await make_key(database, uuid.uuid4())


async def test_revoke_api_key_stamps_the_time_once_and_refuses_an_unknown_id(
    database: Database, tenant_id: uuid.UUID
) -> None:
    key, _ = await make_key(database, tenant_id)
    before = datetime.now(UTC)
    async with database.sessions() as session, session.begin():
        revoked = await revoke_api_key(session, key.id)
    assert revoked.revoked_at is not None and before <= revoked.revoked_at <= datetime.now(UTC)
    async with database.sessions() as session, session.begin():
        again = await revoke_api_key(session, key.id)
    assert again.revoked_at == revoked.revoked_at
    async with database.sessions() as session:
        with pytest.raises(NotFoundError):
            await revoke_api_key(session, uuid.uuid4())


# Authenticating


async def test_a_good_key_gives_its_principal(database: Database, tenant_id: uuid.UUID) -> None:
    key, plaintext = await make_key(database, tenant_id, scopes=[Scope.INFERENCE, Scope.TENANT_ADMIN])
    authenticator = Authenticator(database, KEY_SECRET)
    principal = await authenticator.authenticate(bearer(plaintext), Scope.TENANT_ADMIN)
    assert principal == Principal(
        key_id=key.id, tenant_id=tenant_id, tenant_name=TENANT_NAME, scopes=frozenset({"inference", "tenant-admin"})
    )
    assert await authenticator.authenticate(f"  bearer   {plaintext} ", Scope.INFERENCE) == principal


@pytest.mark.parametrize(
    ("header", "error", "says"),
    [
        (None, MissingApiKeyError, "didn't provide an API key"),
        ("", MissingApiKeyError, "didn't provide an API key"),
        ("Bearer ", MissingApiKeyError, "didn't provide an API key"),
        ("Basic dXNlcjpwYXNz", MalformedAuthorizationError, "`Basic` scheme"),
        ("{key}", MalformedAuthorizationError, "without the Bearer scheme"),
        ("Bearer sk-abcdefghijklmnopqrstuvwxyz", MalformedApiKeyError, "malformed"),
        ("Bearer {key}x", MalformedApiKeyError, "malformed"),
        ("Bearer {unknown}", IncorrectApiKeyError, "Incorrect API key provided: lpx_"),
    ],
)
async def test_requests_without_a_usable_key_get_401_saying_what_to_fix(
    database: Database, tenant_id: uuid.UUID, header: str | None, error: type[ApiError], says: str
) -> None:
    _, plaintext = await make_key(database, tenant_id)
    unknown = plaintext[:-1] + ("A" if plaintext[-1] != "A" else "B")  # well-formed, but no such key
    if header is not None:
        header = header.format(key=plaintext, unknown=unknown)
    with pytest.raises(error) as caught:
        await Authenticator(database, KEY_SECRET).authenticate(header, Scope.INFERENCE)
    assert isinstance(caught.value, AuthenticationError)
    assert caught.value.status == 401
    assert caught.value.body()["error"]["code"] == "invalid_api_key"
    assert says in caught.value.message
    assert plaintext[12:-4] not in caught.value.message  # never echo the secret back


async def test_an_unknown_key_is_echoed_masked(database: Database, tenant_id: uuid.UUID) -> None:
    unknown = generate_api_key()
    with pytest.raises(IncorrectApiKeyError) as caught:
        await Authenticator(database, KEY_SECRET).authenticate(bearer(unknown.plaintext), Scope.INFERENCE)
    assert f"{unknown.prefix}_****{unknown.plaintext[-4:]}" in caught.value.message


async def test_a_revoked_or_expired_key_gets_401_saying_so(database: Database, tenant_id: uuid.UUID) -> None:
    revoked, revoked_plaintext = await make_key(database, tenant_id)
    expired, expired_plaintext = await make_key(database, tenant_id, expires_at=datetime.now(UTC) + timedelta(days=1))
    async with database.sessions() as session, session.begin():
        await revoke_api_key(session, revoked.id)
    expired_at = datetime(2024, 3, 1, 12, 30, tzinfo=UTC)
    await execute(database, update(ApiKey).where(ApiKey.id == expired.id).values(expires_at=expired_at))
    authenticator = Authenticator(database, KEY_SECRET)
    with pytest.raises(RevokedApiKeyError, match=f"{revoked.prefix} was revoked at ") as caught:
        await authenticator.authenticate(bearer(revoked_plaintext), Scope.INFERENCE)
    assert caught.value.status == 401
    with pytest.raises(ExpiredApiKeyError, match=f"{expired.prefix} expired at 2024-03-01 12:30:00 UTC") as caught:
        await authenticator.authenticate(bearer(expired_plaintext), Scope.INFERENCE)
    assert caught.value.status == 401


async def test_a_disabled_tenant_or_a_missing_scope_gets_403(database: Database, tenant_id: uuid.UUID) -> None:
    inference_key, inference_plaintext = await make_key(database, tenant_id, scopes=[Scope.INFERENCE])
    _, admin_plaintext = await make_key(database, tenant_id, scopes=[Scope.TENANT_ADMIN])
    authenticator = Authenticator(database, KEY_SECRET, cache_ttl_s=0)
    with pytest.raises(MissingScopeError, match=f"{inference_key.prefix} lacks the `tenant-admin` scope") as caught:
        await authenticator.authenticate(bearer(inference_plaintext), Scope.TENANT_ADMIN)
    assert isinstance(caught.value, PermissionDeniedError) and caught.value.status == 403
    with pytest.raises(MissingScopeError, match="`inference` scope"):
        await authenticator.authenticate(bearer(admin_plaintext), Scope.INFERENCE)

    await execute(database, update(Tenant).where(Tenant.id == tenant_id).values(status="disabled"))
    with pytest.raises(TenantDisabledError, match=f"`{TENANT_NAME}` is disabled") as caught:
        await authenticator.authenticate(bearer(inference_plaintext), Scope.INFERENCE)
    assert caught.value.status == 403


async def test_a_scope_the_tenant_cannot_hold_counts_for_nothing(database: Database, tenant_id: uuid.UUID) -> None:
    generated = generate_api_key()
    async with database.sessions() as session, session.begin():  # stored as earlier versions let the API store it
        session.add(
            ApiKey(
                tenant_id=tenant_id,
                name="old-admin",
                prefix=generated.prefix,
                secret_hash=hash_api_key(KEY_SECRET, generated.plaintext),
                scopes=[Scope.ADMIN, Scope.INFERENCE],
            )
        )
    authenticator = Authenticator(database, KEY_SECRET, cache_ttl_s=0)
    for scopes in ((Scope.ADMIN,), (Scope.ADMIN, Scope.TENANT_ADMIN)):
        with pytest.raises(ScopeNotValidInTenantError, match="only keys of the `admin` tenant may hold it") as caught:
            await authenticator.authenticate(bearer(generated.plaintext), *scopes)
        assert caught.value.status == 403
    principal = await authenticator.authenticate(bearer(generated.plaintext), Scope.INFERENCE)
    assert principal.scopes == frozenset({Scope.INFERENCE})

    # In the admin tenant the same scopes hold; a tenant-admin key stored there would count for nothing.
    await execute(database, update(Tenant).where(Tenant.id == tenant_id).values(name=ADMIN_TENANT))
    principal = await authenticator.authenticate(bearer(generated.plaintext), Scope.ADMIN, Scope.TENANT_ADMIN)
    assert principal.scopes == frozenset({Scope.ADMIN, Scope.INFERENCE})
    with pytest.raises(BadRequestError, match="give this key the `admin` scope"):
        await make_key(database, tenant_id, scopes=[Scope.TENANT_ADMIN])


# The cache


async def test_a_cached_key_costs_no_query_and_neither_does_a_repeated_wrong_key(
    database: Database, tenant_id: uuid.UUID
) -> None:
    _, plaintext = await make_key(database, tenant_id)
    wrong = generate_api_key().plaintext
    authenticator = Authenticator(database, KEY_SECRET)
    with counting_queries(database) as statements:
        await authenticator.authenticate(bearer(plaintext), Scope.INFERENCE)
        assert len(statements) == 1
        for _ in range(3):
            await authenticator.authenticate(bearer(plaintext), Scope.INFERENCE)
        with pytest.raises(MissingScopeError):
            await authenticator.authenticate(bearer(plaintext), Scope.TENANT_ADMIN)
        assert len(statements) == 1
        for _ in range(3):
            with pytest.raises(IncorrectApiKeyError):
                await authenticator.authenticate(bearer(wrong), Scope.INFERENCE)
        assert len(statements) == 2


async def test_a_revocation_takes_effect_within_one_second_even_for_a_cached_key(
    database: Database, tenant_id: uuid.UUID
) -> None:
    key, plaintext = await make_key(database, tenant_id)
    authenticator = Authenticator(database, KEY_SECRET)
    await authenticator.authenticate(bearer(plaintext), Scope.INFERENCE)
    async with database.sessions() as session, session.begin():
        await revoke_api_key(session, key.id)
    await asyncio.sleep(1.05)
    with pytest.raises(RevokedApiKeyError):
        await authenticator.authenticate(bearer(plaintext), Scope.INFERENCE)


async def test_a_key_in_steady_use_is_refreshed_in_the_background_without_waiting(
    database: Database, tenant_id: uuid.UUID
) -> None:
    """Past three quarters of its TTL an answer is still served at once, while a query in the background replaces it."""
    key, plaintext = await make_key(database, tenant_id)
    authenticator = Authenticator(database, KEY_SECRET, cache_ttl_s=2.0)  # refreshed from 1.5 s on
    await authenticator.authenticate(bearer(plaintext), Scope.INFERENCE)
    async with database.sessions() as session, session.begin():
        await revoke_api_key(session, key.id)
    await asyncio.sleep(1.6)
    with counting_queries(database) as statements:
        principal = await authenticator.authenticate(bearer(plaintext), Scope.INFERENCE)
        assert principal.key_id == key.id and statements == []  # the cached answer; the query has not run
        await asyncio.sleep(0.2)  # the background query runs meanwhile
        assert len(statements) == 1
        with pytest.raises(RevokedApiKeyError):  # the refreshed answer, before the first one expired
            await authenticator.authenticate(bearer(plaintext), Scope.INFERENCE)
        assert len(statements) == 1


async def test_a_disabled_tenant_is_seen_once_the_cache_entry_is_older_than_its_ttl(
    database: Database, tenant_id: uuid.UUID
) -> None:
    _, plaintext = await make_key(database, tenant_id)
    authenticator = Authenticator(database, KEY_SECRET, cache_ttl_s=0.2)
    await authenticator.authenticate(bearer(plaintext), Scope.INFERENCE)
    await execute(database, update(Tenant).where(Tenant.id == tenant_id).values(status="disabled"))
    await asyncio.sleep(0.25)
    with pytest.raises(TenantDisabledError):
        await authenticator.authenticate(bearer(plaintext), Scope.INFERENCE)


async def test_expiry_is_checked_on_every_call_not_only_when_the_cache_fills(
    database: Database, tenant_id: uuid.UUID
) -> None:
    _, plaintext = await make_key(database, tenant_id, expires_at=datetime.now(UTC) + timedelta(seconds=0.4))
    authenticator = Authenticator(database, KEY_SECRET, cache_ttl_s=60)
    await authenticator.authenticate(bearer(plaintext), Scope.INFERENCE)
    await asyncio.sleep(0.45)
    with counting_queries(database) as statements, pytest.raises(ExpiredApiKeyError):
        await authenticator.authenticate(bearer(plaintext), Scope.INFERENCE)
    assert statements == []  # the answer came from the cache, yet the key is refused


async def test_concurrent_requests_with_an_uncached_key_share_one_query(
    database: Database, tenant_id: uuid.UUID
) -> None:
    key, plaintext = await make_key(database, tenant_id)
    authenticator = Authenticator(database, KEY_SECRET)
    with counting_queries(database) as statements:
        principals = await asyncio.gather(
            *(authenticator.authenticate(bearer(plaintext), Scope.INFERENCE) for _ in range(20))
        )
    assert {principal.key_id for principal in principals} == {key.id}
    assert len(statements) == 1


async def test_the_cache_is_bounded_and_evicts_the_oldest_entry(database: Database, tenant_id: uuid.UUID) -> None:
    first, second, third = (generate_api_key().plaintext for _ in range(3))
    authenticator = Authenticator(database, KEY_SECRET, max_cache_entries=2)
    with counting_queries(database) as statements:
        for plaintext in (first, second, third, third, second, first):
            with pytest.raises(IncorrectApiKeyError):
                await authenticator.authenticate(bearer(plaintext), Scope.INFERENCE)
    assert len(statements) == 4  # three misses, then `first` again: it was the oldest when `third` came


# last_used_at


async def last_used_at(database: Database, key_id: uuid.UUID) -> datetime | None:
    async with database.sessions() as session:
        key = await session.get(ApiKey, key_id)
        assert key is not None
        return key.last_used_at


async def test_last_used_at_is_written_by_the_flush_not_by_the_request(
    database: Database, tenant_id: uuid.UUID
) -> None:
    key, plaintext = await make_key(database, tenant_id)
    authenticator = Authenticator(database, KEY_SECRET)
    with counting_queries(database) as statements:
        await authenticator.authenticate(bearer(plaintext), Scope.INFERENCE)
        used = datetime.now(UTC)
        await authenticator.authenticate(bearer(plaintext), Scope.INFERENCE)
    assert len(statements) == 1 and statements[0].lstrip().upper().startswith("SELECT")
    assert await last_used_at(database, key.id) is None

    assert await authenticator.flush_last_used() == 1
    written = await last_used_at(database, key.id)
    assert written is not None and used <= written <= datetime.now(UTC)
    assert await authenticator.flush_last_used() == 0  # nothing new to write


async def test_stop_writes_what_the_background_task_had_not_written(database: Database, tenant_id: uuid.UUID) -> None:
    key, plaintext = await make_key(database, tenant_id)
    authenticator = Authenticator(database, KEY_SECRET, last_used_flush_s=3600)
    authenticator.start()
    await authenticator.authenticate(bearer(plaintext), Scope.INFERENCE)
    assert await last_used_at(database, key.id) is None
    await authenticator.stop()
    assert await last_used_at(database, key.id) is not None


async def test_the_background_task_writes_last_used_at_periodically(database: Database, tenant_id: uuid.UUID) -> None:
    key, plaintext = await make_key(database, tenant_id)
    authenticator = Authenticator(database, KEY_SECRET, last_used_flush_s=0.1)
    authenticator.start()
    try:
        await authenticator.authenticate(bearer(plaintext), Scope.INFERENCE)
        for _ in range(50):
            if await last_used_at(database, key.id) is not None:
                break
            await asyncio.sleep(0.05)
        assert await last_used_at(database, key.id) is not None
    finally:
        await authenticator.stop()


async def test_a_later_use_recorded_elsewhere_is_never_overwritten_by_an_older_one(
    database: Database, tenant_id: uuid.UUID
) -> None:
    key, plaintext = await make_key(database, tenant_id)
    later = datetime.now(UTC) + timedelta(hours=1)  # as if another gateway had written a later use
    await execute(database, update(ApiKey).where(ApiKey.id == key.id).values(last_used_at=later))
    authenticator = Authenticator(database, KEY_SECRET)
    await authenticator.authenticate(bearer(plaintext), Scope.INFERENCE)
    await authenticator.flush_last_used()
    assert await last_used_at(database, key.id) == later


UNREACHABLE_URL = "postgresql://postgres@/loraplex?host=/nonexistent-socket-dir"


class SwitchableDatabase:
    """A Database whose engine can be swapped for one that never connects: an outage, on demand."""

    def __init__(self, database: Database) -> None:
        self.working = database
        self.unreachable = Database(UNREACHABLE_URL)
        self.engine = database.engine

    def go_down(self) -> None:
        self.engine = self.unreachable.engine

    def come_back(self) -> None:
        self.engine = self.working.engine


async def test_through_an_outage_cached_keys_keep_working_and_forgotten_or_unseen_keys_get_503(
    database: Database, tenant_id: uuid.UUID
) -> None:
    switchable = SwitchableDatabase(database)
    authenticator = Authenticator(switchable, KEY_SECRET, cache_ttl_s=0.05)  # type: ignore[arg-type]
    (_, cached), (revoked_row, forgotten), (_, unseen) = [await make_key(database, tenant_id) for _ in range(3)]
    try:
        for plaintext in (cached, forgotten):
            await authenticator.authenticate(bearer(plaintext), Scope.INFERENCE)
        authenticator.forget_key(revoked_row.id)  # what a revocation made on this replica does
        await asyncio.sleep(0.1)  # both entries are past their TTL
        switchable.go_down()
        for _ in range(3):  # the first attempt fails over to the cache, the next ones do not even ask
            assert (await authenticator.authenticate(bearer(cached), Scope.INFERENCE)).tenant_id == tenant_id
        for plaintext in (forgotten, unseen):
            with pytest.raises(ServiceUnavailableError, match="database is unavailable"):
                await authenticator.authenticate(bearer(plaintext), Scope.INFERENCE)
        switchable.come_back()
        await asyncio.sleep(OUTAGE_RETRY_S + 0.05)
        with counting_queries(database) as statements:
            await authenticator.authenticate(bearer(unseen), Scope.INFERENCE)
        assert len(statements) == 1, "once the database is back, keys are looked up again"
    finally:
        await switchable.unreachable.close()


async def test_a_failed_background_refresh_keeps_the_cached_answer_and_is_not_retried_at_once(
    database: Database, tenant_id: uuid.UUID
) -> None:
    switchable = SwitchableDatabase(database)
    authenticator = Authenticator(switchable, KEY_SECRET)  # type: ignore[arg-type]  # refreshed from 0.75 s on
    key, plaintext = await make_key(database, tenant_id)
    attempts: list[object] = []
    event.listen(switchable.unreachable.engine.sync_engine, "do_connect", lambda *args: attempts.append(args))
    try:
        await authenticator.authenticate(bearer(plaintext), Scope.INFERENCE)
        await asyncio.sleep(0.8)
        switchable.go_down()
        for _ in range(5):
            assert (await authenticator.authenticate(bearer(plaintext), Scope.INFERENCE)).key_id == key.id
            await asyncio.sleep(0.02)  # the background query fails meanwhile
        assert len(attempts) == 1, "after a failed refresh, the next ones wait OUTAGE_RETRY_S"
        await asyncio.sleep(0.3)  # past the TTL: the last answer stands through the outage
        assert (await authenticator.authenticate(bearer(plaintext), Scope.INFERENCE)).key_id == key.id
    finally:
        await switchable.unreachable.close()
