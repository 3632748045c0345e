"""The engine in a process of its own, behind the EngineClient interface (``LORAPLEX_ENGINE=process``).

On a thread of the gateway's process, the engine's step loop fights the event loop for the GIL: each of
the ~1,800 torch op returns of a step needs it back, and Python's switch interval is 5 ms.
Here the engine runs in a worker process (``engine/drivers/worker_process.py``, started with "spawn") and the
gateway talks to it over a socket pair in the small typed messages of ``engine/drivers/worker_protocol.py``: a
request is one Submit frame, each engine step's outputs come back as ONE frame for all requests. The
gateway keeps its own tokenizer, reads the socket on its event loop (no thread), and routes the outputs
to per-request queues. Errors keep their engine classes across the boundary. A worker that dies ends
every open stream with EngineDeadError and turns ``is_ready()`` false; ``stop()`` ends what is in flight
and joins the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import msgspec

from app.engine_clients.channel import FrameChannel
from app.engine_clients.interface import LOCAL_WORKER, AdapterInfo
from app.engine_clients.tokenizer import GatewayTokenizer, TokenizingClient
from engine import EngineConfig, EngineStats, GrammarConstraint, RequestOutput, SamplingParams
from engine.drivers.worker_process import run_worker_process
from engine.drivers.worker_protocol import (
    Abort,
    AbortAll,
    AdapterSummary,
    AddAdapter,
    Call,
    CheckConstraint,
    Fatal,
    GetStats,
    LogLine,
    PinAdapter,
    Ready,
    RemoveAdapter,
    Reply,
    Shutdown,
    StepOutputs,
    Submit,
    ValidateAdapter,
    decode_event,
    frame,
    from_wire,
)
from engine.errors import EngineDeadError, EngineError, RequestError, UnknownAdapterError
from engine.output.output_delta import OutputAssembler
from engine.output.output_queue import OutputQueue

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0  # for the worker to end its requests and exit after Shutdown; then it is killed
KILL_TIMEOUT_S = 5.0


@dataclass(slots=True)
class _Stream:
    """One request's outputs on their way to the coroutine reading them (on its own event loop)."""

    queue: OutputQueue
    assembler: OutputAssembler
    ended: bool = False
    """The worker has forgotten the request (refused it, or died): leaving the stream needs no abort."""


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # its caller was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class ProcessEngineClient(TokenizingClient):
    """An engine in a worker process; the tokenizer, the routing of outputs and the adapter names stay here."""

    def __init__(self, config: EngineConfig, model_name: str) -> None:
        self.config = config
        self.model_name = model_name
        self.max_model_len = 0
        self.max_prompt_chars = 0
        self.vocab_size = 0
        self._process: BaseProcess | None = None
        self._channel: FrameChannel | None = None
        self._tokenizer: GatewayTokenizer | None = None
        self._ready: asyncio.Future[Ready] | None = None
        self._started = False
        self._stopping = False
        self._dead: EngineError | None = None
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count(1)
        self._adapters: set[str] = set()  # the worker's adapter names, mirrored from add/remove replies

    @property
    def pid(self) -> int | None:
        """The worker process's id (None before start)."""
        return None if self._process is None else self._process.pid

    async def start(self) -> None:
        """Start the worker and wait until its engine is built (seconds); the tokenizer loads meanwhile."""
        if self._process is not None:
            return
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        process = multiprocessing.get_context("spawn").Process(
            target=run_worker_process,
            args=(theirs, self.config, logging.getLogger().getEffectiveLevel()),
            name="loraplex-engine",
            daemon=True,  # ended with the gateway; it also exits when the gateway's end of the socket closes
        )
        process.start()
        theirs.close()
        self._process, self._dead, self._stopping = process, None, False
        self._streams, self._calls, self._adapters = {}, {}, set()
        self._ready = loop.create_future()
        self._channel = FrameChannel(ours, self._on_frame, self._on_close)
        self._channel.bind(loop)
        tokenizer = asyncio.ensure_future(asyncio.to_thread(GatewayTokenizer.load, self.config.model))
        try:
            ready = await self._ready  # first: the engine's error says best what is wrong with the model
            self._tokenizer = await tokenizer
        except BaseException:
            await asyncio.gather(tokenizer, return_exceptions=True)
            await self.stop()
            raise
        self.max_model_len, self.vocab_size = ready.max_model_len, ready.vocab_size
        self.max_prompt_chars = self._tokenizer.max_prompt_chars(ready.max_model_len)
        self._started = True
        logger.info("engine worker process %d ready", process.pid)

    async def stop(self) -> None:
        """End every request in flight (their streams end with finish reason "abort") and join the worker."""
        process, channel = self._process, self._channel
        if process is None or channel is None:
            return
        self._stopping = True
        if not channel.closed:
            channel.bind(asyncio.get_running_loop())
            channel.send(frame(Shutdown()))
        await asyncio.to_thread(process.join, STOP_TIMEOUT_S)
        if process.is_alive():
            logger.warning("the engine worker did not exit in %.0f s; killing it", STOP_TIMEOUT_S)
            process.kill()
            await asyncio.to_thread(process.join, KILL_TIMEOUT_S)
        channel.close()
        self._process, self._channel, self._started = None, None, False

    def is_ready(self) -> bool:
        process = self._process
        return self._started and self._dead is None and process is not None and process.is_alive()

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        adapter: str | None,
        tenant: str | None = None,
        weight: float = 1.0,
    ) -> AsyncIterator[RequestOutput]:
        channel = self._channel_in_use()
        if request_id in self._streams:
            raise RequestError(f"request id {request_id!r} is already in use")
        stream = _Stream(OutputQueue(asyncio.get_running_loop()), OutputAssembler(prompt_ids))
        self._streams[request_id] = stream
        channel.send(frame(Submit(request_id, prompt_ids, params, adapter, tenant, weight)))
        try:
            async for output in stream.queue.outputs(request_id):
                yield output
        finally:
            self._streams.pop(request_id, None)
            if not stream.queue.finished and not stream.ended:  # the caller left early (a client gone): free it now
                channel.send(frame(Abort(request_id)))

    def abort_all(self) -> None:
        if self._channel is not None and self._dead is None:
            self._channel.send(frame(AbortAll()))

    async def check_constraint(self, constraint: GrammarConstraint) -> None:
        await self._call(lambda call_id: CheckConstraint(call_id, constraint))

    async def validate_adapter(self, path: Path) -> AdapterInfo:
        """Check a PEFT folder against the base model without registering it (AdapterError if unusable)."""
        summary = msgspec.convert(await self._call(lambda call_id: ValidateAdapter(call_id, str(path))), AdapterSummary)
        return AdapterInfo(summary.digest, summary.rank, summary.alpha, summary.target_modules, summary.size_bytes)

    async def add_adapter(self, name: str, path: Path) -> str:
        digest = await self._call(lambda call_id: AddAdapter(call_id, name, str(path)))
        self._adapters.add(name)
        return msgspec.convert(digest, str)

    async def remove_adapter(self, name: str) -> None:
        try:
            await self._call(lambda call_id: RemoveAdapter(call_id, name))
        except UnknownAdapterError:
            self._adapters.discard(name)
            raise
        self._adapters.discard(name)

    async def pin_adapter(self, name: str, pinned: bool) -> None:
        await self._call(lambda call_id: PinAdapter(call_id, name, pinned))

    def has_adapter(self, name: str) -> bool:
        return name in self._adapters

    async def stats(self) -> EngineStats:
        return msgspec.convert(await self._call(GetStats), EngineStats)

    async def worker_stats(self) -> dict[str, EngineStats]:
        return {LOCAL_WORKER: await self.stats()}

    # The socket's side ----------------------------------------------------------------------------

    def _channel_in_use(self) -> FrameChannel:
        """The channel, moved to the caller's event loop if the one it served has stopped."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine worker is not running: {self._dead}")
        if self._channel is None or not self._started:
            raise EngineError("the engine client is not started; call start() first")
        self._channel.bind(asyncio.get_running_loop())
        return self._channel

    async def _call(self, make: Callable[[int], Call]) -> Any:
        """Send a named call; its result as decoded (None for most), or its error as the engine's class."""
        channel = self._channel_in_use()
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        channel.send(frame(make(call_id)))
        try:
            return await future
        finally:
            self._calls.pop(call_id, None)

    def _on_frame(self, body: bytes) -> None:
        event = decode_event(body)
        if isinstance(event, StepOutputs):
            self._on_step(event)
        elif isinstance(event, Reply):
            future = self._calls.pop(event.call_id, None)
            if future is not None:
                error = None if event.error is None else from_wire(event.error)
                self._call_soon(future.get_loop(), _settle, future, event.result, error)
        elif isinstance(event, LogLine):
            worker_logger = logging.getLogger(event.logger)
            if worker_logger.isEnabledFor(event.level):
                worker_logger.log(event.level, "%s", event.message)
        elif isinstance(event, Ready):
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(event)
        elif isinstance(event, Fatal):
            self._die(from_wire(event.error))

    def _on_step(self, step: StepOutputs) -> None:
        for delta in step.outputs:
            stream = self._streams.get(delta.request_id)
            if stream is not None:  # else its reader left, and an Abort is on its way
                self._deliver(delta.request_id, stream, stream.assembler.apply(delta))
        for rejected in step.rejected:
            stream = self._streams.get(rejected.request_id)
            if stream is not None:
                stream.ended = True
                self._deliver(rejected.request_id, stream, from_wire(rejected.error))

    def _deliver(self, request_id: str, stream: _Stream, item: RequestOutput | BaseException) -> None:
        closed = not stream.queue.put(item)
        if closed and self._streams.pop(request_id, None) is not None and self._channel is not None:
            self._channel.send(frame(Abort(request_id)))  # its event loop is gone: nobody will read the stream

    @staticmethod
    def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> bool:
        """Run ``fn(*args)`` on ``loop``: now when it is the running one, else soon; False if the loop is closed."""
        with contextlib.suppress(RuntimeError):
            if asyncio.get_running_loop() is loop:
                fn(*args)
                return True
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            return False
        return True

    def _on_close(self) -> None:
        """The socket closed: the worker exited, or was stopped; nothing more will come from it."""
        if self._stopping:
            self._die(EngineDeadError("the engine was stopped"), quiet=True)
            return
        code = None
        if self._process is not None:
            self._process.join(0)  # reaps it if it has exited, without waiting
            code = self._process.exitcode
        self._die(EngineDeadError(f"the engine worker process exited (exit code {code}); its requests were ended"))

    def _die(self, error: EngineError, quiet: bool = False) -> None:
        """End every open stream and call (the worker is gone, or said it cannot go on); the first error is kept."""
        if self._dead is None:
            self._dead = error
            if not quiet:
                logger.error("the engine worker failed: %s", error)
        error = self._dead
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(error)
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            stream.ended = True
            self._deliver(request_id, stream, EngineDeadError(str(error)))
        calls, self._calls = self._calls, {}
        for future in calls.values():
            self._call_soon(future.get_loop(), _settle, future, None, EngineDeadError(str(error)))
