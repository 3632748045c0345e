"""Admin changes to adapters and tenant deletions, announced to every gateway replica through ``LISTEN/NOTIFY``.

A delete, unload, pin or unpin sends ``NOTIFY loraplex_adapters, '{"op": ..., "adapter_id": ..., "digest":
..., "origin": ...}'`` in the transaction that makes the change, so PostgreSQL delivers it on commit and never
for a change that rolled back. Each replica keeps one connection of its own listening, and applies what it
hears in order: delete retires the adapter and removes it from the engine (the same removal a local
delete uses, waiting for running requests), unload removes it from the engine, pin and unpin set the
engine's pin. Deleting a tenant sends ``{"op": "delete_tenant", "tenant_id": ..., "origin": ...}`` and a delete
of each of its adapters, in the same transaction: every replica drops what it has cached about the tenant's keys
and models, so its next request with one of those keys reads the revocation, and retires the adapters.

``origin`` is the announcing replica's ``Database.replica_id``. A replica applies its own change before its
request answers, so it skips its own announcements: heard late, they would undo what it did since (an unload
heard after the pin that followed it would remove the pinned adapter). An unload or pin heard from another
replica is applied as the tables say now, not as announced: an unload of an adapter pinned since (a pin that
committed later, whose announcement is still to come) is skipped, and a pin or unpin sets the engine's pin to
the column's current value. Applying is idempotent.

Notifications sent while a replica is not listening (restart, dropped connection) are lost, so every
(re)connection catches up from the tables: every adapter this engine holds is re-read; a deleted one is
removed, a live one pinned or unpinned as its ``pinned`` column says, and what is cached about every
deleted tenant (its row stays, status ``deleted``) is dropped. A missed unload is not replayed
(it leaves no trace in the tables), so that replica keeps the adapter until it is evicted or unloaded.
The connection is checked every ``HEALTH_CHECK_S`` and re-opened with backoff when it drops.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from enum import StrEnum

import asyncpg
from sqlalchemy import select, text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession

from app.adapters.resolver import ModelResolver
from app.db.database import REPLICA_ID, Database
from app.db.tables import Adapter, Tenant
from app.engine_clients.interface import EngineClient
from app.retry import Backoff
from engine.errors import AdapterError

logger = logging.getLogger(__name__)

CHANNEL = "loraplex_adapters"
DELETED = "deleted"
HEALTH_CHECK_S = 5.0  # a connection that died silently (no FIN from a vanished host) is noticed within this
HEALTH_CHECK_TIMEOUT_S = 2.0
MIN_BACKOFF_S = 0.1  # reconnecting: the first wait's ceiling, doubled per failure up to MAX_BACKOFF_S
MAX_BACKOFF_S = 5.0
CLOSE_TIMEOUT_S = 2.0

Retire = Callable[[uuid.UUID, str], Awaitable[None]]
"""Take a deleted adapter (id, digest) out of this replica: resolver, engine, cached files."""
Unload = Callable[[uuid.UUID], Awaitable[None]]
"""Remove an adapter from this replica's engine when no request uses it."""
ForgetTenant = Callable[[uuid.UUID], None]
"""Drop what this replica caches about a deleted tenant (its keys, its model lookups)."""


class Op(StrEnum):
    DELETE = "delete"
    UNLOAD = "unload"
    PIN = "pin"
    UNPIN = "unpin"
    DELETE_TENANT = "delete_tenant"


_CATCH_UP = object()  # queued after every (re)connection: re-read the tables


async def announce(session: AsyncSession, op: Op, adapter_id: uuid.UUID, digest: str) -> None:
    """Queue the announcement in the session's transaction; PostgreSQL sends it when that commits."""
    await _notify(session, {"op": op.value, "adapter_id": str(adapter_id), "digest": digest})


async def announce_tenant_deleted(session: AsyncSession, tenant_id: uuid.UUID) -> None:
    """Queue a tenant's deletion in the session's transaction (its adapters' deletes are announced apart)."""
    await _notify(session, {"op": Op.DELETE_TENANT.value, "tenant_id": str(tenant_id)})


async def _notify(session: AsyncSession, message: dict[str, str]) -> None:
    """``message`` with the announcing replica (the one whose Database opened ``session``), sent on commit."""
    payload = json.dumps({**message, "origin": str(session.info[REPLICA_ID])})
    await session.execute(text("SELECT pg_notify(:channel, :payload)"), {"channel": CHANNEL, "payload": payload})


class AdapterAnnouncements:
    """One replica's listener: applies the other replicas' adapter changes to this replica."""

    def __init__(
        self,
        database: Database,
        engine: EngineClient,
        resolver: ModelResolver,
        retire: Retire,
        unload: Unload,
        forget_tenant: ForgetTenant,
    ) -> None:
        self.database = database
        self.engine = engine
        self.resolver = resolver
        self.retire = retire
        self.unload = unload
        self.forget_tenant = forget_tenant
        self.min_backoff_s = MIN_BACKOFF_S
        self.backend_pid: int | None = None
        """The listening connection's server process (None while disconnected)."""
        self.num_connections = 0
        """Connections opened so far; each one was followed by a catch-up."""
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._listen(), name="adapter-announcements-listen"),
            asyncio.create_task(self._apply_all(), name="adapter-announcements-apply"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    # The connection ----------------------------------------------------------------------------------

    async def _listen(self) -> None:
        backoff = Backoff(self.min_backoff_s, MAX_BACKOFF_S)
        while True:
            try:
                connection = await self.database.connect_driver()
            except Exception as error:  # any failure to connect is retried: the listener must outlive outages
                logger.warning("adapter announcements: cannot connect (%s); retrying", error)
            else:
                try:
                    await self._serve(connection)
                    backoff.reset()  # it was up; the next drop starts over
                except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as error:
                    logger.warning("adapter announcements: connection lost (%s); reconnecting", error)
                except Exception:
                    logger.exception("adapter announcements: listening failed; reconnecting")
                finally:
                    self.backend_pid = None
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(connection.close(), CLOSE_TIMEOUT_S)
            await backoff.wait()

    async def _serve(self, connection: asyncpg.Connection) -> None:
        """Listen on ``connection`` until it drops; the catch-up is queued after LISTEN, so nothing falls between."""
        lost = asyncio.Event()
        connection.add_termination_listener(lambda _connection: lost.set())
        await connection.add_listener(CHANNEL, self._heard)
        self.backend_pid = connection.get_server_pid()
        self.num_connections += 1
        self._queue.put_nowait(_CATCH_UP)
        logger.info("adapter announcements: listening (connection %d)", self.num_connections)
        while not lost.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(lost.wait(), HEALTH_CHECK_S)
                break
            await connection.fetchval("SELECT 1", timeout=HEALTH_CHECK_TIMEOUT_S)
        logger.warning("adapter announcements: the listening connection closed; reconnecting")

    def _heard(self, _connection: object, _pid: int, _channel: str, payload: str) -> None:
        self._queue.put_nowait(payload)

    # Applying ----------------------------------------------------------------------------------------

    async def _apply_all(self) -> None:
        while True:
            item = await self._queue.get()
            try:
                if item is _CATCH_UP:
                    await self._catch_up()
                else:
                    await self._apply(str(item))
            except (SQLAlchemyError, OSError, AdapterError) as error:
                logger.warning(
                    "adapter announcements: could not apply %s: %s", "catch-up" if item is _CATCH_UP else item, error
                )
            except Exception:
                logger.exception("adapter announcements: applying %s failed", item)
            finally:
                self._queue.task_done()

    async def _apply(self, payload: str) -> None:
        try:
            message = json.loads(payload)
            if message.get("origin") == str(self.database.replica_id):
                return  # this replica's own change, applied when it was made
            op = Op(message["op"])
            if op is Op.DELETE_TENANT:
                self.forget_tenant(uuid.UUID(message["tenant_id"]))
                logger.info("adapter announcements: applied the deletion of tenant %s", message["tenant_id"])
                return
            adapter_id = uuid.UUID(message["adapter_id"])
            digest = str(message["digest"])
        except (ValueError, KeyError, TypeError):
            logger.warning("adapter announcements: ignored a malformed payload %r", payload[:200])
            return
        name = str(adapter_id)
        if op is Op.DELETE:
            if not self.resolver.is_retired(adapter_id):
                await self.retire(adapter_id, digest)
        elif op is Op.UNLOAD:
            if await self._pinned_now(adapter_id):
                logger.info("adapter announcements: skipped the unload of adapter %s, pinned since", adapter_id)
                return
            await self.unload(adapter_id)
        elif self.engine.has_adapter(name):  # pin or unpin: an adapter registered later reads the column
            await self.engine.pin_adapter(name, await self._pinned_now(adapter_id))
        logger.info("adapter announcements: applied %s of adapter %s", op.value, adapter_id)

    async def _pinned_now(self, adapter_id: uuid.UUID) -> bool:
        """The adapter's ``pinned`` column as committed now (False for a row that is gone)."""
        async with self.database.sessions() as session:
            return bool(await session.scalar(select(Adapter.pinned).where(Adapter.id == adapter_id)))

    async def _catch_up(self) -> None:
        """Forget every deleted tenant; bring every adapter this engine holds in line with its row."""
        query = select(Adapter.id, Adapter.digest, Adapter.status, Adapter.pinned)
        async with self.database.sessions() as session:
            deleted_tenant_ids = list(await session.scalars(select(Tenant.id).where(Tenant.status == DELETED)))
            rows = (await session.execute(query)).all()
        for tenant_id in deleted_tenant_ids:
            self.forget_tenant(tenant_id)
        for row in rows:
            name = str(row.id)
            if not self.engine.has_adapter(name):
                continue
            if row.status == DELETED:
                if not self.resolver.is_retired(row.id):
                    await self.retire(row.id, row.digest)
            else:
                await self.engine.pin_adapter(name, row.pinned)
        logger.info(
            "adapter announcements: caught up from the tables (%d adapters, %d deleted tenants)",
            len(rows),
            len(deleted_tenant_ids),
        )
