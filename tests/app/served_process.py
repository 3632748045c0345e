"""`loraplex serve` as a real subprocess on a free loopback port, for drills that need whole servers."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.app.live_server import free_port

START_TIMEOUT_S = 120.0


@contextmanager
def served(home: Path, env: dict[str, str], grace_s: int, log: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    """`loraplex serve` on a free loopback port, ready to answer; killed if the test leaves it running."""
    port = free_port()
    command = [str(Path(sys.executable).parent / "loraplex"), "serve", "--host", "127.0.0.1", "--port", str(port)]
    with log.open("ab") as output:
        process = subprocess.Popen(
            command, env={**env, "LORAPLEX_SHUTDOWN_GRACE_S": str(grace_s)}, stdout=output, stderr=output
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert process.poll() is None, f"the server exited at start:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the server did not start:\n{log.read_text()[-3000:]}"
            try:
                if httpx.get(f"{url}/ready", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
