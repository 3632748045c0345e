"""Another process's wake-ups, on demand: a process that, while switched on, wakes ``hz`` times a second and
spins ``us`` microseconds each time.

On a machine whose every core runs the engine's threads, each wake-up of another process (the gateway's
threads, Ray's processes beside a replica) preempts one of them; this reproduces that load alone, so a
kernel's cost of it can be measured with the noise switched on and off in one run.
"""

import multiprocessing
import time
from multiprocessing.synchronize import Event
from types import TracebackType

POLL_S = 0.05  # how soon a switched-off process notices it was switched on or stopped


def _wake(hz: float, us: float, on: Event, stop: Event) -> None:
    period_s, spin_s = 1.0 / hz, us * 1e-6
    while not stop.is_set():
        if not on.wait(POLL_S):
            continue
        started = time.perf_counter()
        while time.perf_counter() - started < spin_s:
            pass
        time.sleep(period_s)


class CpuNoise:
    """The noise process for a ``with`` block, off until :meth:`switch` turns it on."""

    def __init__(self, hz: float, us: float) -> None:
        if hz <= 0 or us <= 0:
            raise ValueError(f"the noise needs a positive rate and spin, got {hz} Hz and {us} us")
        context = multiprocessing.get_context("spawn")
        self._on = context.Event()
        self._stop = context.Event()
        self._process = context.Process(target=_wake, args=(hz, us, self._on, self._stop), daemon=True)

    def __enter__(self) -> "CpuNoise":
        self._process.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._process.join(timeout=5)

    def switch(self, on: bool) -> None:
        """Start or stop the wake-ups (they begin within a sleep of the process's loop)."""
        if on:
            self._on.set()
        else:
            self._on.clear()
