"""The engine for an asyncio server: submit a request, iterate its outputs, abort it.

The step loop (``engine/drivers/step_loop.py``) runs on its own thread, so the event loop never waits on a forward
pass; given the engine's config, that thread builds the engine first (``engine/drivers/engine_build.py`` says why).
Requests and aborts reach the loop through its inbox; outputs go back to each request's
:class:`OutputQueue` on the caller's event loop.
"""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from engine.config import EngineConfig
from engine.drivers.step_loop import StepLoop
from engine.engine import Engine
from engine.errors import EngineDeadError, EngineError
from engine.output.output_queue import OutputQueue
from engine.output.outputs import RequestOutput, ended_before_admission
from engine.sampling.grammar import GrammarConstraint
from engine.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class _Submit:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    adapter: str | None
    tenant: str | None
    weight: float | None
    sink: OutputQueue
    grammar: "xgrammar.CompiledGrammar | None"


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


class AsyncEngine(StepLoop):
    """Drives an :class:`Engine` from a background thread for asyncio callers.

    Given an :class:`EngineConfig`, the step thread builds the engine, then steps it: the fast way on the
    CPU. An :class:`Engine` built already is accepted too, but stepping it on another thread than the one
    that built it is slower on the CPU (libgomp's thread pools, see ``engine/drivers/engine_build.py``).
    """

    def __init__(self, engine: Engine | EngineConfig) -> None:
        """``engine``: the config the step thread builds the engine from (see :meth:`start`), or an engine built."""
        super().__init__(engine)
        self._sinks: dict[str, OutputQueue] = {}
        self._num_abort_alls = 0  # abort_all calls so far: a request whose grammar compiled across one is ended
        self._ids = 0

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
        weight: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request (on behalf of ``tenant``, see :meth:`Engine.add_request`) and yield its outputs.

        ``weight``, when given, is ``tenant``'s weight (see :meth:`Engine.set_tenant_weight`), applied
        before the request is admitted when it changed. A request of ``n`` choices yields each choice's
        outputs (``output.index``) until ``request_finished``.

        Leaving the loop early (a client that went away) aborts the request and frees its pages. A
        request the engine failed on (see :meth:`Engine.step`) raises RequestFailedError; others go on; a
        step loop that died or stopped raises EngineDeadError.
        """
        if self._thread is None:
            raise EngineError("the engine is not started; call start() first")
        await self._built_engine()
        if request_id is None:
            self._ids += 1
            request_id = f"async-{self._ids}"
        num_abort_alls = self._num_abort_alls
        grammar = None if params.constraint is None else await self.compile_grammar(params.constraint)
        if self._num_abort_alls != num_abort_alls:  # every request was ended while its grammar compiled: this one too
            prompt_ids = self.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            for output in ended_before_admission(request_id, prompt_ids, params.n):
                yield output
            return
        sink = OutputQueue(asyncio.get_running_loop())
        self._put(_Submit(request_id, prompt, params, adapter, tenant, weight, sink, grammar))
        try:
            async for output in sink.outputs(request_id):
                yield output
        finally:
            if not sink.finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._put(_Abort(request_id))

    def abort_all(self) -> None:
        """End every request in flight, those still compiling their grammar included (see :meth:`generate`)."""
        self._num_abort_alls += 1
        super().abort_all()

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` on the step thread between steps (the engine is not thread-safe)."""
        if self._thread is None:
            return fn(self.engine)
        await self._built_engine()
        return await asyncio.wrap_future(self._queue_call(fn))

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
        await self.call(lambda _: self._apply_weight(tenant, weight))

    async def _built_engine(self) -> Engine:
        """The engine, once the step thread has built it; EngineDeadError if it could not be built."""
        future = self._build.future
        if not future.done():
            if self._thread is None:
                raise EngineError("the engine is not started; call start() first")
            with contextlib.suppress(Exception):  # the build's error: raised below as the engine's death
                await asyncio.wrap_future(future)
        if self._build.failed:
            raise EngineDeadError(f"the engine could not be built: {future.exception()}")
        return self._build.engine

    # The step loop's side -------------------------------------------------------------------------

    def _handle(self, command: Any) -> None:
        if isinstance(command, _Abort):
            self.engine.abort_request(command.request_id)
            self._sinks.pop(command.request_id, None)
            return
        try:
            self._apply_weight(command.tenant, command.weight)
            self.engine.add_request(
                command.prompt, command.params, command.request_id, command.adapter, command.tenant, command.grammar
            )
        except EngineError as error:
            command.sink.put(error)
            return
        self._sinks[command.request_id] = command.sink

    def _abort_everything(self) -> None:
        for request_id, sink in self._sinks.items():
            for output in self.engine.abort_request(request_id):
                sink.put(output)
        self._sinks.clear()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if output.request_finished:
                self._sinks.pop(output.request_id, None)
            if sink is not None and not sink.put(output) and not output.request_finished:
                self.engine.abort_request(output.request_id)  # its event loop is gone: nobody will read it
                self._sinks.pop(output.request_id, None)

    def _refuse(self, command: Any, error: EngineDeadError) -> None:
        if isinstance(command, _Submit):
            command.sink.put(error)

    def _on_death(self, error: BaseException) -> None:
        dead = self._dead_error(error)
        for sink in self._sinks.values():
            sink.put(dead)
        self._sinks.clear()
