"""An engine driven by commands from elsewhere: a worker process (``drivers/worker_process.py``) or a Ray replica.

:class:`EngineWorker` runs an :class:`Engine`'s step loop (``engine/drivers/step_loop.py``) on a thread of its own,
which builds the engine when given its config (``engine/drivers/engine_build.py`` says why). It takes the commands of
``engine/drivers/worker_protocol.py`` through thread-safe methods (or :meth:`EngineWorker.handle`, a command as it
arrived) and does not care where they come from: each step's outputs leave through the ``emit`` callback,
as ONE :class:`StepOutputs` with every output of that step, and a call's result is a
``concurrent.futures.Future``. Work that is I/O-like (compiling a grammar, reading and checking an adapter's
files) runs on a small thread pool, off the step thread, as ``AsyncEngine`` does it; a constrained request
is admitted once its grammar is compiled (a cache hit when the client checked the constraint first).
"""

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from engine.config import EngineConfig
from engine.drivers.step_loop import Call, StepLoop
from engine.drivers.worker_protocol import (
    Abort,
    AbortAll,
    AbortRequests,
    AdapterSummary,
    AddAdapter,
    CheckConstraint,
    Command,
    GetStats,
    PinAdapter,
    Rejected,
    RemoveAdapter,
    SetTenantWeight,
    Shutdown,
    StepOutputs,
    Submit,
    ValidateAdapter,
    to_wire,
)
from engine.engine import Engine
from engine.errors import EngineDeadError, EngineError
from engine.output.output_delta import DeltaEncoder
from engine.output.outputs import EngineStats, RequestOutput, ended_before_admission
from engine.sampling.grammar import GrammarConstraint

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)

T = TypeVar("T")

NUM_HELPER_THREADS = 2  # grammar compiles and adapter checks: each mostly waits on C++ code or the disk


class EngineWorker(StepLoop):
    """An :class:`Engine` and its step thread, commanded through thread-safe methods.

    Given an :class:`EngineConfig`, the step loop's thread builds the engine before its first step (the
    fast way on the CPU, see :meth:`run`). An :class:`Engine` built already is accepted too, but stepping
    it on another thread than the one that built it is slower on the CPU. Commands given before the
    engine is built wait for it.
    """

    def __init__(
        self,
        engine: Engine | EngineConfig,
        emit: Callable[[StepOutputs], None],
        on_death: Callable[[BaseException], None] | None = None,
    ) -> None:
        """``engine``: the config the step loop builds the engine from, or an engine built already.

        ``emit`` is called on the step thread (and, for a request refused because the loop has ended, on
        the thread that submitted it); ``on_death`` once, if the step loop dies (every call then fails). A
        build that fails is not a death: the future of :meth:`start` holds its error.
        """
        super().__init__(engine)
        self._emit = emit
        self._on_death_callback = on_death
        self._helpers = ThreadPoolExecutor(NUM_HELPER_THREADS, thread_name_prefix="loraplex-worker-helper")
        self._deltas = DeltaEncoder()
        self._live: set[str] = set()  # requests in the engine whose outputs are wanted
        self._compiling: dict[str, tuple[Submit, Future]] = {}  # requests waiting for their grammar
        self._rejected: list[Rejected] = []

    def run(self) -> None:
        """Run the step loop on the calling thread (building the engine first, given a config) until a stop.

        For a process of its own: the step loop belongs on the thread that built the engine
        (``engine/drivers/engine_build.py`` says why and what it costs otherwise).
        """
        self._loop()
        self._helpers.shutdown(wait=False, cancel_futures=True)

    def stop(self) -> None:
        """End every running request (their last outputs are emitted) and join the step thread."""
        if self._thread is None:
            return
        self.request_stop()
        self._thread.join()
        self._thread = None
        self._helpers.shutdown(wait=False, cancel_futures=True)

    # Commands -------------------------------------------------------------------------------------

    def handle(self, command: Command) -> Future | None:
        """Carry out a command as it arrived; a Future of its result for a call, None for the others."""
        match command:
            case Submit() | Abort() | AbortAll() | AbortRequests():
                self._put(command)
                return None
            case Shutdown():
                self.stop()
                return None
            case AddAdapter(name=name, path=path):
                return self.add_adapter(name, path)
            case RemoveAdapter(name=name):
                return self.call(lambda engine: engine.remove_adapter(name))
            case PinAdapter(name=name, pinned=pinned):
                return self.call(lambda engine: engine.pin_adapter(name, pinned))
            case ValidateAdapter(path=path):
                return self.validate_adapter(path)
            case GetStats():
                return self.stats()
            case SetTenantWeight(tenant=tenant, weight=weight):
                return self.call(lambda _: self._apply_weight(tenant, weight))
            case CheckConstraint(constraint=constraint):
                return self.check_constraint(constraint)
        raise TypeError(f"not a worker command: {command!r}")

    def submit(self, request: Submit) -> None:
        self._put(request)

    def abort(self, request_id: str) -> None:
        self._put(Abort(request_id))

    def call(self, fn: Callable[[Engine], T]) -> "Future[T]":
        """Run ``fn(engine)`` on the step thread between steps (the engine is not thread-safe)."""
        return self._queue_call(fn)

    def stats(self) -> "Future[EngineStats]":
        return self.call(lambda engine: engine.stats())

    def add_adapter(self, name: str, path: str | Path) -> "Future[str]":
        """Validate a PEFT folder off the step thread, then register it between steps; its digest."""
        registered: Future[str] = Future()

        def register(validated: Future) -> None:
            if validated.exception() is not None:
                registered.set_exception(validated.exception())
                return
            adapter = validated.result()
            self._put(Call(lambda engine: engine.add_adapter(name, path, adapter), registered))

        self._helpers.submit(lambda: self._built_engine().validate_adapter(path)).add_done_callback(register)
        return registered

    def validate_adapter(self, path: str | Path) -> "Future[AdapterSummary]":
        """Check a PEFT folder against the model without registering it (AdapterError if unusable)."""

        def validate() -> AdapterSummary:
            adapter = self._built_engine().validate_adapter(path)
            return AdapterSummary(
                adapter.digest, adapter.max_rank, adapter.lora_alpha, adapter.modules, adapter.size_bytes
            )

        return self._helpers.submit(validate)

    def check_constraint(self, constraint: GrammarConstraint) -> "Future[None]":
        """Compile a constraint off the step thread (cached); GrammarError if it cannot be."""

        def compile_only() -> None:
            self._built_engine().grammars.compile(constraint)

        return self._helpers.submit(compile_only)

    def _built_engine(self) -> Engine:
        """The engine, once built (a helper thread waits for the step thread); the build's error if that failed."""
        self._build.future.result()
        return self.engine

    # The step loop's side -------------------------------------------------------------------------

    def _handle(self, command: Any) -> None:
        match command:
            case AbortRequests(request_ids=request_ids):
                self._end_answered(request_ids)
            case Abort(request_id=request_id):  # its outputs are not wanted: nobody reads them
                self._abort(request_id)
                self._live.discard(request_id)
                self._deltas.forget(request_id)
            case Submit():
                self._accept(command)

    def _abort_everything(self) -> None:
        self._end_answered([*self._live, *self._compiling])

    def _end_answered(self, request_ids: list[str]) -> None:
        """End these requests, running or still compiling their grammar, each with its last outputs (finish
        reason "abort"); one still compiling is never admitted. Ids of neither kind are skipped."""
        outputs: list[RequestOutput] = []
        for request_id in request_ids:
            if request_id in self._compiling:
                request, _ = self._compiling.pop(request_id)
                self._live.add(request_id)
                outputs += ended_before_admission(request_id, request.prompt_ids, request.params.n)
            elif request_id in self._live:
                outputs += self._abort(request_id)
        self._send(outputs)

    def _between_steps(self) -> None:
        self._admit_compiled()
        if self._rejected:  # a refusal goes out now, not after the next step
            self._send([])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        self._send(outputs)

    def _refuse(self, command: Any, error: EngineDeadError) -> None:
        if isinstance(command, Submit):
            self._emit(StepOutputs([], [Rejected(command.request_id, to_wire(error))]))

    def _on_death(self, error: BaseException) -> None:
        if self._on_death_callback is not None:
            self._on_death_callback(error)

    def _abort(self, request_id: str) -> list[RequestOutput]:
        """Stop a request (running, waiting or still compiling its grammar); its last outputs."""
        self._compiling.pop(request_id, None)
        return self.engine.abort_request(request_id)

    def _accept(self, request: Submit) -> None:
        constraint = request.params.constraint
        if constraint is None:
            self._add(request, None)
            return
        compiled = self._helpers.submit(self.engine.grammars.compile, constraint)
        self._compiling[request.request_id] = (request, compiled)
        compiled.add_done_callback(lambda _: self._wake.set())

    def _admit_compiled(self) -> None:
        for request_id, (request, compiled) in list(self._compiling.items()):
            if not compiled.done():
                continue
            del self._compiling[request_id]
            if compiled.exception() is not None:
                self._reject(request, compiled.exception())
            else:
                self._add(request, compiled.result())

    def _add(self, request: Submit, grammar: "xgrammar.CompiledGrammar | None") -> None:
        try:
            self._apply_weight(request.tenant, request.weight)
            self.engine.add_request(
                request.prompt_ids, request.params, request.request_id, request.adapter, request.tenant, grammar
            )
        except EngineError as error:
            self._reject(request, error)
            return
        self._live.add(request.request_id)

    def _reject(self, request: Submit, error: BaseException) -> None:
        self._rejected.append(Rejected(request.request_id, to_wire(error)))

    def _send(self, outputs: list[RequestOutput]) -> None:
        """Emit one StepOutputs: the outputs someone still reads, and the refusals since the last one."""
        deltas = []
        for output in outputs:
            if output.request_id not in self._live:
                continue
            if output.request_finished:
                self._live.discard(output.request_id)
            deltas.append(self._deltas.encode(output))
        rejected, self._rejected = self._rejected, []
        if deltas or rejected:
            self._emit(StepOutputs(deltas, rejected))
