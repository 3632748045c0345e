"""The engine for an asyncio server: submit a request, iterate its deltas, abort it.

The step loop runs on its own thread, so the event loop never waits on a forward pass; given the engine's
config, that thread builds the engine first (``engine/engine_build.py`` says why). Requests and aborts
reach the loop through a thread-safe inbox that it drains before every step; outputs go back to each
request's asyncio queue with ``call_soon_threadsafe``.
"""

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from engine.config import EngineConfig
from engine.engine import Engine
from engine.engine_build import EngineBuild
from engine.errors import EngineDeadError, EngineError, RequestFailedError
from engine.grammar import GrammarConstraint
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)

T = TypeVar("T")

IDLE_WAIT_S = 0.05  # how long the idle loop sleeps between looks at the inbox when woken for nothing


@dataclass(frozen=True, slots=True)
class _Submit:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    adapter: str | None
    tenant: str | None
    sink: "_Sink"
    grammar: "xgrammar.CompiledGrammar | None"


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class _AbortAll:
    """End every request now; each stream gets its final output (finish reason "abort")."""


@dataclass(frozen=True, slots=True)
class _Call:
    """Run ``fn(engine)`` on the step thread between two steps; its result lands in ``future``."""

    fn: Callable[[Engine], Any]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


class _Sink:
    """Where one request's outputs (or its error) land, on the event loop's side."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> bool:
        """Hand ``item`` to the waiting coroutine; False when its event loop is gone (nobody will read it)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: its server stopped without aborting this request
            return False
        return True


class AsyncEngine:
    """Drives an :class:`Engine` from a background thread for asyncio callers.

    Given an :class:`EngineConfig`, the step thread builds the engine, then steps it: the fast way on the
    CPU. An :class:`Engine` built already is accepted too, but stepping it on another thread than the one
    that built it is slower on the CPU (libgomp's thread pools, see ``engine/engine_build.py``).
    """

    def __init__(self, engine: Engine | EngineConfig) -> None:
        """``engine``: the config the step thread builds the engine from (see :meth:`start`), or an engine built."""
        self._build = EngineBuild(engine)
        self._inbox: queue.SimpleQueue[_Submit | _Abort | _AbortAll | _Call | None] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._sinks: dict[str, _Sink] = {}
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._ids = 0

    @property
    def engine(self) -> Engine:
        """The engine; one built from a config exists once the future of :meth:`start` is done."""
        return self._build.engine

    def start(self) -> "Future[None]":
        """Start the step thread, which first builds the engine when given a config; the future of that build.

        The future is done once the engine exists (at once for an engine built already). When the build
        fails, it holds what ``Engine(config)`` raised (a ConfigError, ...), the step thread has ended and
        later calls raise EngineDeadError. From a coroutine: ``await asyncio.wrap_future(engine.start())``.
        """
        if self._thread is None and not self._build.failed:
            self._thread = threading.Thread(target=self._loop, name="loraplex-engine", daemon=True)
            self._thread.start()
        return self._build.future

    def request_stop(self) -> None:
        """Ask the step loop to abort what is in flight and end (once built, if it is building); does not wait."""
        self._inbox.put(None)
        self._wake.set()

    async def stop(self) -> None:
        """Abort what is in flight and join the step thread."""
        if self._thread is None:
            return
        self.request_stop()
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        adapter: str | None = None,
        tenant: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request (on behalf of ``tenant``, see :meth:`Engine.add_request`) and yield its outputs.

        A request of ``n`` choices yields each choice's outputs (``output.index``) until ``request_finished``.

        Leaving the loop early (a client that went away) aborts the request and frees its pages. A
        request the engine failed on (see :meth:`Engine.step`) raises RequestFailedError; others go on.
        """
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self._error}")
        if self._thread is None:
            raise EngineError("the engine is not started; call start() first")
        await self._built_engine()
        if request_id is None:
            self._ids += 1
            request_id = f"async-{self._ids}"
        grammar = None if params.constraint is None else await self.compile_grammar(params.constraint)
        sink = _Sink(asyncio.get_running_loop())
        self._inbox.put(_Submit(request_id, prompt, params, adapter, tenant, sink, grammar))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.request_finished
                if item.error is not None:
                    raise RequestFailedError(f"the engine failed while running request {request_id}: {item.error}")
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))
        self._wake.set()

    def abort_all(self) -> None:
        """End every request in flight before the next step; their streams end with finish reason "abort".

        For a server whose shutdown grace period runs out: its streams end cleanly instead of being cut.
        """
        self._inbox.put(_AbortAll())
        self._wake.set()

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` on the step thread between steps (the engine is not thread-safe)."""
        if self._thread is None:
            return fn(self.engine)
        await self._built_engine()
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self._error}")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._inbox.put(_Call(fn, future, loop))
        self._wake.set()
        return await future

    async def compile_grammar(self, constraint: GrammarConstraint) -> "xgrammar.CompiledGrammar":
        """Compile ``constraint`` in a worker thread (a cache hit if compiled before); GrammarError if invalid."""
        engine = await self._built_engine()
        return await asyncio.to_thread(engine.grammars.compile, constraint)

    async def add_adapter(self, name: str, path: str | Path) -> str:
        """Validate a PEFT folder off the step thread, then register it between steps; its digest."""
        engine = await self._built_engine()
        validated = await asyncio.to_thread(engine.validate_adapter, path)
        return await self.call(lambda engine: engine.add_adapter(name, path, validated))

    async def remove_adapter(self, name: str) -> None:
        await self.call(lambda engine: engine.remove_adapter(name))

    async def set_tenant_weight(self, tenant: str, weight: float) -> None:
        """See :meth:`Engine.set_tenant_weight`; applied between two steps."""
        await self.call(lambda engine: engine.set_tenant_weight(tenant, weight))

    async def _built_engine(self) -> Engine:
        """The engine, once the step thread has built it; EngineDeadError if it could not be built."""
        future = self._build.future
        if not future.done():
            if self._thread is None:
                raise EngineError("the engine is not started; call start() first")
            with contextlib.suppress(Exception):  # the build's error: raised below as the engine's death
                await asyncio.wrap_future(future)
        if self._build.failed:
            raise EngineDeadError(f"the engine could not be built: {self._error}")
        return self._build.engine

    def _loop(self) -> None:
        if not self._build.run(on_failure=self._mark_dead):
            return
        try:
            while self._drain_inbox():
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
                    continue
                for output in self.engine.step():
                    sink = self._sinks.get(output.request_id)
                    if output.request_finished:
                        self._sinks.pop(output.request_id, None)
                    if sink is not None and not sink.put(output) and not output.request_finished:
                        self.engine.abort_request(output.request_id)
                        self._sinks.pop(output.request_id, None)
        except BaseException as error:  # the loop must tell every waiter, whatever went wrong
            logger.exception("engine step loop died")
            self._error = error
            dead = EngineDeadError(f"the engine stopped after an error: {error}")
            for sink in self._sinks.values():
                sink.put(dead)
            self._sinks.clear()

    def _mark_dead(self, error: BaseException) -> None:
        self._error = error

    def _drain_inbox(self) -> bool:
        """Apply queued submissions and aborts; False once stop() was asked for."""
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True
            if command is None or isinstance(command, _AbortAll):
                for request_id, sink in self._sinks.items():
                    for output in self.engine.abort_request(request_id):
                        sink.put(output)
                self._sinks.clear()
                if command is None:
                    return False
                continue
            if isinstance(command, _Abort):
                self.engine.abort_request(command.request_id)
                self._sinks.pop(command.request_id, None)
                continue
            if isinstance(command, _Call):
                _run_call(self.engine, command)
                continue
            try:
                self.engine.add_request(
                    command.prompt, command.params, command.request_id, command.adapter, command.tenant, command.grammar
                )
            except EngineError as error:
                command.sink.put(error)
                continue
            self._sinks[command.request_id] = command.sink


def _run_call(engine: Engine, call: _Call) -> None:
    """Run a queued call and hand its result or exception to the waiting coroutine."""

    def settle(result: Any, error: BaseException | None) -> None:
        if call.future.cancelled():
            return
        if error is not None:
            call.future.set_exception(error)
        else:
            call.future.set_result(result)

    try:
        result = call.fn(engine)
    except Exception as error:  # the caller gets the error; the step loop goes on
        call.loop.call_soon_threadsafe(settle, None, error)
        return
    call.loop.call_soon_threadsafe(settle, result, None)
