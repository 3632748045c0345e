"""Taking deleted adapters out of the engine, and their files out of the store, once no request uses them.

A deleted adapter is retired in the resolver at once (new requests get 404). Requests in flight hold the
engine's copy and finish; the copy is removed when idle: one try at once, then every ``REMOVE_RETRY_S``
in a background task, for up to ``REMOVE_TIMEOUT_S``. Then its files go, the ``adapter_files`` row and
the local cache folder, unless a live row (or another deleted adapter still in the engine) uses its digest.

Retiring is idempotent: a delete can reach a replica twice (its announcement, app/adapters/announcements.py, and
the catch-up after a reconnection), and a second retire of an adapter already on its way out changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from pathlib import Path

from app.adapters.file_rows import drop_files_if_unused
from app.adapters.resolver import ModelResolver
from app.adapters.store import remove_stored
from app.db.database import Database
from app.engine_clients.interface import EngineClient
from engine.errors import AdapterBusyError, UnknownAdapterError

logger = logging.getLogger(__name__)

REMOVE_RETRY_S = 0.1  # how often a deleted adapter's removal from the engine is retried while requests use it
REMOVE_TIMEOUT_S = 600.0  # a long CPU completion can take minutes; past this the engine copy is left (logged)


class AdapterRemovals:
    """The deleted adapters the engine may still hold, and the background tasks waiting to remove them."""

    def __init__(
        self, database: Database, engine: EngineClient, resolver: ModelResolver, home: Path, store_lock: asyncio.Lock
    ) -> None:
        self.database = database
        self.engine = engine
        self.resolver = resolver
        self.home = home  # the data folder, whose store holds the local copies of adapters' files
        self.timeout_s = REMOVE_TIMEOUT_S
        self._store_lock = store_lock  # moving into the store and recording, against removing stored folders
        self._held: dict[uuid.UUID, str] = {}  # deleted adapters the engine may still hold → their digest
        self._tasks: set[asyncio.Task[None]] = set()
        self._first_tries: dict[uuid.UUID, asyncio.Future[None]] = {}  # retires whose first try is under way

    async def retire(self, adapter_id: uuid.UUID, digest: str) -> None:
        """Stop new use of an adapter marked deleted; remove it from the engine now if idle, else when it is.

        Its files leave the store too, unless another live adapter has the same digest. A second call while
        the first one's try is under way waits for that try, so both return with the same outcome.
        """
        self.resolver.retire(adapter_id)
        first = self._first_tries.get(adapter_id)
        if first is None:
            if adapter_id in self._held:
                return  # waiting in the background for its last request already
            self._held[adapter_id] = digest
            first = asyncio.ensure_future(self._first_try(adapter_id))
            self._first_tries[adapter_id] = first
            first.add_done_callback(lambda _done: self._first_tries.pop(adapter_id, None))
        await asyncio.shield(first)

    async def _first_try(self, adapter_id: uuid.UUID) -> None:
        if await self.try_remove(adapter_id) is None:
            await self._released(adapter_id)
            return
        task = asyncio.create_task(self._remove_when_idle(adapter_id), name=f"remove-adapter-{adapter_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def try_remove(self, adapter_id: uuid.UUID) -> AdapterBusyError | None:
        """Remove the adapter from the engine now; None when it is gone, the engine's refusal while busy."""
        name = str(adapter_id)
        if self.resolver.is_loading(adapter_id):
            return AdapterBusyError(f"adapter {name!r} is being registered in the engine")
        if self.engine.has_adapter(name):
            try:
                await self.engine.remove_adapter(name)
            except AdapterBusyError as busy:
                return busy
            except UnknownAdapterError:
                pass  # removed meanwhile: what was asked for
            logger.info("adapter %s removed from the engine", name)
        return None

    async def remove_within(self, adapter_id: uuid.UUID, wait_s: float) -> AdapterBusyError | None:
        """Remove the adapter from the engine, retrying up to ``wait_s`` while requests use it; the last refusal."""
        deadline = time.monotonic() + wait_s
        while (busy := await self.try_remove(adapter_id)) is not None:
            if time.monotonic() >= deadline:
                return busy
            await asyncio.sleep(REMOVE_RETRY_S)
        return None

    async def _remove_when_idle(self, adapter_id: uuid.UUID) -> None:
        try:
            deadline = time.monotonic() + self.timeout_s
            while (busy := await self.try_remove(adapter_id)) is not None:
                if time.monotonic() >= deadline:
                    logger.warning(
                        "deleted adapter %s is still in use after %.0f s (%s); it stays in the engine and its "
                        "files stay in the store",
                        adapter_id,
                        self.timeout_s,
                        busy,
                    )
                    return
                await asyncio.sleep(REMOVE_RETRY_S)
            await self._released(adapter_id)
        except Exception:
            logger.exception("removing deleted adapter %s from the engine failed", adapter_id)

    async def _released(self, adapter_id: uuid.UUID) -> None:
        """The engine no longer holds this deleted adapter: drop its files unless another adapter uses them."""
        digest = self._held.pop(adapter_id, None)
        if digest is None:
            return
        async with self._store_lock:
            if digest in self._held.values():
                return
            async with self.database.sessions() as session, session.begin():
                if not await drop_files_if_unused(session, digest):
                    return
            await asyncio.to_thread(remove_stored, self.home, digest)

    async def wait(self, timeout_s: float | None = None) -> None:
        """Wait until the engine copies of deleted adapters are removed (or ``timeout_s`` passes)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if self._first_tries:  # a first try may still hand its adapter to a background task
            await asyncio.wait(list(self._first_tries.values()), timeout=timeout_s)
        if self._tasks:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            await asyncio.wait(list(self._tasks), timeout=remaining)

    async def close(self) -> None:
        """Stop the background removals (at shutdown); the engine copies they waited for stay."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
