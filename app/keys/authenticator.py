"""From an ``Authorization: Bearer lpx_…`` header to a Principal, usually without a database query.

The one idea: answers are cached per key hash for at most ``cache_ttl_s`` (1 s), counted from the start
of the query that produced them, so the request path rarely touches PostgreSQL while a revocation,
an expiry change, a disabled tenant or a changed limit is seen within a second. A key in steady use
never waits for that query: the first request that reads an answer past three quarters of its lifetime
(``REFRESH_AFTER_FRACTION``) starts a query in the background and goes on with the cached answer,
which the query replaces before it expires (at 200 requests/s on one key, the request that found the
answer expired and waited for PostgreSQL was the slowest of its second); after a failed query, none is
started for ``OUTAGE_RETRY_S``. While the database does
not answer, a key checked within the last ``STALE_IF_ERROR_S`` keeps its last answer (a revocation made
meanwhile is seen once the database is back); a key never seen gets 503. Unknown keys are cached too (as None),
so a client retrying a wrong key does not query on every request. Expiry is checked against the clock
on every call, not only when the cache is filled. Concurrent misses for the same key share one query.

``last_used_at`` is recorded in memory on each success and written by a background task every
``last_used_flush_s`` seconds, never on the request path.

Constant time: the stored hash is compared with :func:`hmac.compare_digest`. The cache is keyed by the
HMAC, which an attacker cannot compute without the server's secret, so its lookups reveal nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial

from sqlalchemy import DateTime, bindparam, func, select, update
from sqlalchemy.exc import SQLAlchemyError

from app.db.database import Database
from app.db.tables import ApiKey, Tenant
from app.keys.auth_errors import (
    ExpiredApiKeyError,
    IncorrectApiKeyError,
    MissingScopeError,
    RevokedApiKeyError,
    ScopeNotValidInTenantError,
    TenantDisabledError,
    bearer_token,
)
from app.keys.secrets import hash_api_key, key_prefix
from app.keys.service import Scope, scope_refusal
from app.limits.limits import NO_LIMITS, Limits
from app.web.errors import ServiceUnavailableError

logger = logging.getLogger(__name__)

CACHE_TTL_S = 1.0  # the promise: a revocation, expiry change or disabled tenant is seen within one second
# An answer older than this part of the TTL is refreshed in the background: a key in use costs 1/0.75 queries a
# second instead of 1, and the query has a quarter of the TTL (250 ms) to answer before a request would wait.
REFRESH_AFTER_FRACTION = 0.75
LAST_USED_FLUSH_S = 30.0  # last_used_at is for people reading listings; half a minute late is fine
MAX_CACHE_ENTRIES = 100_000  # a few tens of MB at most, whatever number of distinct (wrong) keys clients send
STALE_IF_ERROR_S = 3600.0  # through a database outage, keys checked within the last hour keep working
OUTAGE_RETRY_S = 1.0  # after a failed lookup, stale answers are served without asking the database again this long
MASK_TAIL_CHARS = 4  # characters of a wrong key echoed back, as OpenAI does, so the user can tell which key


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the key and its tenant, with the key's valid scopes and the limits that apply to it.

    The limits and the weight come with the cached lookup, so a change to them holds within a second.
    """

    key_id: uuid.UUID
    tenant_id: uuid.UUID
    tenant_name: str
    scopes: frozenset[str]
    tenant_limits: Limits = NO_LIMITS
    key_limits: Limits = NO_LIMITS
    """The key's own limits, which narrow the tenant's (the tenant's hold across all its keys)."""
    fair_share_weight: float = 1.0
    """The tenant's share of the engine when tenants compete for it."""


@dataclass(frozen=True, slots=True)
class _KeyRecord:
    """What the database said about one key; the checks against it run on every call."""

    principal: Principal
    prefix: str
    void_scopes: frozenset[str]  # stored on the key, but not valid in its tenant (``scope_refusal``)
    tenant_active: bool
    expires_at: datetime | None
    revoked_at: datetime | None


@dataclass(frozen=True, slots=True)
class _CacheEntry:
    record: _KeyRecord | None  # None: no stored key has this hash
    fetched_at: float  # time.monotonic() when the query that produced it started


class Authenticator:
    """Checks Bearer keys against ``api_keys`` through a short-lived cache; see the module docstring."""

    def __init__(
        self,
        database: Database,
        key_secret: bytes,
        *,
        cache_ttl_s: float = CACHE_TTL_S,
        last_used_flush_s: float = LAST_USED_FLUSH_S,
        max_cache_entries: int = MAX_CACHE_ENTRIES,
    ) -> None:
        if cache_ttl_s < 0 or last_used_flush_s <= 0 or max_cache_entries < 1:
            raise ValueError(
                f"need cache_ttl_s >= 0, last_used_flush_s > 0 and max_cache_entries >= 1; got {cache_ttl_s}, "
                f"{last_used_flush_s} and {max_cache_entries}"
            )
        self._database = database
        self._key_secret = key_secret
        self._cache_ttl_s = cache_ttl_s
        self._last_used_flush_s = last_used_flush_s
        self._max_cache_entries = max_cache_entries
        self._cache: OrderedDict[bytes, _CacheEntry] = OrderedDict()  # oldest fill first
        self._loading: dict[bytes, asyncio.Task[_KeyRecord | None]] = {}
        self._last_used: dict[uuid.UUID, datetime] = {}
        self._flusher: asyncio.Task[None] | None = None
        self._unreachable_until = 0.0  # time.monotonic() before which a failed database is not asked again
        self._generation = 0  # bumped by each forget: a query begun before it must not fill the cache

    def forget_key(self, key_id: uuid.UUID) -> None:
        """Drop what is cached about one key, so that the next request reads it again (after a revocation)."""
        self._forget(lambda record: record.principal.key_id == key_id)

    def forget_tenant(self, tenant_id: uuid.UUID) -> None:
        """Drop what is cached about a tenant's keys (after it was disabled, deleted or its limits changed)."""
        self._forget(lambda record: record.principal.tenant_id == tenant_id)

    async def authenticate(self, authorization: str | None, *scopes: str) -> Principal:
        """The Principal of the key in `authorization` (the header's value) if it holds one of `scopes`.

        A scope the key's tenant cannot hold (``scope_refusal``: `admin` outside the admin tenant) does not
        count, whatever the key's row says. Raises an AuthenticationError (401) for a missing, malformed,
        unknown, revoked or expired key, a PermissionDeniedError (403) for a disabled tenant or a missing
        scope, and ServiceUnavailableError (503) when the key is not cached and the database does not answer.
        """
        if not scopes or not Scope.VALID.issuperset(scopes):
            raise ValueError(f"scopes must be some of {sorted(Scope.VALID)}; got {scopes!r}")
        plaintext = bearer_token(authorization)
        prefix = key_prefix(plaintext)
        record = await self._lookup(hash_api_key(self._key_secret, plaintext), prefix)
        if record is None:
            raise IncorrectApiKeyError(f"{prefix}_****{plaintext[-MASK_TAIL_CHARS:]}")
        now = datetime.now(UTC)
        if record.revoked_at is not None:
            raise RevokedApiKeyError(prefix, record.revoked_at)
        if record.expires_at is not None and record.expires_at <= now:
            raise ExpiredApiKeyError(prefix, record.expires_at)
        if not record.tenant_active:
            raise TenantDisabledError(record.principal.tenant_name)
        if record.principal.scopes.isdisjoint(scopes):
            void = [scope for scope in scopes if scope in record.void_scopes]
            if void:
                raise ScopeNotValidInTenantError(prefix, scope_refusal(void[0], record.principal.tenant_name) or "")
            raise MissingScopeError(prefix, scopes)
        self._last_used[record.principal.key_id] = now
        return record.principal

    def start(self) -> None:
        """Start writing last_used_at in the background; call from inside the running event loop."""
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_periodically(), name="last-used-flush")

    async def stop(self) -> None:
        """Stop the background writer and write the last_used_at times it had not written yet."""
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
            self._flusher = None
        await self.flush_last_used()

    async def flush_last_used(self) -> int:
        """Write the recorded last-use times in one statement; return how many keys it covered.

        A time never moves backwards (another gateway may have written a later one). On failure the
        times are kept for the next flush and the error is raised.
        """
        pending, self._last_used = self._last_used, {}
        if not pending:
            return 0
        used_at = bindparam("used_at", type_=DateTime(timezone=True))
        statement = (
            update(ApiKey)
            .where(ApiKey.id == bindparam("key_id"))
            .values(last_used_at=func.greatest(ApiKey.last_used_at, used_at))
        )
        try:
            async with self._database.engine.begin() as connection:
                await connection.execute(
                    statement, [{"key_id": key_id, "used_at": used_at} for key_id, used_at in pending.items()]
                )
        except BaseException:
            self._last_used = pending | self._last_used  # times recorded meanwhile are later: they win
            raise
        return len(pending)

    async def _flush_periodically(self) -> None:
        while True:
            await asyncio.sleep(self._last_used_flush_s)
            try:
                await self.flush_last_used()
            except (SQLAlchemyError, OSError) as error:
                logger.warning("could not write last_used_at, will retry in %.0f s: %s", self._last_used_flush_s, error)
            except Exception:
                logger.exception("writing last_used_at failed")

    async def _lookup(self, key_hash: bytes, prefix: str) -> _KeyRecord | None:
        entry = self._cache.get(key_hash)
        now = time.monotonic()
        if entry is not None:
            age = now - entry.fetched_at
            if age < self._cache_ttl_s:
                if age >= self._cache_ttl_s * REFRESH_AFTER_FRACTION and now >= self._unreachable_until:
                    self._loading_task(key_hash, prefix)  # its answer replaces this one before it expires
                return entry.record
            if now < self._unreachable_until and age < STALE_IF_ERROR_S:
                return entry.record
        try:
            # Shielded: a request that goes away (client disconnect) does not cancel the query others await.
            return await asyncio.shield(self._loading_task(key_hash, prefix))
        except ServiceUnavailableError:
            # The database is away: the last answer stands, unless a change made here since dropped it.
            if entry is not None and self._cache.get(key_hash) is entry and now - entry.fetched_at < STALE_IF_ERROR_S:
                return entry.record
            raise

    def _loading_task(self, key_hash: bytes, prefix: str) -> asyncio.Task[_KeyRecord | None]:
        """The query for this key under way, started now if there is none."""
        task = self._loading.get(key_hash)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._load(key_hash, prefix))
            self._loading[key_hash] = task
            task.add_done_callback(partial(self._forget_load, key_hash))
        return task

    def _forget(self, matches: Callable[[_KeyRecord], bool]) -> None:
        self._generation += 1
        self._loading.clear()  # requests from now on start a query of their own instead of joining an older one
        for key_hash in [h for h, entry in self._cache.items() if entry.record is not None and matches(entry.record)]:
            del self._cache[key_hash]

    def _forget_load(self, key_hash: bytes, task: asyncio.Task[_KeyRecord | None]) -> None:
        if self._loading.get(key_hash) is task:  # after a forget, a newer query may hold the slot
            del self._loading[key_hash]
        if not task.cancelled():
            task.exception()  # marks it retrieved: every waiter may have gone away

    async def _load(self, key_hash: bytes, prefix: str) -> _KeyRecord | None:
        fetched_at = time.monotonic()
        generation = self._generation
        statement = (
            select(
                ApiKey.id,
                ApiKey.secret_hash,
                ApiKey.scopes,
                ApiKey.expires_at,
                ApiKey.revoked_at,
                ApiKey.tenant_id,
                ApiKey.rpm_limit,
                ApiKey.tpm_limit,
                ApiKey.max_concurrent,
                ApiKey.monthly_token_budget,
                Tenant.name,
                Tenant.status,
                Tenant.rpm_limit.label("tenant_rpm_limit"),
                Tenant.tpm_limit.label("tenant_tpm_limit"),
                Tenant.max_concurrent.label("tenant_max_concurrent"),
                Tenant.monthly_token_budget.label("tenant_monthly_token_budget"),
                Tenant.fair_share_weight,
            )
            .join(Tenant, Tenant.id == ApiKey.tenant_id)
            .where(ApiKey.prefix == prefix)
        )
        try:
            async with self._database.engine.connect() as connection:
                rows = (await connection.execute(statement)).all()
        except (SQLAlchemyError, OSError) as error:
            if time.monotonic() >= self._unreachable_until:  # one warning a second, not one per request
                logger.warning("could not look up API key %s (cached keys keep working): %s", prefix, error)
            self._unreachable_until = time.monotonic() + OUTAGE_RETRY_S
            raise ServiceUnavailableError(
                "The API key could not be checked because the database is unavailable; retry in a few seconds."
            ) from error
        record = None
        for row in rows:  # usually one row; more only when two keys' random ids collide
            if hmac.compare_digest(row.secret_hash, key_hash):
                void = frozenset(scope for scope in row.scopes if scope_refusal(scope, row.name) is not None)
                record = _KeyRecord(
                    principal=Principal(
                        key_id=row.id,
                        tenant_id=row.tenant_id,
                        tenant_name=row.name,
                        scopes=frozenset(row.scopes) - void,
                        tenant_limits=_limits(
                            row.tenant_rpm_limit,
                            row.tenant_tpm_limit,
                            row.tenant_max_concurrent,
                            row.tenant_monthly_token_budget,
                        ),
                        key_limits=_limits(row.rpm_limit, row.tpm_limit, row.max_concurrent, row.monthly_token_budget),
                        fair_share_weight=row.fair_share_weight,
                    ),
                    prefix=prefix,
                    void_scopes=void,
                    tenant_active=row.status == "active",
                    expires_at=row.expires_at,
                    revoked_at=row.revoked_at,
                )
        if generation == self._generation:
            self._remember(key_hash, _CacheEntry(record, fetched_at))
        return record

    def _remember(self, key_hash: bytes, entry: _CacheEntry) -> None:
        self._cache.pop(key_hash, None)
        self._cache[key_hash] = entry
        now = time.monotonic()
        # Entries sit in fill order, so old ones gather at the front: drop those no outage would use, and the
        # oldest beyond the bound.
        while self._cache:
            oldest = next(iter(self._cache.values()))
            if len(self._cache) <= self._max_cache_entries and now - oldest.fetched_at < STALE_IF_ERROR_S:
                break
            self._cache.popitem(last=False)


def _limits(rpm: int | None, tpm: int | None, max_concurrent: int | None, monthly_tokens: int | None) -> Limits:
    if rpm is None and tpm is None and max_concurrent is None and monthly_tokens is None:
        return NO_LIMITS  # the common case: one shared object
    return Limits(rpm, tpm, max_concurrent, monthly_tokens)
