"""The real `loraplex serve` on a Ray of its own (``LORAPLEX_ENGINE=ray``, no address), for the tests of how the
gateway starts and stops that Ray."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from app.model_store import resolve_model
from tests.app.live_server import free_port

START_WAIT_S = 120.0  # Ray's start and the gateway's, up to the deployment or readiness
EXIT_WAIT_S = 30.0


def start_gateway(database_url: str, data_home: Path, tmp_path: Path, **env: str) -> tuple[subprocess.Popen, Path, str]:
    """The gateway process, its log file and its URL; ``env`` adds to (or overrides) the settings."""
    clean = {name: value for name, value in os.environ.items() if not name.startswith(("LORAPLEX_", "DATABASE_URL"))}
    clean |= {
        "LORAPLEX_HOME": str(tmp_path / "home"),
        "LORAPLEX_MODEL": str(resolve_model("default", data_home)),
        "DATABASE_URL": database_url,
        "LORAPLEX_MIGRATE": "0",
        "LORAPLEX_DEMO": "0",
        "LORAPLEX_ENGINE": "ray",
        **env,
    }
    log = tmp_path / "gateway.log"
    port = str(free_port())
    command = [str(Path(sys.executable).parent / "loraplex"), "serve", "--host", "127.0.0.1", "--port", port]
    with log.open("ab") as output:
        process = subprocess.Popen(command, env=clean, stdout=output, stderr=output)
    return process, log, f"http://127.0.0.1:{port}"


def wait_until(process: subprocess.Popen, log: Path, ready: Callable[[], bool], what: str) -> None:
    """Poll ``ready()`` until it is true; fails with the log's end if the gateway exits or takes too long."""
    deadline = time.monotonic() + START_WAIT_S
    while not ready():
        assert process.poll() is None, f"the gateway exited at start:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} in {START_WAIT_S:.0f} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def stop(process: subprocess.Popen) -> None:
    """Kill the gateway if a test left it running."""
    if process.poll() is None:
        process.kill()
        process.wait()
