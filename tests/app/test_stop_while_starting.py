"""SIGTERM while the engine is still starting: the real `loraplex serve` on its own Ray, its replica asking for
more CPUs than the machine has, so Serve's deployment waits without end. The gateway gives the start up,
closes what it opened and exits; the Ray it started goes down with it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.app.own_ray_gateway import EXIT_WAIT_S, start_gateway, stop, wait_until

pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.default_model

DEPLOYING = "deploying the engine app"


def test_sigterm_while_the_ray_engine_deploys_stops_the_gateway_and_its_ray(
    database_url: str, data_home: Path, tmp_path: Path
) -> None:
    more_cpus_than_the_node = str(100 * (os.cpu_count() or 1))  # never placed: the deployment waits
    process, log, _ = start_gateway(
        database_url, data_home, tmp_path, LORAPLEX_RAY_REPLICA_CPUS=more_cpus_than_the_node
    )
    try:
        wait_until(process, log, lambda: DEPLOYING in log.read_text(), repr(DEPLOYING))
        time.sleep(2.0)  # inside Serve's deployment, which now waits for the CPUs without end
        ray_processes = psutil.Process(process.pid).children(recursive=True)
        assert ray_processes, "the gateway started no Ray processes"
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=EXIT_WAIT_S)
        took_s = time.monotonic() - sent
    finally:
        stop(process)
    text = log.read_text()
    assert code == -signal.SIGTERM, f"exit code {code}:\n{text[-3000:]}"  # uvicorn re-raises the signal
    assert "a stop was asked for while the engine was starting" in text, text[-3000:]
    assert "gateway stopped: usage written, engine and database closed" in text, text[-3000:]
    assert "Application startup failed" not in text and "Traceback" not in text, text[-3000:]  # a stop, not an error
    assert text.count("SIGTERM handler is not set") <= 1, text[-3000:]  # Ray notes it at each start: one start
    _, alive = psutil.wait_procs(ray_processes, timeout=EXIT_WAIT_S)
    assert not alive, f"Ray processes outlived the gateway ({took_s:.1f} s to exit): {[p.pid for p in alive]}"
