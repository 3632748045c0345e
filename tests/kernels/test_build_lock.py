"""A native build killed midway does not hang the next start; a start that waits on another's build says so.

Every build here goes to a temporary TORCH_EXTENSIONS_DIR (or a temporary folder), never torch's shared one.
The kill test builds a one-op library (a few seconds of compiling torch's headers) through the same
``load_library`` the native kernels are built with, kills its process while the build holds torch's lock,
and starts it again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from loraplex_kernels import build_lock
from loraplex_kernels.build_lock import TORCH_BATON_NAME, BuildLockTimeoutError
from tests.kernels.child_pytest import ROOT

LIBRARY = "loraplex_lock_test"
SOURCE = """
#include <torch/library.h>

at::Tensor twice(const at::Tensor& x) { return x.mul(2); }

TORCH_LIBRARY(loraplex_lock_test, m) { m.def("twice", &twice); }
"""
CHILD = """
import logging, sys
from pathlib import Path
import torch
from loraplex_kernels.build_lock import load_library
logging.basicConfig(level=logging.INFO)
load_library(sys.argv[1], [Path(sys.argv[2])], ["-O0"], [], [])
print("twice:", torch.ops.loraplex_lock_test.twice(torch.tensor([1.0, 2.0])).tolist())
"""
BATON_WAIT_S = 120  # torch's lock and ninja's file appear once the child has imported torch
COMPILING_S = 1.0  # the build is killed this long after ninja starts, while the compiler runs
START_TIMEOUT_S = 600  # the second start compiles the one-op library (seconds on an idle machine)


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler here")
def test_a_build_killed_midway_does_not_hang_the_next_start(tmp_path: Path) -> None:
    source = tmp_path / "twice.cpp"
    source.write_text(SOURCE)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")}
    baton = tmp_path / "extensions" / LIBRARY / TORCH_BATON_NAME
    args = [sys.executable, "-c", CHILD, LIBRARY, str(source)]
    first = subprocess.Popen(args, cwd=ROOT, env=env, start_new_session=True, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + BATON_WAIT_S
        while not (baton.exists() and baton.with_name("build.ninja").exists()):
            assert first.poll() is None, "the first build ended before it could be killed"
            assert time.monotonic() < deadline, f"no {baton} and build.ninja after {BATON_WAIT_S} s"
            time.sleep(0.05)
        time.sleep(COMPILING_S)
        first.send_signal(signal.SIGKILL)  # the build's process only, as the OOM killer would
        first.wait()
        assert baton.exists(), "the killed build left no lock behind: nothing was tested"

        second = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=START_TIMEOUT_S)
    finally:
        _end_session(first.pid)  # the compilers the killed build left running
    assert second.returncode == 0, second.stderr[-3000:]
    assert "twice: [2.0, 4.0]" in second.stdout
    assert f"removed {baton}" in second.stderr, second.stderr[-3000:]


def test_a_lock_left_behind_is_removed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    baton = tmp_path / TORCH_BATON_NAME
    baton.touch()
    with caplog.at_level(logging.WARNING, logger=build_lock.__name__), build_lock.build_lock(tmp_path):
        assert not baton.exists()
    assert f"removed {baton}, left by a build" in caplog.text


def test_a_killed_builds_compilers_are_waited_for(tmp_path: Path) -> None:
    baton = tmp_path / TORCH_BATON_NAME
    baton.touch()
    leftover = subprocess.Popen(["sleep", "2"], cwd=tmp_path)  # a compiler still writing into the folder
    started = time.monotonic()
    try:
        with build_lock.build_lock(tmp_path):
            waited_s = time.monotonic() - started
            assert leftover.poll() is not None, "the lock was taken while a process still worked in the folder"
    finally:
        leftover.kill()
        leftover.wait()
    assert not baton.exists()
    assert waited_s >= 1.0


def test_a_wait_on_another_build_is_logged_and_ends_with_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(build_lock, "WAIT_LOG_INTERVAL_S", 0.3)
    held = threading.Event()
    release = threading.Event()

    def other_build() -> None:
        with build_lock.build_lock(tmp_path):
            held.set()
            release.wait(timeout=30)

    other = threading.Thread(target=other_build)
    other.start()
    assert held.wait(timeout=30)
    threading.Timer(1.5, release.set).start()
    with caplog.at_level(logging.INFO, logger=build_lock.__name__), build_lock.build_lock(tmp_path):
        assert release.is_set()
    other.join()
    lock = tmp_path / build_lock.OWNER_LOCK_NAME
    assert f"waiting for another process's build of the native CPU kernels: pid {os.getpid()}" in caplog.text
    assert f"holds {lock}" in caplog.text
    assert caplog.text.count("still waiting after") >= 2, caplog.text


def test_a_wait_that_never_ends_names_the_holder(tmp_path: Path) -> None:
    holder = rf"build by pid {os.getpid()} on .*, which holds {tmp_path}"
    with (
        build_lock.build_lock(tmp_path),
        pytest.raises(BuildLockTimeoutError, match=holder),
        build_lock.build_lock(tmp_path, max_wait_s=0.5),
    ):
        pass


def _end_session(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
