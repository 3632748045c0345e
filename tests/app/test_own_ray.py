"""A gateway that starts a Ray of its own keeps it for as long as it runs: the real `loraplex serve`
(``LORAPLEX_ENGINE=ray``, no address) serves a request through its replica well after its start-up ended,
every Ray process it started still running, and a SIGTERM then stops the gateway and its Ray."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest

from app.cli.admin_client import AdminClient
from app.keys.secrets import generate_api_key
from app.model_store import resolve_model
from tests.app.own_ray_gateway import EXIT_WAIT_S, start_gateway, stop, wait_until

pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.default_model

AFTER_START_S = 3.0  # the start-up's threads have long ended by then


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_gateway_keeps_the_ray_it_started_and_serves_through_it_until_it_stops(
    database_url: str, data_home: Path, tmp_path: Path
) -> None:
    admin_key = generate_api_key().plaintext
    process, log, url = start_gateway(
        database_url, data_home, tmp_path, LORAPLEX_RAY_REPLICA_CPUS="1", LORAPLEX_ADMIN_KEY=admin_key
    )
    try:
        wait_until(process, log, lambda: _ready(url), "readiness")
        ray_processes = psutil.Process(process.pid).children(recursive=True)
        names = {child.name() for child in ray_processes}
        assert {"gcs_server", "raylet"} <= names, names
        time.sleep(AFTER_START_S)
        dead = [child.name() for child in ray_processes if not child.is_running() or child.status() == "zombie"]
        assert not dead, f"Ray processes died after the start-up: {dead}\n{log.read_text()[-3000:]}"

        admin = AdminClient(url, admin_key)
        try:
            tenant = admin.create_tenant("own-ray")
            key = admin.create_key(tenant["id"], "own-ray", ["inference"])["key"]
        finally:
            admin.close()
        reply = httpx.post(
            f"{url}/v1/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={
                "model": resolve_model("default", data_home).name,
                "prompt": "The capital of France is",
                "max_tokens": 4,
            },
            timeout=60.0,
        )
        assert reply.status_code == 200, reply.text
        assert 1 <= reply.json()["usage"]["completion_tokens"] <= 4  # sampled: it may end early

        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=EXIT_WAIT_S)
    finally:
        stop(process)
    text = log.read_text()
    assert code == -signal.SIGTERM, f"exit code {code}:\n{text[-3000:]}"  # uvicorn re-raises the signal
    assert "gateway stopped: usage written, engine and database closed" in text, text[-3000:]
    _, alive = psutil.wait_procs(ray_processes, timeout=EXIT_WAIT_S)
    assert not alive, f"Ray processes outlived the gateway: {[p.pid for p in alive]}"
