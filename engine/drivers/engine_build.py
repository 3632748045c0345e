"""An engine built on the thread that steps it, and the future of that build.

libgomp (torch's OpenMP runtime) keeps a pool of threads for every thread that opens parallel regions. An
engine built on one thread (loading, packing and warming up run torch ops) and stepped on another makes it
manage more threads than there are cores; it then cuts its spin-wait short, so each of a step's parallel
regions waits for sleeping threads, and small ops run several times slower than on the thread that built
it (docs/native-cpu-kernels.md#measurements). So
the step loops (``AsyncEngine``, ``EngineWorker``) take the engine's config and build the engine on their
own thread before the first step.
"""

from collections.abc import Callable
from concurrent.futures import Future

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import EngineError


class EngineBuild:
    """An :class:`Engine` given built already, or built from its config by the thread that calls :meth:`run`."""

    def __init__(self, engine: Engine | EngineConfig) -> None:
        self._config = engine if isinstance(engine, EngineConfig) else None
        self._engine = engine if isinstance(engine, Engine) else None
        self.future: Future[None] = Future()
        """Done once the engine exists; when the build failed, it holds what ``Engine(config)`` raised."""
        self.future.set_running_or_notify_cancel()  # a waiter that gives up cannot cancel a build others wait for
        if self._engine is not None:
            self.future.set_result(None)

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise EngineError("the engine is not built yet; wait for the future of the step loop's start()")
        return self._engine

    @property
    def failed(self) -> bool:
        return self.future.done() and self.future.exception() is not None

    def run(self, on_failure: Callable[[BaseException], None]) -> bool:
        """Build the engine on the calling thread, the one that will step it, unless it exists; False if that failed.

        ``on_failure`` gets the build's error before the future does, so whoever the future wakes sees what
        it did (a step loop marks itself dead there).
        """
        if self._engine is not None:
            return True
        if self._config is None or self.failed:  # failed before: a step loop started again finds no engine
            return False
        try:
            self._engine = Engine(self._config)
        except BaseException as error:  # whatever it was, whoever waits for the build must hear of it, not hang
            on_failure(error)
            self.future.set_exception(error)
            return False
        self.future.set_result(None)
        return True
