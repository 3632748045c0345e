"""SIGTERM while the engine is still starting: the real `loraplex serve` on its own Ray, its replica asking for
more CPUs than the machine has, so Serve's deployment waits without end. The gateway gives the start up,
closes what it opened and exits; the Ray it started goes down with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.model_store import resolve_model
from tests.app.live_server import free_port

pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.default_model

DEPLOY_WAIT_S = 120.0  # Ray's start and the gateway's, up to the deployment
EXIT_WAIT_S = 30.0
DEPLOYING = "deploying the engine app"


def _wait_for_line(process: subprocess.Popen, log: Path, line: str) -> None:
    deadline = time.monotonic() + DEPLOY_WAIT_S
    while line not in log.read_text():
        assert process.poll() is None, f"the gateway exited at start:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {line!r} in the log:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def test_sigterm_while_the_ray_engine_deploys_stops_the_gateway_and_its_ray(
    database_url: str, data_home: Path, tmp_path: Path
) -> None:
    env = {name: value for name, value in os.environ.items() if not name.startswith(("LORAPLEX_", "DATABASE_URL"))}
    env |= {
        "LORAPLEX_HOME": str(tmp_path / "home"),
        "LORAPLEX_MODEL": str(resolve_model("default", data_home)),
        "DATABASE_URL": database_url,
        "LORAPLEX_MIGRATE": "0",
        "LORAPLEX_DEMO": "0",
        "LORAPLEX_ENGINE": "ray",
        "LORAPLEX_RAY_REPLICA_CPUS": str(100 * (os.cpu_count() or 1)),  # more than the node has: never placed
    }
    log = tmp_path / "gateway.log"
    port = str(free_port())
    command = [str(Path(sys.executable).parent / "loraplex"), "serve", "--host", "127.0.0.1", "--port", port]
    with log.open("ab") as output:
        process = subprocess.Popen(command, env=env, stdout=output, stderr=output)
    try:
        _wait_for_line(process, log, DEPLOYING)
        time.sleep(2.0)  # inside Serve's deployment, which now waits for the CPUs without end
        ray_processes = psutil.Process(process.pid).children(recursive=True)
        assert ray_processes, "the gateway started no Ray processes"
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=EXIT_WAIT_S)
        took_s = time.monotonic() - sent
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = log.read_text()
    assert code == -signal.SIGTERM, f"exit code {code}:\n{text[-3000:]}"  # uvicorn re-raises the signal
    assert "a stop was asked for while the engine was starting" in text, text[-3000:]
    assert "gateway stopped: usage written, engine and database closed" in text, text[-3000:]
    _, alive = psutil.wait_procs(ray_processes, timeout=EXIT_WAIT_S)
    assert not alive, f"Ray processes outlived the gateway ({took_s:.1f} s to exit): {[p.pid for p in alive]}"
