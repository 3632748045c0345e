"""The logic of the admin adapter routes: upload, list, get, delete, load, unload and pin.

Every change writes one audit row in the transaction that makes it. The work is in three places, each with
one job, and this service is what the routes, the tenant service and the announcements listener call:

- uploads (app/admin/adapters/uploads.py): receive, validate, store, record and register, or leave nothing;
- residency (app/admin/adapters/residency.py): load, unload and pin in the engines, stored and announced;
- removal (app/admin/adapters/removal.py): a deleted adapter's engine copy and files go once no request uses it.

Deletion: the row becomes ``deleted`` and the resolver forgets it at once, so new requests get 404; the
engine's copy and the stored files go when no request uses them. A replacing upload deletes the adapter it
replaces the same way.

Deletes, unloads and pins are applied here and announced to the other replicas (app/adapters/announcements.py)
in the transaction that records them.

This service holds per-process state (pending removals, the store lock), so there is one per app.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator

from sqlalchemy import select

from app.adapters.announcements import Op, announce
from app.adapters.resolver import ModelResolver
from app.admin.adapters.removal import AdapterRemovals
from app.admin.adapters.residency import AdapterResidency
from app.admin.adapters.rows import DELETED, adapter_out, no_adapter, require_tenant
from app.admin.adapters.schemas import AdapterList, AdapterOut
from app.admin.adapters.uploads import AdapterUploads
from app.admin.audit import record_change
from app.db.database import Database
from app.db.tables import Adapter
from app.engine_clients.interface import EngineClient
from app.keys.authenticator import Principal
from app.settings import Settings
from app.web.errors import NotFoundError

logger = logging.getLogger(__name__)


class AdapterService:
    """Adapters of every tenant, for admins; one per app (see the module docstring for what it remembers)."""

    def __init__(self, database: Database, engine: EngineClient, resolver: ModelResolver, settings: Settings) -> None:
        self.database = database
        self.engine = engine
        self.resolver = resolver
        store_lock = asyncio.Lock()  # moving into the store and recording, against removing stored folders
        self.removals = AdapterRemovals(database, engine, resolver, settings.home, store_lock)
        self.uploads = AdapterUploads(database, engine, settings, store_lock)
        self.residency = AdapterResidency(database, engine, resolver, self.removals)

    # Reading -----------------------------------------------------------------------------------------

    async def list_for_tenant(self, tenant_id: uuid.UUID) -> AdapterList:
        query = (
            select(Adapter)
            .where(Adapter.tenant_id == tenant_id, Adapter.status != DELETED)
            .order_by(Adapter.created_at, Adapter.id)
        )
        async with self.database.sessions() as session:
            await require_tenant(session, tenant_id)
            rows = list(await session.scalars(query))
        return AdapterList(data=[adapter_out(row, self.engine) for row in rows])

    async def get(self, adapter_id: uuid.UUID) -> AdapterOut:
        async with self.database.sessions() as session:
            row = await session.get(Adapter, adapter_id)
        if row is None:
            raise no_adapter(adapter_id)
        return adapter_out(row, self.engine)

    # Upload ------------------------------------------------------------------------------------------

    async def upload(
        self,
        actor: Principal,
        tenant_id: uuid.UUID,
        body: AsyncIterator[bytes],
        content_type: str | None,
        content_length: int | None,
    ) -> AdapterOut:
        """Receive, validate, store, record and register an adapter; nothing stays behind when it fails."""
        row, replaced = await self.uploads.receive(actor, tenant_id, body, content_type, content_length)
        self.resolver.forget(tenant_id, row.name)
        if replaced is not None:
            await self.retire(replaced.id, replaced.digest)
        logger.info("adapter %s (%s) of tenant %s uploaded, rank %d", row.name, row.id, tenant_id, row.rank)
        return adapter_out(row, self.engine)

    # Delete ------------------------------------------------------------------------------------------

    async def delete(self, actor: Principal, adapter_id: uuid.UUID) -> AdapterOut:
        """Mark it deleted (new requests: 404 at once); the engine copy and files go when unused."""
        async with self.database.sessions() as session, session.begin():
            row = await session.get(Adapter, adapter_id, with_for_update=True)
            if row is None:
                raise no_adapter(adapter_id)
            if row.status == DELETED:
                raise NotFoundError(f"The adapter {adapter_id} is already deleted.", param="adapter_id")
            before = adapter_out(row, self.engine).audit_record()
            row.status = DELETED
            row.pinned = False
            await announce(session, Op.DELETE, row.id, row.digest)
            after = adapter_out(row, self.engine).audit_record()
            record_change(session, actor, "adapter.delete", "adapter", row.id, before, after)
        self.resolver.forget(row.tenant_id, row.name)
        await self.retire(row.id, row.digest)
        logger.info("adapter %s (%s) of tenant %s deleted", row.name, row.id, row.tenant_id)
        return adapter_out(row, self.engine)

    async def retire(self, adapter_id: uuid.UUID, digest: str) -> None:
        """Stop new use of an adapter marked deleted; its engine copy and files go when unused."""
        await self.removals.retire(adapter_id, digest)

    # Engine residency ----------------------------------------------------------------------------------

    async def load(self, actor: Principal, adapter_id: uuid.UUID) -> AdapterOut:
        """Register the adapter in the engine now (a no-op when it is there)."""
        return await self.residency.load(actor, adapter_id)

    async def unload(self, actor: Principal, adapter_id: uuid.UUID) -> AdapterOut:
        """Remove the adapter from the engine (the next request loads it again); 409 while requests use it."""
        return await self.residency.unload(actor, adapter_id)

    async def unload_here(self, adapter_id: uuid.UUID) -> None:
        """Another replica's unload, applied to this engine."""
        await self.residency.unload_here(adapter_id)

    async def pin(self, actor: Principal, adapter_id: uuid.UUID, pinned: bool) -> AdapterOut:
        """Pin: register and keep resident in every replica's pool (stored, announced); unpin: evictable again."""
        return await self.residency.pin(actor, adapter_id, pinned)

    # Lifetime ----------------------------------------------------------------------------------------

    async def wait_for_removals(self, timeout_s: float | None = None) -> None:
        """Wait until the engine copies of deleted adapters are removed (or ``timeout_s`` passes)."""
        await self.removals.wait(timeout_s)

    async def close(self) -> None:
        """Stop the background removals (at shutdown); the engine copies they waited for stay."""
        await self.removals.close()
