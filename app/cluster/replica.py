"""One engine worker as a Ray Serve replica: an :class:`EngineWorker` on its own pool, adapters multiplexed by digest.

The worker's step thread builds the engine from the config, so the thread that steps it is the one that built
it (``engine/drivers/engine_build.py`` says why that matters on the CPU).

Requests arrive through Serve's deployment handle as one encoded :class:`Submit` each, with the address of
the sending gateway's output inbox. Outputs do not go back through Serve: each engine step's outputs of
all of one gateway's requests leave as one encoded :class:`StepOutputs` frame over one connection to that
gateway (``output_links.py``), where Ray would carry one streamed object per request per step. The Serve
call returns when the request has ended, so Serve's count of ongoing requests (its routing and
``max_ongoing_requests``) holds as with a stream.

A request names its adapter by content digest, which is also Serve's multiplexed model id: the
multiplexed loader fetches the files from the store and registers them in the engine under the digest
(``replica_adapters.py``), and Serve's router then sends that adapter's requests here.

Capacity. Serve counts models per replica; our pool counts pages. Serve's count is set from the pool when
the replica starts (``AdapterCache.capacity()``: rank-16 all-projection adapters in half the pool, bounded
by the host cache), so Serve's LRU unloads before the pool would thrash; within that count the pool's own
page LRU decides what is resident (an adapter Serve lists but whose pages were reclaimed loads again from
its host copy, with no file read).

Commands that must reach every replica (remove, pin, end requests, stats) come through the directory actor
(``directory.py``), which the replica long-polls on its event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import ray
from ray import serve

from app.cluster.adapter_fetch import AdapterFetcher
from app.cluster.directory import DIRECTORY_NAME, DIRECTORY_NAMESPACE
from app.cluster.output_links import OutputLink, OutputLinks
from app.cluster.output_wire import InboxAddress, RunEnded
from app.cluster.replica_adapters import ReplicaAdapters
from engine.config import EngineConfig
from engine.drivers.worker import EngineWorker
from engine.drivers.worker_protocol import (
    AbortAll,
    Command,
    GetStats,
    PinAdapter,
    RemoveAdapter,
    Reply,
    StepOutputs,
    Submit,
    WireError,
    decode_command,
    to_wire,
)
from engine.errors import EngineDeadError, EngineError
from engine.memory.host_memory import freeze_startup_heap
from engine.output.output_delta import OutputDelta

logger = logging.getLogger(__name__)

POLL_RETRY_S = 0.5  # between looks for a directory that is restarting
_encoder = msgspec.msgpack.Encoder()
_submits = msgspec.msgpack.Decoder(Submit)
_inboxes = msgspec.msgpack.Decoder(InboxAddress)


@dataclass(slots=True)
class _Running:
    """A request on this replica: the link its outputs take, and the future its Serve call waits on."""

    link: OutputLink
    ended: asyncio.Future[WireError | None]

    def end(self, error: WireError | None) -> None:
        if not self.ended.done():
            self.ended.set_result(error)


class EngineReplica:
    """A Serve deployment class: the engine worker of one GPU (or group of CPU cores)."""

    async def __init__(
        self, config: EngineConfig, store_root: str, cache_root: str, database_url: str | None = None
    ) -> None:
        """``database_url``: the gateways' PostgreSQL, where adapters are fetched from (the store folder second)."""
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._loop = asyncio.get_running_loop()
        self._running: dict[str, _Running] = {}
        self._links = OutputLinks(self.replica_id, on_abort=self._abort, on_lost=self._lost)
        self._death: BaseException | None = None
        self._worker = EngineWorker(config, emit=self._emit_threadsafe, on_death=self._on_death_threadsafe)
        await asyncio.wrap_future(self._worker.start())  # built on the step thread; raises what Engine(config) raised
        self.capacity = await asyncio.wrap_future(self._worker.call(lambda engine: engine.adapters.capacity()))
        freeze_startup_heap()  # the replica's process serves this engine until it exits (engine/memory/host_memory.py)
        fetcher = AdapterFetcher(Path(store_root), Path(cache_root), database_url)
        self._adapters = ReplicaAdapters(self._worker, fetcher, self._loop, self.capacity)
        self._directory = ray.get_actor(DIRECTORY_NAME, namespace=DIRECTORY_NAMESPACE)
        await self._apply_pins(await self._directory.join.remote(self.replica_id, os.getpid()))
        self._poll_task = self._loop.create_task(self._poll())
        logger.info("engine replica %s ready: room for %d adapters", self.replica_id, self.capacity)

    async def check_health(self) -> None:
        """Serve's health check: a replica whose step loop died is restarted."""
        if self._death is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self._death}")
        if self._poll_task.done():
            raise EngineDeadError("the replica stopped polling the engine directory")

    async def run(self, body: bytes, inbox: bytes) -> bytes:
        """Run one request (an encoded Submit) for the gateway at ``inbox`` (an encoded InboxAddress).

        Its outputs go over that gateway's output link, with those of the gateway's other requests of the
        same step. Returns an encoded RunEnded once the request has ended: after its last output was sent,
        or with the error that refused or ended it. Serve counts the request as ongoing until then.
        """
        request = _submits.decode(body)
        try:
            link = await self._links.get(_inboxes.decode(inbox))
            if request.adapter is not None:
                await self._adapters.load(request.adapter)
        except EngineError as error:
            return _encoder.encode(RunEnded(self.replica_id, to_wire(error)))
        ended: asyncio.Future[WireError | None] = self._loop.create_future()
        self._running[request.request_id] = _Running(link, ended)
        self._worker.submit(request)
        if link.channel.closed:  # closed while the adapter loaded: nobody would read the outputs
            self._lost(link)
        try:
            error = await ended
        finally:  # cancelled by the caller (a client gone) or ended: an unfinished request is freed now
            self._running.pop(request.request_id, None)
            if not ended.done() or ended.cancelled():  # a cancelled wait cancels the future it awaited
                self._worker.abort(request.request_id)
            self._adapters.request_ended(request.adapter)
        return _encoder.encode(RunEnded(self.replica_id, error))

    async def check_constraint(self, body: bytes) -> bytes:
        """Compile a structured-output constraint (an encoded CheckConstraint); an encoded Reply."""
        return await self._reply(decode_command(body))

    # Commands from the directory --------------------------------------------------------------------

    async def _apply_pins(self, commands: list[bytes]) -> None:
        """Pin what every replica pins (a pin that fails is logged: the replica serves without it)."""
        for body in commands:
            reply = msgspec.msgpack.decode(await self._reply(decode_command(body)), type=Reply)
            if reply.error is not None:
                logger.warning("replica %s could not pin an adapter: %s", self.replica_id, reply.error.message)

    async def _poll(self) -> None:
        while True:
            try:
                commands = await self._directory.next_commands.remote(self.replica_id)
                if commands is None:  # the directory restarted and forgot this replica
                    await self._apply_pins(await self._directory.join.remote(self.replica_id, os.getpid()))
                    continue
            except ray.exceptions.RayActorError:  # the directory is restarting
                await asyncio.sleep(POLL_RETRY_S)
                continue
            for seq, body in commands:
                self._loop.create_task(self._answer(seq, body))

    async def _answer(self, seq: int, body: bytes) -> None:
        reply = await self._reply(decode_command(body))
        await self._directory.reply.remote(self.replica_id, seq, reply)

    async def _reply(self, command: Command) -> bytes:
        call_id = getattr(command, "call_id", 0)
        try:
            result = await self._run(command)
        except Exception as error:  # the caller gets it as the engine's error class
            return _encoder.encode(Reply(call_id, None, to_wire(error)))
        return _encoder.encode(Reply(call_id, result, None))

    async def _run(self, command: Command) -> Any:
        match command:
            case RemoveAdapter(name=digest):
                return await self._adapters.remove(digest)
            case PinAdapter(name=digest, pinned=pinned):
                return await self._adapters.pin(digest, pinned)
            case AbortAll():
                self._worker.abort_all()
                return None
            case GetStats():
                stats = await asyncio.wrap_future(self._worker.stats())
                return msgspec.to_builtins(stats)
        future = self._worker.handle(command)
        return None if future is None else await asyncio.wrap_future(future)

    # The step thread's side -------------------------------------------------------------------------

    def _emit_threadsafe(self, step: StepOutputs) -> None:
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._route, step)

    def _route(self, step: StepOutputs) -> None:
        """Send each gateway its requests' outputs of this step as one frame; end the requests that finished."""
        batches: dict[OutputLink, list[OutputDelta]] = {}
        finished: list[_Running] = []
        for delta in step.outputs:
            running = self._running.get(delta.request_id)
            if running is None:
                continue
            batches.setdefault(running.link, []).append(delta)
            if delta.request_finished:
                finished.append(running)
        for link, deltas in batches.items():
            link.send(StepOutputs(deltas, []))
        for running in finished:
            running.end(None)
        for rejected in step.rejected:
            running = self._running.get(rejected.request_id)
            if running is not None:
                running.end(rejected.error)

    def _abort(self, request_id: str) -> None:
        """The gateway's caller left: free the request now; its Serve call returns."""
        running = self._running.get(request_id)
        if running is not None:
            self._worker.abort(request_id)
            running.end(None)

    def _lost(self, link: OutputLink) -> None:
        """A gateway's link closed: nobody reads its requests' outputs any more, so they end here."""
        lost = to_wire(EngineDeadError(f"engine replica {self.replica_id} lost its connection to the gateway"))
        for request_id, running in list(self._running.items()):
            if running.link is link:
                self._worker.abort(request_id)
                running.end(lost)

    def _on_death_threadsafe(self, error: BaseException) -> None:
        self._death = error
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._fail_all, error)

    def _fail_all(self, error: BaseException) -> None:
        dead = to_wire(EngineDeadError(f"the engine worker {self.replica_id} stopped after an error: {error}"))
        for running in list(self._running.values()):
            running.end(dead)
