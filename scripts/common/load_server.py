"""``loraplex serve`` in a child process, on a temporary data folder, for scripts that load a real server.

The child runs ``python -m app.cli.main serve`` on 127.0.0.1 with ``LORAPLEX_HOME`` set to a fresh temporary
folder (so the embedded PostgreSQL starts empty there), ``LORAPLEX_MODEL`` set to an existing model folder
(nothing is converted again), the demo off, and ``LORAPLEX_ADMIN_KEY`` set to a key made here, which the
server stores on its first start: the parent creates everything else over the admin API. The server's log
goes to ``server.log`` in the data folder; the folder is removed when the server stops.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from app.keys.secrets import generate_api_key
from scripts import REPO_ROOT
from scripts.common.thread_switches import stat_cpu_s

logger = logging.getLogger("load_server")

START_TIMEOUT_S = 300.0  # initdb of the embedded PostgreSQL, the migrations and the model load, on a busy machine
STOP_TIMEOUT_S = 60.0  # uvicorn drains for 10 s, then the usage writer's last flush and PostgreSQL's stop
POLL_S = 0.2
LOG_TAIL_CHARS = 4000
# The child gets its own database and key secret: these, inherited, would point it at someone else's.
CLEARED_VARIABLES = ("DATABASE_URL", "LORAPLEX_KEY_SECRET", "LORAPLEX_URL")


class ServerStartError(RuntimeError):
    """The server exited or did not become ready in time; the message ends with its log's tail."""


class LocalServer:
    """A loraplex server in a child process, started by :meth:`start`, stopped by :meth:`stop`."""

    def __init__(self, model: Path, extra_env: dict[str, str] | None = None, parent: Path | None = None) -> None:
        """``parent``: the folder to make the temporary data folder in (the system's temporary folder by default)."""
        self.model = model
        self.extra_env = extra_env or {}
        self.admin_key = generate_api_key().plaintext
        if parent is not None:
            parent.mkdir(parents=True, exist_ok=True)
        self.home = Path(tempfile.mkdtemp(prefix="loraplex-load-", dir=parent))
        os.chmod(self.home, 0o755)  # as root, the embedded PostgreSQL runs as its own user and must reach it
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        if self.process is None:
            raise RuntimeError("the server is not started")
        return self.process.pid

    def start(self) -> None:
        """Start the child; :meth:`wait_ready` waits until it takes requests."""
        env = {key: value for key, value in os.environ.items() if key not in CLEARED_VARIABLES}
        env |= {
            "LORAPLEX_HOME": str(self.home),
            "LORAPLEX_MODEL": str(self.model),
            "LORAPLEX_DEMO": "0",
            "LORAPLEX_ADMIN_KEY": self.admin_key,
            **self.extra_env,
        }
        command = [sys.executable, "-m", "app.cli.main", "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        with (self.home / "server.log").open("ab") as log:  # a restart appends to the same log
            self.process = subprocess.Popen(
                command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def stop(self) -> int | None:
        """SIGTERM and wait (a kill if it hangs); the exit code, or None if it never started. Removes the folder."""
        try:
            return self.terminate()
        finally:
            self._stop_leftover_postgres()
            shutil.rmtree(self.home, ignore_errors=True)

    def log_tail(self) -> str:
        log = self.home / "server.log"
        return log.read_text(errors="replace")[-LOG_TAIL_CHARS:] if log.is_file() else "(no log)"

    def wait_ready(self) -> None:
        """Wait until ``GET /ready`` answers 200; ServerStartError if the server exits or takes too long."""
        deadline = time.monotonic() + START_TIMEOUT_S
        with httpx.Client(base_url=self.url, timeout=5.0) as http:
            while True:
                assert self.process is not None
                if self.process.poll() is not None:
                    raise ServerStartError(
                        f"the server exited with code {self.process.returncode}; its log:\n{self.log_tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if http.get("/ready").status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise ServerStartError(
                        f"the server was not ready in {START_TIMEOUT_S:.0f} s; its log:\n{self.log_tail()}"
                    )
                time.sleep(POLL_S)

    def terminate(self) -> int | None:
        """SIGTERM and wait (a kill if it hangs), keeping the data folder: :meth:`start` may run it again."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning("the server did not stop in %.0f s; killing it", STOP_TIMEOUT_S)
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def _stop_leftover_postgres(self) -> None:
        """A killed server leaves its PostgreSQL running; its pid is the first line of postmaster.pid."""
        pid_file = self.home / "postgres" / "postmaster.pid"
        if not pid_file.is_file():
            return
        with contextlib.suppress(ValueError, IndexError, ProcessLookupError):
            pid = int(pid_file.read_text().splitlines()[0])
            os.kill(pid, signal.SIGQUIT)  # PostgreSQL's immediate shutdown
            logger.warning("stopped the embedded PostgreSQL left running (pid %d)", pid)
            time.sleep(1.0)


def rss_mb(pid: int) -> float | None:
    """Resident memory of process ``pid`` in MiB (VmRSS from /proc); None when it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0  # the kernel writes kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def cpu_s(pid: int) -> float | None:
    """User plus system CPU seconds process ``pid`` has used (from /proc/<pid>/stat); None when unreadable."""
    try:
        return stat_cpu_s(Path(f"/proc/{pid}/stat").read_text())
    except (OSError, ValueError, IndexError):
        return None


def _free_port() -> int:
    """A port free now; the child binds it a moment later (another process taking it first is unlikely)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
