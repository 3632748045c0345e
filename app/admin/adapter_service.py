"""The logic of the admin adapter routes: upload, list, get, delete, load, unload and pin.

Every change writes one audit row in the transaction that makes it (load, unload and pin change no row,
so their audit row is the transaction).

Upload: the form is streamed into a private staging folder (app/admin/upload.py), validated by the engine,
and only then moved into the local store by digest, recorded (its files row in ``adapter_files``, the
adapter row and the audit row, one transaction) and registered in the engine,
so the owner's keys can use it at once. Any failure leaves nothing behind: the staging folder always goes,
a stored folder this upload created goes, the transaction rolls back, the engine forgets the adapter.

Deletion: the row becomes ``deleted`` and the resolver forgets it at once, so new requests get 404; the
engine's copy and the stored files go when no request uses them (app/admin/adapter_removal.py).

Unload of an adapter that requests are using waits up to ``UNLOAD_WAIT_S`` for them, then answers 409
saying how many requests use it; nothing is aborted.

Pins are stored in ``adapters.pinned`` (what the API reports); the engine here is pinned at once and every
other replica's when it hears the announcement, or when it registers the adapter. An adapter that leaves
the engines, by unload or delete, loses its pin.

Deletes, unloads and pins are announced to every replica (app/adapters/announcements.py) in the
transaction that records them; this replica hears its own announcements too, and applying them twice
changes nothing.

This service holds per-process state (pending removals, the store lock), so there is one per app.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from app.adapters.announcements import Op, announce
from app.adapters.file_rows import save_files
from app.adapters.resolver import ModelResolver
from app.adapters.store import adapter_row, move_into_store, remove_stored, uploads_root
from app.admin.adapter_removal import DELETED, AdapterRemovals
from app.admin.audit import record_change
from app.admin.schemas_adapters import AdapterList, AdapterOut
from app.admin.upload import AdapterUpload, staged_upload
from app.db.database import Database
from app.db.tables import Adapter, Tenant
from app.engine_client import AdapterInfo, EngineClient
from app.errors import ApiError, BadRequestError, ConflictError, NotFoundError
from app.keys.authenticator import Principal
from app.settings import Settings
from engine.errors import (
    AdapterError,
    AdapterFormatError,
    AdapterMismatchError,
    UnsupportedAdapterError,
)

logger = logging.getLogger(__name__)

ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
READY = "ready"
TENANT_DELETED = "deleted"  # a deleted tenant keeps its row for its usage; its adapters are out of reach
NAME_TAKEN_INDEX = "adapters_tenant_name_live"
UNLOAD_WAIT_S = 5.0  # an unload waits this long for the requests using the adapter before answering 409
MAX_CONCURRENT_VALIDATIONS = 2  # validation reads the whole adapter into memory; bound how many at once
MAX_ECHOED_NAME = 80


class AdapterNameTakenError(ConflictError):
    code = "adapter_name_taken"


class AdapterInUseError(ConflictError):
    code = "adapter_in_use"


class AdapterNotReadyError(ConflictError):
    code = "adapter_not_ready"


class InvalidAdapterError(ApiError):
    """The engine refused the adapter's files; the message is the engine's, naming the file, setting or tensor."""

    status = 422
    code = "invalid_adapter"


INVALID_ADAPTER_CODES: dict[type[AdapterError], str] = {
    AdapterFormatError: "invalid_adapter_format",
    UnsupportedAdapterError: "unsupported_adapter",
    AdapterMismatchError: "adapter_base_model_mismatch",
}


class AdapterService:
    """Adapters of every tenant, for admins; one per app (see the module docstring for what it remembers)."""

    def __init__(self, database: Database, engine: EngineClient, resolver: ModelResolver, settings: Settings) -> None:
        self.database = database
        self.engine = engine
        self.resolver = resolver
        self.settings = settings
        self.unload_wait_s = UNLOAD_WAIT_S
        self._store_lock = asyncio.Lock()  # moving into the store and recording, against removing stored folders
        self.removals = AdapterRemovals(database, engine, resolver, settings.home, self._store_lock)
        self._validations = asyncio.Semaphore(MAX_CONCURRENT_VALIDATIONS)

    # Reading -----------------------------------------------------------------------------------------

    async def list_for_tenant(self, tenant_id: uuid.UUID) -> AdapterList:
        query = (
            select(Adapter)
            .where(Adapter.tenant_id == tenant_id, Adapter.status != DELETED)
            .order_by(Adapter.created_at, Adapter.id)
        )
        async with self.database.sessions() as session:
            await _require_tenant(session, tenant_id)
            rows = list(await session.scalars(query))
        return AdapterList(data=[self._out(row) for row in rows])

    async def get(self, adapter_id: uuid.UUID) -> AdapterOut:
        async with self.database.sessions() as session:
            row = await session.get(Adapter, adapter_id)
        if row is None:
            raise _no_adapter(adapter_id)
        return self._out(row)

    # Upload ------------------------------------------------------------------------------------------

    def check_name(self, name: str) -> None:
        """400 unless ``name`` can be a `model` name: safe as a word, never a path, not the base model's."""
        if not ADAPTER_NAME.fullmatch(name) or ".." in name:
            shown = name[:MAX_ECHOED_NAME]
            raise BadRequestError(
                f"Invalid adapter name {shown!r}: use 1 to 64 letters, digits, '.', '_' or '-', starting with a "
                "letter or digit, with no '..' (tenants send it as `model`).",
                param="name",
            )
        if name == self.engine.model_name:
            raise BadRequestError(
                f"The name {name!r} is the base model's; choose another name for the adapter.", param="name"
            )

    async def upload(
        self,
        actor: Principal,
        tenant_id: uuid.UUID,
        body: AsyncIterator[bytes],
        content_type: str | None,
        content_length: int | None,
    ) -> AdapterOut:
        """Receive, validate, store, record and register an adapter; nothing stays behind when it fails."""
        async with self.database.sessions() as session:
            await _require_tenant(session, tenant_id)
        uploads = uploads_root(self.settings.home)
        limit = self.settings.max_adapter_bytes
        async with staged_upload(body, content_type, content_length, uploads, limit, self.check_name) as upload:
            info = await self._validate(upload.folder)
            row, replaced = await self._store_and_record(actor, tenant_id, upload, info)
        self.resolver.forget(tenant_id, row.name)
        if replaced is not None:
            await self.retire(replaced.id, replaced.digest)
        logger.info("adapter %s (%s) of tenant %s uploaded, rank %d", row.name, row.id, tenant_id, row.rank)
        return self._out(row)

    async def _validate(self, folder: Path) -> AdapterInfo:
        async with self._validations:
            try:
                info = await self.engine.validate_adapter(folder)
            except AdapterError as error:
                message = str(error).replace(f"{folder}: ", "").replace(str(folder), "the upload")
                code = next((c for kind, c in INVALID_ADAPTER_CODES.items() if isinstance(error, kind)), None)
                raise InvalidAdapterError(f"The adapter cannot be served: {message}", code=code) from None
        ceiling = self.settings.max_adapter_rank
        if info.rank > ceiling:
            raise BadRequestError(
                f"The adapter has rank {info.rank}, above this server's ceiling of {ceiling} "
                "(LORAPLEX_MAX_ADAPTER_RANK); retrain it with a smaller r.",
                param="adapter_config.json",
                code="adapter_rank_too_high",
            )
        return info

    async def _store_and_record(
        self, actor: Principal, tenant_id: uuid.UUID, upload: AdapterUpload, info: AdapterInfo
    ) -> tuple[Adapter, Adapter | None]:
        """Move the files into the store, add the row and its audit row, register it; undo all on failure."""
        home = self.settings.home
        async with self._store_lock:
            folder, created = await asyncio.to_thread(move_into_store, upload.folder, home, info.digest)
            engine_name: str | None = None
            try:
                async with self.database.sessions() as session, session.begin():
                    old = await session.scalar(
                        select(Adapter)
                        .where(Adapter.tenant_id == tenant_id, Adapter.name == upload.name, Adapter.status != DELETED)
                        .with_for_update()
                    )
                    if old is not None and not upload.replace:
                        raise _name_taken(upload.name)
                    before = None
                    if old is not None:
                        before = self._out(old).audit_record()
                        old.status = DELETED
                        old.pinned = False
                        await session.flush()  # before the insert: the live name is unique
                        await announce(session, Op.DELETE, old.id, old.digest)
                    await save_files(session, folder, info.digest)
                    row = adapter_row(tenant_id, upload.name, self.engine.model_name, info, folder)
                    session.add(row)
                    await session.flush()
                    await session.refresh(row)  # created_at, filled in by the database
                    engine_name = str(row.id)
                    await self.engine.add_adapter(engine_name, folder)
                    action = "adapter.upload" if old is None else "adapter.replace"
                    record_change(session, actor, action, "adapter", row.id, before, self._out(row).audit_record())
            except BaseException as error:
                await self._undo_upload(engine_name, created, info.digest)
                if isinstance(error, IntegrityError):
                    raise _integrity_error(error, upload.name, tenant_id) from None
                raise
        return row, old

    async def _undo_upload(self, engine_name: str | None, created: bool, digest: str) -> None:
        if engine_name is not None and self.engine.has_adapter(engine_name):
            with contextlib.suppress(AdapterError):
                await self.engine.remove_adapter(engine_name)
        if created:  # under the store lock, so no other row can have started using this folder
            await asyncio.to_thread(remove_stored, self.settings.home, digest)

    # Delete ------------------------------------------------------------------------------------------

    async def delete(self, actor: Principal, adapter_id: uuid.UUID) -> AdapterOut:
        """Mark it deleted (new requests: 404 at once); the engine copy and files go when unused."""
        async with self.database.sessions() as session, session.begin():
            row = await session.get(Adapter, adapter_id, with_for_update=True)
            if row is None:
                raise _no_adapter(adapter_id)
            if row.status == DELETED:
                raise NotFoundError(f"The adapter {adapter_id} is already deleted.", param="adapter_id")
            before = self._out(row).audit_record()
            row.status = DELETED
            row.pinned = False
            await announce(session, Op.DELETE, row.id, row.digest)
            record_change(session, actor, "adapter.delete", "adapter", row.id, before, self._out(row).audit_record())
        self.resolver.forget(row.tenant_id, row.name)
        await self.retire(row.id, row.digest)
        logger.info("adapter %s (%s) of tenant %s deleted", row.name, row.id, row.tenant_id)
        return self._out(row)

    async def retire(self, adapter_id: uuid.UUID, digest: str) -> None:
        """Stop new use of an adapter marked deleted; its engine copy and files go when unused."""
        await self.removals.retire(adapter_id, digest)

    # Engine residency ----------------------------------------------------------------------------------

    async def load(self, actor: Principal, adapter_id: uuid.UUID) -> AdapterOut:
        """Register the adapter in the engine now (a no-op when it is there)."""
        row = await self._live_row(adapter_id)
        before = self._out(row)
        await self._register(row)
        return await self._audited(actor, "adapter.load", row, before)

    async def unload(self, actor: Principal, adapter_id: uuid.UUID) -> AdapterOut:
        """Remove the adapter from the engine (the next request loads it again); 409 while requests use it."""
        row = await self._live_row(adapter_id)
        before = self._out(row)
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
        before = self._out(row)
        name = str(row.id)
        if pinned:
            await self._register(row)
        out = await self._audited(
            actor, "adapter.pin" if pinned else "adapter.unpin", row, before, Op.PIN if pinned else Op.UNPIN
        )
        if pinned or self.engine.has_adapter(name):
            await self.engine.pin_adapter(name, pinned)
        return out

    async def _register(self, row: Adapter) -> None:
        if not await self.resolver.ensure_loaded(row.id, row.digest, row.pinned):
            raise _no_adapter(row.id)  # deleted meanwhile

    async def _live_row(self, adapter_id: uuid.UUID) -> Adapter:
        async with self.database.sessions() as session:
            row = await session.get(Adapter, adapter_id)
        if row is None or row.status == DELETED:
            raise _no_adapter(adapter_id)
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
            after = self._out(row)
            record_change(session, actor, action, "adapter", row.id, before.audit_record(), after.audit_record())
        return after

    def _out(self, row: Adapter) -> AdapterOut:
        return AdapterOut.of(row, loaded=self.engine.has_adapter(str(row.id)), pinned=row.pinned)

    # Lifetime ----------------------------------------------------------------------------------------

    async def wait_for_removals(self, timeout_s: float | None = None) -> None:
        """Wait until the engine copies of deleted adapters are removed (or ``timeout_s`` passes)."""
        await self.removals.wait(timeout_s)

    async def close(self) -> None:
        """Stop the background removals (at shutdown); the engine copies they waited for stay."""
        await self.removals.close()


async def _require_tenant(session: AsyncSession, tenant_id: uuid.UUID) -> None:
    tenant = await session.get(Tenant, tenant_id)
    if tenant is None or tenant.status == TENANT_DELETED:
        raise NotFoundError(
            f"No tenant has the id {tenant_id}; list tenants with GET /admin/tenants.", param="tenant_id"
        )


def _no_adapter(adapter_id: uuid.UUID) -> NotFoundError:
    return NotFoundError(
        f"No adapter has the id {adapter_id}; list a tenant's adapters with GET /admin/tenants/{{tenant_id}}/adapters.",
        param="adapter_id",
    )


def _name_taken(name: str) -> AdapterNameTakenError:
    return AdapterNameTakenError(
        f"The tenant already has an adapter named {name!r}; send replace=true to replace it, or choose another name.",
        param="name",
    )


def _integrity_error(error: IntegrityError, name: str, tenant_id: uuid.UUID) -> ApiError:
    """A concurrent change the row checks could not see: the same name uploaded twice, or the tenant deleted."""
    if NAME_TAKEN_INDEX in str(error.orig):
        return _name_taken(name)
    return NotFoundError(f"The tenant {tenant_id} was deleted during the upload.", param="tenant_id")
