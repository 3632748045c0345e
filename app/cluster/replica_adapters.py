"""A replica's adapters: registered in its engine by content digest, kept in step with Serve's multiplexing.

Serve's multiplexed loader (``load``, wrapped by ``serve.multiplexed`` with the pool's capacity) fetches an
adapter's files from the store (``adapter_fetch.py``) and registers them in the engine under the digest, and
Serve's router then sends that adapter's requests to this replica. An adapter Serve unloads is removed from
the engine, unless it is pinned or requests still run on it (it is then *retiring*, and removed when the
last one ends). Pins and removals that must reach every replica come from the engine directory.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from ray import serve

from app.cluster.adapter_fetch import AdapterFetcher
from engine.drivers.worker import EngineWorker
from engine.engine import Engine


class LoadedAdapter:
    """What Serve's multiplexing cache holds for one digest; Serve calls ``__del__`` when it unloads it."""

    def __init__(self, adapters: ReplicaAdapters, digest: str) -> None:
        self._adapters = adapters
        self._digest = digest
        self._unloaded = False

    def __del__(self) -> None:  # Serve runs it on an executor thread; garbage collection may run it again
        if self._unloaded:
            return
        self._unloaded = True
        self._adapters.unload_threadsafe(self._digest)


class ReplicaAdapters:
    """The digests registered in one replica's engine, the pinned ones, and those retiring."""

    def __init__(
        self, worker: EngineWorker, fetcher: AdapterFetcher, loop: asyncio.AbstractEventLoop, capacity: int
    ) -> None:
        """``capacity``: the adapters the pool holds, the limit of Serve's multiplexed loader made here."""
        self._worker = worker
        self._fetcher = fetcher
        self._loop = loop
        self._registered: set[str] = set()  # digests registered in the engine
        self._pinned: set[str] = set()
        self._retiring: set[str] = set()  # unloaded by Serve while requests ran on them

        async def load(digest: str) -> LoadedAdapter:
            await self.register(digest)
            return LoadedAdapter(self, digest)

        self._serve_load: Callable[[str], Awaitable[LoadedAdapter]] = serve.multiplexed(
            max_num_models_per_replica=capacity
        )(load)

    async def load(self, digest: str) -> None:
        """Have the adapter registered for a request about to run on it (through Serve's multiplexing)."""
        await self._serve_load(digest)
        if digest not in self._registered:  # removed by a broadcast since Serve loaded it
            await self.register(digest)
        self._retiring.discard(digest)

    def request_ended(self, digest: str | None) -> None:
        """A request on ``digest`` ended: an adapter Serve unloaded meanwhile can go now."""
        if digest in self._retiring:
            self._loop.create_task(self._unload(digest))

    async def register(self, digest: str) -> None:
        """Fetch the adapter by digest and register it in the engine under its digest (once)."""
        if digest in self._registered:
            return
        if not await asyncio.wrap_future(self._worker.call(lambda engine: engine.has_adapter(digest))):
            path = await asyncio.to_thread(self._fetcher.fetch, digest)
            await asyncio.wrap_future(self._worker.add_adapter(digest, path))
        self._registered.add(digest)

    async def remove(self, digest: str) -> None:
        """Remove the adapter from the engine now, whatever Serve holds (the directory's broadcast)."""
        self._pinned.discard(digest)
        self._registered.discard(digest)
        self._retiring.discard(digest)
        if await asyncio.wrap_future(self._worker.call(lambda engine: engine.has_adapter(digest))):
            await asyncio.wrap_future(self._worker.call(lambda engine: engine.remove_adapter(digest)))

    async def pin(self, digest: str, pinned: bool) -> None:
        """Keep the adapter resident in the pool (loading it first), or unpin it."""
        if pinned:
            self._pinned.add(digest)
            await self._serve_load(digest)
            await self.register(digest)
        else:
            self._pinned.discard(digest)
            if digest not in self._registered:
                return
        await asyncio.wrap_future(self._worker.call(lambda engine: engine.pin_adapter(digest, pinned)))

    def unload_threadsafe(self, digest: str) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is closed: the replica is going away
            self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._unload(digest)))

    async def _unload(self, digest: str) -> None:
        """Serve unloaded the adapter: remove it from the engine unless pinned or still in use."""
        if digest in self._pinned:
            return

        def remove_if_idle(engine: Engine) -> bool:
            if not engine.has_adapter(digest):
                return True
            if engine.adapters.get(digest).num_requests:
                return False
            engine.remove_adapter(digest)
            return True

        self._registered.discard(digest)
        if await asyncio.wrap_future(self._worker.call(remove_if_idle)):
            self._retiring.discard(digest)
        else:
            self._retiring.add(digest)
