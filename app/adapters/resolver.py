"""Resolving a request's ``model`` within the caller's tenant (docs/concepts.md#adapters).

``model`` is the base model's name or the name of one of the caller's tenant's adapters. Anything
else, including another tenant's adapter, is the same 404, so a caller learns nothing about what
other tenants have. Lookups are cached for a second, so a request usually makes no query while a
deleted adapter disappears within that second. While the database does not answer, the last lookup of
a name stands (requests for adapters in use keep working); a name never looked up gets 503.

Before registering an adapter in the engine, the resolver makes sure its local cache folder holds the
right bytes (app/adapters/local_cache.py), so a replica serves adapters uploaded through another one; an
adapter an admin pinned (``adapters.pinned``) is pinned in the engine as it is registered.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from app.adapters.local_cache import ensure_local
from app.db.database import Database
from app.db.tables import Adapter
from app.engine_clients.interface import EngineClient
from app.web.errors import ModelNotFoundError, ServiceUnavailableError
from engine.errors import AdapterError

logger = logging.getLogger(__name__)

CACHE_TTL_S = 1.0  # how long a lookup is trusted; deletions take effect within it
STALE_IF_ERROR_S = 3600.0  # through a database outage, names looked up within the last hour keep resolving
MAX_CACHE_ENTRIES = 100_000
# Deleted adapters this process refuses to load again. Only a request that read the row just before the
# deletion can still ask for one, so remembering the most recent deletions is enough.
MAX_RETIRED = 10_000


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """What a request runs on: the base model (``adapter_id`` None) or one adapter, with what it brings for chat."""

    name: str
    adapter_id: uuid.UUID | None = None
    tool_call_format: str | None = None  # the adapter's own; None: the server's
    chat_template_sha256: str | None = None  # names the adapter's own template; None: the base model's

    @property
    def engine_adapter(self) -> str | None:
        """The adapter's name inside the engine: its id, so a re-upload never collides with the old one."""
        return None if self.adapter_id is None else str(self.adapter_id)


@dataclass(frozen=True, slots=True)
class _AdapterRecord:
    adapter_id: uuid.UUID
    digest: str
    pinned: bool
    tool_call_format: str | None
    chat_template_sha256: str | None


class ModelResolver:
    """Maps (tenant, model name) to what the engine runs, loading adapters into the engine on demand."""

    def __init__(self, database: Database, engine: EngineClient, home: Path) -> None:
        self.database = database
        self.engine = engine
        self.home = home  # the data folder, whose adapters/<digest> folders cache the adapter files
        self._cache: dict[tuple[uuid.UUID, str], tuple[float, _AdapterRecord | None]] = {}
        self._loading: dict[str, asyncio.Lock] = {}
        self._num_loading: dict[str, int] = {}  # callers inside or waiting for each lock of ``_loading``
        self._retired: OrderedDict[str, None] = OrderedDict()

    async def resolve(self, tenant_id: uuid.UUID, model: str) -> ResolvedModel:
        if model == self.engine.model_name:
            return ResolvedModel(model)
        if "\x00" in model:  # no adapter has it in its name, and PostgreSQL refuses to compare text holding it
            raise ModelNotFoundError(model)
        record = await self._lookup(tenant_id, model)
        if record is not None and self.is_retired(record.adapter_id):
            # Read before a delete or a replacing upload, possibly another replica's: the row may name a new adapter.
            self.forget(tenant_id, model)
            record = await self._lookup(tenant_id, model)
        if record is None:
            raise ModelNotFoundError(model)
        resolved = ResolvedModel(model, record.adapter_id, record.tool_call_format, record.chat_template_sha256)
        if not await self._ensure_loaded(resolved.engine_adapter, record.digest, record.pinned):
            raise ModelNotFoundError(model)  # deleted while this request was looking it up
        return resolved

    async def list_adapter_names(self, tenant_id: uuid.UUID) -> list[tuple[str, int]]:
        """The tenant's ready adapters as (name, created unix time), oldest first."""
        query = (
            select(Adapter.name, Adapter.created_at)
            .where(Adapter.tenant_id == tenant_id, Adapter.status == "ready")
            .order_by(Adapter.created_at)
        )
        try:
            async with self.database.sessions() as session:
                rows = (await session.execute(query)).all()
        except (SQLAlchemyError, OSError) as error:
            raise _database_unavailable("the models could not be listed", error) from error
        return [(name, int(created_at.timestamp())) for name, created_at in rows]

    def forget(self, tenant_id: uuid.UUID, model: str) -> None:
        """Drop a cached lookup at once (after this process changed the adapter)."""
        self._cache.pop((tenant_id, model), None)

    def forget_tenant(self, tenant_id: uuid.UUID) -> None:
        """Drop every cached lookup of a tenant at once (it was deleted, here or on another replica)."""
        for key in [key for key in self._cache if key[0] == tenant_id]:
            del self._cache[key]

    async def ensure_loaded(self, adapter_id: uuid.UUID, digest: str, pinned: bool = False) -> bool:
        """Register an adapter in the engine unless it is there already (admin load); False if it was retired."""
        return await self._ensure_loaded(str(adapter_id), digest, pinned)

    def retire(self, adapter_id: uuid.UUID) -> None:
        """Never register this (deleted) adapter again; requests that still resolve it get 404."""
        self._retired[str(adapter_id)] = None
        if len(self._retired) > MAX_RETIRED:
            self._retired.popitem(last=False)

    def is_retired(self, adapter_id: uuid.UUID) -> bool:
        """True once :meth:`retire` was called for this adapter (and it is among the last ``MAX_RETIRED``)."""
        return str(adapter_id) in self._retired

    def is_loading(self, adapter_id: uuid.UUID) -> bool:
        """True while a registration of this adapter in the engine is under way."""
        return str(adapter_id) in self._num_loading

    async def _lookup(self, tenant_id: uuid.UUID, model: str) -> _AdapterRecord | None:
        key = (tenant_id, model)
        now = time.monotonic()
        cached = self._cache.get(key)
        if cached is not None and now - cached[0] < CACHE_TTL_S:
            return cached[1]
        query = select(
            Adapter.id, Adapter.digest, Adapter.pinned, Adapter.tool_call_format, Adapter.chat_template_sha256
        ).where(Adapter.tenant_id == tenant_id, Adapter.name == model, Adapter.status == "ready")
        try:
            async with self.database.sessions() as session:
                row = (await session.execute(query)).first()
        except (SQLAlchemyError, OSError) as error:
            if cached is not None and now - cached[0] < STALE_IF_ERROR_S:
                return cached[1]  # the database is away: the last answer stands
            raise _database_unavailable(f"the model `{model}` could not be looked up", error) from error
        record = (
            None
            if row is None
            else _AdapterRecord(row.id, row.digest, row.pinned, row.tool_call_format, row.chat_template_sha256)
        )
        if len(self._cache) >= MAX_CACHE_ENTRIES:
            self._cache.pop(next(iter(self._cache)))
        self._cache[key] = (now, record)
        return record

    async def chat_template(self, adapter_id: uuid.UUID) -> str | None:
        """The adapter's own chat template (None if it has none); read when a style cache misses, not per request."""
        query = select(Adapter.chat_template).where(Adapter.id == adapter_id)
        try:
            async with self.database.sessions() as session:
                return await session.scalar(query)
        except (SQLAlchemyError, OSError) as error:
            raise _database_unavailable("the adapter's chat template could not be read", error) from error

    async def _ensure_loaded(self, engine_name: str | None, digest: str, pinned: bool) -> bool:
        """Register the adapter (from its local cache folder, filled if needed) if the engine lacks it.

        False (and nothing done) when it was retired.

        The retired check and the entry in ``_loading`` happen with no await between them, so once
        :meth:`retire` returns, a registration is either visible through :meth:`is_loading` or never starts.
        """
        if engine_name is None:
            return True
        if engine_name in self._retired:
            return False
        if self.engine.has_adapter(engine_name):
            return True
        lock = self._loading.setdefault(engine_name, asyncio.Lock())
        self._num_loading[engine_name] = self._num_loading.get(engine_name, 0) + 1
        try:
            async with lock:
                if engine_name in self._retired:
                    return False
                if not self.engine.has_adapter(engine_name):
                    try:
                        path = await ensure_local(self.database, self.home, digest)
                    except AdapterError as error:  # its files are gone from the database and the cache
                        logger.error("adapter %s cannot be loaded: %s", engine_name, error)
                        raise ServiceUnavailableError(
                            "This model's adapter files are missing on the server; an administrator must "
                            "upload the adapter again."
                        ) from None
                    await self.engine.add_adapter(engine_name, path)
                    if pinned:
                        await self.engine.pin_adapter(engine_name, True)
                    logger.info("adapter %s registered in the engine from %s", engine_name, path)
        finally:
            self._num_loading[engine_name] -= 1
            if not self._num_loading[engine_name]:
                del self._num_loading[engine_name]
                del self._loading[engine_name]
        return True


def _database_unavailable(what: str, error: Exception) -> ServiceUnavailableError:
    logger.warning("%s: %s", what, error)
    return ServiceUnavailableError(f"The database is unavailable, so {what}; retry in a few seconds.")
