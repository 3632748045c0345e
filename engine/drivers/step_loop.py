"""The step loop both engine drivers share: an inbox of commands, the thread that steps, and what a death owes.

``AsyncEngine`` (asyncio callers in this process) and ``EngineWorker`` (commands from a socket or a Ray
replica) differ only in how a request arrives and where its outputs go; everything else lives here once:

- the thread that builds the engine steps it (``engine/drivers/engine_build.py`` says why);
- commands reach the step thread through a thread-safe inbox, drained in order before every step; an idle
  loop sleeps on a wake event, at most ``IDLE_WAIT_S`` between looks;
- a call runs ``fn(engine)`` between two steps and settles a ``concurrent.futures.Future``;
- each tenant's weight is given to the engine when it changes (the engine's default until then);
- the loop that ends, by a stop or a death, answers everything still in the inbox and everything put there
  afterwards: a call fails with EngineDeadError, a request is refused with it. Putting and dying cross
  under one lock, so no command lands in an inbox nobody reads.
"""

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.config import EngineConfig
from engine.drivers.engine_build import EngineBuild
from engine.drivers.worker_protocol import AbortAll
from engine.engine import Engine
from engine.errors import EngineDeadError
from engine.output.outputs import RequestOutput

logger = logging.getLogger(__name__)

T = TypeVar("T")

IDLE_WAIT_S = 0.05  # how long the idle loop sleeps between looks at the inbox when woken for nothing
DEFAULT_WEIGHT = 1.0  # the engine's weight for a tenant it was never given one for


@dataclass(frozen=True, slots=True)
class Call:
    """Run ``fn(engine)`` on the step thread between two steps; its result or error lands in ``future``."""

    fn: Callable[[Engine], Any]
    future: Future


_STOP = None  # the inbox's last item: abort what runs, then end the loop


class StepLoop:
    """An :class:`Engine`, its step thread and its inbox; a driver says how requests arrive and outputs leave.

    A driver implements :meth:`_handle` (a command of its own), :meth:`_abort_everything` (end every request
    it tracks, their last outputs delivered), :meth:`_deliver` (one step's outputs), :meth:`_refuse` (answer
    a request the loop will never run) and may add :meth:`_between_steps` and :meth:`_on_death`.
    """

    def __init__(self, engine: Engine | EngineConfig) -> None:
        """``engine``: the config the step thread builds the engine from, or an engine built already."""
        self._build = EngineBuild(engine)
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._weights: dict[str, float] = {}  # the weight last given to the engine, per tenant
        self._thread: threading.Thread | None = None
        self._entered = False  # the loop was entered (on a thread of its own or the caller's)
        self._ended: BaseException | None = None  # why the loop takes no more commands (a death or a stop)
        self._lock = threading.Lock()  # the loop's end and a new command cannot cross

    @property
    def engine(self) -> Engine:
        """The engine; one built from a config exists once the future of :meth:`start` is done."""
        return self._build.engine

    @property
    def is_running(self) -> bool:
        """True while the step loop takes commands: built, and neither dead nor stopped."""
        return self._entered and self._build.future.done() and self._ended is None

    def start(self) -> "Future[None]":
        """Run the step loop on a thread of its own, which first builds the engine when given a config.

        The future is done once the engine exists (at once for an engine built already); when the build
        fails, it holds what ``Engine(config)`` raised, the step thread has ended and later commands fail
        with EngineDeadError.
        """
        if self._thread is None and not self._build.failed:
            with self._lock:
                self._ended = None
            self._thread = threading.Thread(target=self._loop, name="loraplex-engine", daemon=True)
            self._thread.start()
        return self._build.future

    def request_stop(self) -> None:
        """Ask the step loop to end every running request (their last outputs delivered) and return; no wait."""
        self._put(_STOP)

    def abort_all(self) -> None:
        """End every request in flight before the next step; each gets its last output (finish reason "abort")."""
        self._put(AbortAll())

    def _queue_call(self, fn: Callable[[Engine], T]) -> "Future[T]":
        """Run ``fn(engine)`` on the step thread between steps (the engine is not thread-safe); its future."""
        future: Future[T] = Future()
        self._put(Call(fn, future))
        return future

    # The driver's part ----------------------------------------------------------------------------

    def _handle(self, command: Any) -> None:
        raise NotImplementedError

    def _abort_everything(self) -> None:
        raise NotImplementedError

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        raise NotImplementedError

    def _refuse(self, command: Any, error: EngineDeadError) -> None:
        raise NotImplementedError

    def _between_steps(self) -> None:
        """Work of the driver's own after the inbox is drained, before the step."""

    def _on_death(self, error: BaseException) -> None:
        """Tell the requests in flight that the loop died (the inbox is answered by the loop)."""

    # The loop -------------------------------------------------------------------------------------

    def _put(self, item: Any) -> None:
        with self._lock:
            ended = self._ended
            if ended is None:
                self._inbox.put(item)
                self._wake.set()
                return
        self._answer(item, self._dead_error(ended))

    def _apply_weight(self, tenant: str | None, weight: float | None) -> None:
        """Give the engine ``tenant``'s weight when it changed (rare); on the step thread."""
        if tenant is None or weight is None or self._weights.get(tenant, DEFAULT_WEIGHT) == weight:
            return
        self.engine.set_tenant_weight(tenant, weight)
        self._weights[tenant] = weight

    def _loop(self) -> None:
        self._entered = True
        if not self._build.run(on_failure=self._end):
            return
        try:
            while self._drain_inbox():
                self._between_steps()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
                    continue
                self._deliver(self.engine.step())
        except BaseException as error:  # every waiter must hear of it, whatever went wrong
            logger.exception("engine step loop died")
            self._end(error)
            self._on_death(error)
            return
        self._end(EngineDeadError("the engine was stopped"))

    def _end(self, error: BaseException) -> None:
        """Take no more commands; answer those in the inbox (nobody else will)."""
        with self._lock:
            self._ended = error
        dead = self._dead_error(error)
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._answer(item, dead)

    @staticmethod
    def _dead_error(error: BaseException) -> EngineDeadError:
        if isinstance(error, EngineDeadError):
            return error
        return EngineDeadError(f"the engine stopped after an error: {error}")

    def _answer(self, item: Any, error: EngineDeadError) -> None:
        """Answer a command the loop will not run: a call fails, a request is refused, the rest need nothing."""
        if isinstance(item, Call):
            if item.future.set_running_or_notify_cancel():
                item.future.set_exception(error)
        elif item is not _STOP and not isinstance(item, AbortAll):
            self._refuse(item, error)

    def _drain_inbox(self) -> bool:
        """Apply what arrived since the last look, in order; False once asked to stop."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True
            if item is _STOP or isinstance(item, AbortAll):
                self._abort_everything()
                if item is _STOP:
                    return False
            elif isinstance(item, Call):
                self._run_call(item)
            else:
                self._handle(item)

    def _run_call(self, call: Call) -> None:
        if not call.future.set_running_or_notify_cancel():  # its caller gave up
            return
        try:
            result = call.fn(self.engine)
        except Exception as error:  # the caller gets the error; the step loop goes on
            call.future.set_exception(error)
            return
        call.future.set_result(result)
