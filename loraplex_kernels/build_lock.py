"""One build at a time in a torch extension's build folder, and no wait on a build whose process is gone.

``torch.utils.cpp_extension.load`` guards a build with a file named ``lock`` in the build folder, which it
creates before building and removes after (torch's FileBaton); another process that finds the file waits
for it to go, without end and without a word. A build killed midway (Ctrl-C, a timeout, the OOM killer)
leaves the file behind, and every later start would wait on it.

:func:`load_library` therefore takes a lock of its own first: an ``flock`` on ``loraplex.lock`` in the same
folder (the file stays; its holder writes its pid and host into it). The operating system releases an
flock when its holder dies, however it dies, so whoever holds it is the folder's only builder, and a
``lock`` file found then was left by a build that is gone: it is removed, once the compilers that build
started are done (they outlive a killed parent and still write into the folder). A process that waits for
another's build logs the lock's path and its holder at once and every WAIT_LOG_INTERVAL_S, and gives up
after MAX_WAIT_S with BuildLockTimeoutError, which names the process to end.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

OWNER_LOCK_NAME = "loraplex.lock"  # our flock; never removed, so every process locks the same file
TORCH_BATON_NAME = "lock"  # torch's FileBaton in the build folder
POLL_S = 0.2  # how often a waiting process tries the lock again
WAIT_LOG_INTERVAL_S = 30.0  # a waiting process says so again this often
MAX_WAIT_S = 1800.0  # a build takes about a minute on two idle cores; half an hour means its process is stuck
LEFTOVER_WAIT_S = 300.0  # the most a killed build's compilers are waited for (each compiles one source file)


class BuildLockTimeoutError(RuntimeError):
    """Another process held the build folder's lock for longer than a build takes; the message names it."""


def build_folder(name: str) -> Path:
    """The folder torch builds the extension ``name`` in (under TORCH_EXTENSIONS_DIR when set); created."""
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(name, verbose=False))


def load_library(
    name: str,
    sources: Sequence[Path],
    cflags: Sequence[str],
    ldflags: Sequence[str],
    include_paths: Sequence[Path],
) -> None:
    """Build (when needed) and load the operator library ``name`` with ``cpp_extension.load``, holding the build
    folder's lock; a ``lock`` file left by a killed build is removed first (see the module docstring)."""
    from torch.utils import cpp_extension

    with build_lock(build_folder(name)):
        cpp_extension.load(
            name=name,
            sources=[str(path) for path in sources],
            extra_cflags=list(cflags),
            extra_ldflags=list(ldflags),
            extra_include_paths=[str(path) for path in include_paths],
            is_python_module=False,
            verbose=False,
        )


@contextmanager
def build_lock(folder: Path, max_wait_s: float = MAX_WAIT_S) -> Iterator[None]:
    """Hold ``folder``'s build lock for the block, waiting for another process's build (logged) for at most
    ``max_wait_s``; torch's ``lock`` file, if a killed build left one, is removed before the block runs."""
    path = folder / OWNER_LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _acquire(fd, path, max_wait_s)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        try:
            _remove_stale_baton(folder)
            yield
        finally:
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # releases the flock


def _acquire(fd: int, path: Path, max_wait_s: float) -> None:
    if _try_lock(fd):
        return
    started = time.monotonic()
    logger.info("waiting for another process's build of the native CPU kernels: %s holds %s", _holder(path), path)
    next_log = started + WAIT_LOG_INTERVAL_S
    while not _try_lock(fd):
        now = time.monotonic()
        if now - started > max_wait_s:
            raise BuildLockTimeoutError(
                f"gave up after {now - started:.0f} s waiting for the build by {_holder(path)}, which holds {path}: "
                "if that process is stuck, end it, and start again"
            )
        if now >= next_log:
            logger.warning(
                "still waiting after %.0f s for the build of the native CPU kernels by %s (lock %s)",
                now - started,
                _holder(path),
                path,
            )
            next_log = now + WAIT_LOG_INTERVAL_S
        time.sleep(POLL_S)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _holder(path: Path) -> str:
    """Who holds the lock, as its holder wrote it ("pid 123 on host")."""
    try:
        text = path.read_text().strip()
    except OSError:
        text = ""
    return text or "another process"


def _remove_stale_baton(folder: Path) -> None:
    baton = folder / TORCH_BATON_NAME
    if not baton.exists():
        return
    leftovers = _wait_for_leftovers(folder)
    baton.unlink(missing_ok=True)
    logger.warning(
        "removed %s, left by a build of the native CPU kernels that was interrupted; building again%s",
        baton,
        f" (processes {leftovers} still work in that folder)" if leftovers else "",
    )


def _wait_for_leftovers(folder: Path) -> list[int]:
    """Wait (at most LEFTOVER_WAIT_S) for the processes still working in ``folder`` to end; those still running."""
    deadline = time.monotonic() + LEFTOVER_WAIT_S
    leftovers = _processes_working_in(folder)
    if leftovers:
        logger.info("waiting for processes %s, left by an interrupted build, to finish in %s", leftovers, folder)
    while leftovers and time.monotonic() < deadline:
        time.sleep(POLL_S)
        leftovers = _processes_working_in(folder)
    return leftovers


def _processes_working_in(folder: Path) -> list[int]:
    """The processes whose working folder is ``folder`` (torch runs ninja there, and ninja the compilers), read
    from Linux's /proc; none where there is no /proc."""
    target = str(folder.resolve())
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if os.readlink(entry / "cwd") == target and int(entry.name) != os.getpid():
                pids.append(int(entry.name))
        except (OSError, ValueError):  # gone meanwhile, or another user's
            continue
    return sorted(pids)
