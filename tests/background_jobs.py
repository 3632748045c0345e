"""Slow set-up that runs in a process of its own while the session's other tests run (a plugin of tests/conftest.py).

Training the demo adapters (the fixture ``trained_demo_adapters``) and building the native kernels for AVX2 only
(``avx2_library``) are CPU time that no other test waits for. Each is a job, started as the session's tests start
when a selected test uses its fixture, at the lowest CPU priority: it runs on CPU time the tests leave idle, so the
other tests run as they would without it. The tests that use a job's fixture run last, which leaves the job the
rest of the session; the fixture waits for the job, raised to normal priority, and fails with the end of its log if
the job failed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from app.demo.adapters import demo_adapters_root, training_command
from app.model_store import resolve_model
from app.settings import Settings
from loraplex_kernels.native_cpu import AVX2_MARCH, MARCH_ENV

NICENESS = 19  # the lowest priority: a job gets the CPU only where no test wants it
WAITED_NICENESS = 0  # once a test waits for the job, nothing else of the session's is running: normal priority
LOG_TAIL_CHARS = 4000  # of a failed job's log, in the fixture's error
TRAINED_ENV = "LORAPLEX_TEST_DEMO_ADAPTERS"  # a folder of trained demo adapters: no training job then


class BackgroundJobError(RuntimeError):
    """A background job failed; the message holds the end of its log."""


class BackgroundJob:
    """A command running at the lowest CPU priority in a session of its own, its output in a log file."""

    def __init__(self, name: str, command: Sequence[str], folder: Path, env: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.folder = folder
        """The job's own folder: its log, and whatever it writes."""
        self.log = folder / "job.log"
        with self.log.open("wb") as output:
            self.process = subprocess.Popen(
                ["nice", "-n", str(NICENESS), *command],
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # so that stop() ends the compilers a build starts too
            )
        _set_autogroup_niceness(self.process.pid, NICENESS)

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait for the job to end, at normal priority where this process may raise it (else at the lowest, which
        only work outside the session competes with); BackgroundJobError with its log's end if it failed or ran past
        ``timeout_s``."""
        with contextlib.suppress(OSError):  # every thread of the job's processes (a build's compilers: autogroup)
            os.setpriority(os.PRIO_PGRP, self.process.pid, WAITED_NICENESS)
        _set_autogroup_niceness(self.process.pid, WAITED_NICENESS)
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise BackgroundJobError(f"{self.name} ran past {timeout_s:g} s:\n{self._log_tail()}") from None
        if code != 0:
            raise BackgroundJobError(f"{self.name} failed (exit {code}):\n{self._log_tail()}")

    def stop(self) -> None:
        """End the job and every process it started, if it still runs."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def _log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-LOG_TAIL_CHARS:]


def _set_autogroup_niceness(pid: int, niceness: int) -> None:
    """Where the kernel schedules each session as a group (autogroup), groups share the CPU by the group's nice
    value, whatever their processes' own: the job's session gets the job's, or it would take an equal share against
    the tests' own sessions (Ray's, PostgreSQL's, a browser's). Without autogroup the processes' nice value holds."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/autogroup").write_text(f"{niceness}\n")


def demo_training_settings(folder: Path) -> Settings:
    """The settings of the data folder that the demo training job in ``folder`` trains the adapters into."""
    return Settings(home=folder / "home", model="default")


def start_demo_training(folder: Path) -> BackgroundJob:
    """The demo adapters' training, run as a first start of the server runs it (app/demo/adapters.py)."""
    model_folder = resolve_model("default", Settings.from_env().home)  # pulled by `make test` before pytest runs
    command = training_command(demo_adapters_root(demo_training_settings(folder)), model_folder)
    return BackgroundJob("training the demo adapters", command, folder)


def start_avx2_build(folder: Path) -> BackgroundJob:
    """`loraplex kernels build` for an AVX2-only target: the library tests/kernels/test_avx2_build.py's child pytest
    loads (it builds the library itself where it finds none)."""
    command = [sys.executable, "-m", "app.cli.main", "kernels", "build"]
    env = {**os.environ, MARCH_ENV: AVX2_MARCH}
    return BackgroundJob("the AVX2 build of the native kernels", command, folder, env)


JOBS: dict[str, Callable[[Path], BackgroundJob]] = {
    "trained_demo_adapters": start_demo_training,
    "avx2_library": start_avx2_build,
}
"""How each job starts, by the fixture that waits for it."""
RUNNING = pytest.StashKey[dict[str, BackgroundJob]]()


def job_for(request: pytest.FixtureRequest, fixture: str) -> BackgroundJob | None:
    """The job started for ``fixture`` in this session, if one was."""
    return request.config.stash.get(RUNNING, {}).get(fixture)


def _jobs_used(item: pytest.Item) -> set[str]:
    """The jobs whose fixtures ``item`` uses, none if a true ``skipif`` condition skips it."""
    if any(mark.args and mark.args[0] is True for mark in item.iter_markers("skipif")):
        return set()
    return set(getattr(item, "fixturenames", ())) & JOBS.keys()


@pytest.hookimpl(trylast=True)  # after the selection and pytest's own ordering
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that use a job's fixture run last, each group in its order."""
    items.sort(key=lambda item: bool(_jobs_used(item)))


@pytest.hookimpl(wrapper=True)
def pytest_runtestloop(session: pytest.Session) -> Iterator[object]:
    """Start the jobs the selected tests use, each in a temporary folder of its own; end them after the tests."""
    if session.config.option.collectonly:
        return (yield)
    needed = set().union(*(_jobs_used(item) for item in session.items))
    if os.environ.get(TRAINED_ENV):
        needed.discard("trained_demo_adapters")
    root = Path(tempfile.mkdtemp(prefix="loraplex-test-jobs-"))
    running: dict[str, BackgroundJob] = {}
    session.config.stash[RUNNING] = running
    try:
        for name in sorted(needed):
            (root / name).mkdir()
            running[name] = JOBS[name](root / name)
        return (yield)
    finally:
        for job in running.values():
            job.stop()
        shutil.rmtree(root, ignore_errors=True)
