"""Which engines hold an adapter: load, unload and pin from the admin API, and unloads announced by other replicas.

Load, unload and pin change no row of their own, so each one's audit row is its transaction (pin and unload
also store the pin they imply in ``adapters.pinned`` and announce it there).

Unload of an adapter that requests are using waits up to ``UNLOAD_WAIT_S`` for them, then answers 409 saying
how many requests use it; nothing is aborted.

Pins are stored in ``adapters.pinned`` (what the API reports); the engine here is pinned at once and every
other replica's when it hears the announcement, or when it registers the adapter. An adapter that leaves the
engines, by unload or delete, loses its pin.
"""

from __future__ import annotations

import logging
import re
import uuid

from sqlalchemy import update

from app.adapters.announcements import Op, announce
from app.adapters.resolver import ModelResolver
from app.admin.adapters.removal import AdapterRemovals
from app.admin.adapters.rows import DELETED, READY, adapter_out, no_adapter
from app.admin.adapters.schemas import AdapterOut
from app.admin.audit import record_change
from app.db.database import Database
from app.db.tables import Adapter
from app.engine_clients.interface import EngineClient
from app.keys.authenticator import Principal
from app.web.errors import ConflictError
from engine.errors import UnknownAdapterError

logger = logging.getLogger(__name__)

UNLOAD_WAIT_S = 5.0  # an unload waits this long for the requests using the adapter before answering 409
PIN_ATTEMPTS = 3  # a pin registers an adapter that left the engine meanwhile again, this many times at most


class AdapterInUseError(ConflictError):
    code = "adapter_in_use"


class AdapterNotReadyError(ConflictError):
    code = "adapter_not_ready"


class AdapterNotPinnedError(ConflictError):
    code = "adapter_not_pinned"


class AdapterResidency:
    """Registering, removing and pinning adapters in this replica's engine, recorded and announced to the others."""

    def __init__(
        self, database: Database, engine: EngineClient, resolver: ModelResolver, removals: AdapterRemovals
    ) -> None:
        self.database = database
        self.engine = engine
        self.resolver = resolver
        self.removals = removals
        self.unload_wait_s = UNLOAD_WAIT_S

    async def load(self, actor: Principal, adapter_id: uuid.UUID) -> AdapterOut:
        """Register the adapter in the engine now (a no-op when it is there)."""
        row = await self._live_row(adapter_id)
        before = adapter_out(row, self.engine)
        await self._register(row)
        return await self._audited(actor, "adapter.load", row, before)

    async def unload(self, actor: Principal, adapter_id: uuid.UUID) -> AdapterOut:
        """Remove the adapter from the engine (the next request loads it again); 409 while requests use it."""
        row = await self._live_row(adapter_id)
        before = adapter_out(row, self.engine)
        if (busy := await self.removals.remove_within(row.id, self.unload_wait_s)) is not None:
            used_by = re.search(r"used by (\d+)", str(busy))
            users = f"{used_by[1]} request(s) are" if used_by else "requests are"
            raise AdapterInUseError(
                f"The adapter {row.name!r} ({row.id}) was not unloaded: {users} using it after "
                f"{self.unload_wait_s:g} s of waiting. Retry later; nothing was changed."
            )
        return await self._audited(actor, "adapter.unload", row, before, Op.UNLOAD)

    async def unload_here(self, adapter_id: uuid.UUID) -> None:
        """Another replica's unload, applied to this engine: wait up to ``unload_wait_s`` for its requests."""
        if (busy := await self.removals.remove_within(adapter_id, self.unload_wait_s)) is not None:
            logger.warning("announced unload of adapter %s not applied here: %s", adapter_id, busy)

    async def pin(self, actor: Principal, adapter_id: uuid.UUID, pinned: bool) -> AdapterOut:
        """Pin: register and keep resident in every replica's pool (stored, announced); unpin: evictable again."""
        row = await self._live_row(adapter_id)
        before = adapter_out(row, self.engine)
        name = str(row.id)
        if pinned:
            await self._register(row)
        out = await self._audited(
            actor, "adapter.pin" if pinned else "adapter.unpin", row, before, Op.PIN if pinned else Op.UNPIN
        )
        for _ in range(PIN_ATTEMPTS):
            try:
                if pinned or self.engine.has_adapter(name):
                    await self.engine.pin_adapter(name, pinned)
                return out
            except UnknownAdapterError:  # it left the engine since it was registered (evicted, or unloaded)
                if not pinned:
                    return out
                await self._register(row)  # the row says pinned now: registered pinned
        raise AdapterNotPinnedError(
            f"The pin of adapter {row.name!r} ({row.id}) is stored, but the adapter kept leaving this engine while "
            "it was being pinned (unloaded or deleted meanwhile?); retry to make it resident here now."
        )

    async def _register(self, row: Adapter) -> None:
        if not await self.resolver.ensure_loaded(row.id, row.digest, row.pinned):
            raise no_adapter(row.id)  # deleted meanwhile

    async def _live_row(self, adapter_id: uuid.UUID) -> Adapter:
        async with self.database.sessions() as session:
            row = await session.get(Adapter, adapter_id)
        if row is None or row.status == DELETED:
            raise no_adapter(adapter_id)
        if row.status != READY:
            raise AdapterNotReadyError(f"The adapter {row.name!r} ({row.id}) is {row.status}; upload it again.")
        return row

    async def _audited(
        self, actor: Principal, action: str, row: Adapter, before: AdapterOut, op: Op | None = None
    ) -> AdapterOut:
        """Write the audit row; with ``op``, also store the pin it implies and announce it, in one transaction."""
        async with self.database.sessions() as session, session.begin():
            if op is not None:
                row.pinned = op is Op.PIN  # unload and unpin both leave the adapter unpinned
                await session.execute(update(Adapter).where(Adapter.id == row.id).values(pinned=row.pinned))
                await announce(session, op, row.id, row.digest)
            after = adapter_out(row, self.engine)
            record_change(session, actor, action, "adapter", row.id, before.audit_record(), after.audit_record())
        return after
