"""Two ``loraplex serve`` gateways on one Ray cluster and one PostgreSQL, for ``ray_cluster_drill.py``.

Both gateways get the same database, key secret and admin key (so a key made through one is good on the
other), ``LORAPLEX_ENGINE=ray`` with the head's address, and two engine replicas of one CPU each. Each has
a data folder of its own under the drill's scratch folder, kept across a restart (its log is appended to).
"""

from __future__ import annotations

import logging
import secrets
import time
from pathlib import Path

import httpx

from app.cli.admin_client import AdminClient
from scripts.common.load_server import LocalServer

logger = logging.getLogger("drill_gateways")

NUM_REPLICAS = 2
REPLICA_WAIT_S = 120.0
SERVED_WAIT_S = 60.0
POLL_S = 0.2


class DrillGateway(LocalServer):
    """A LocalServer whose log can be searched."""

    def log_count(self, text: str) -> int:
        log = self.home / "server.log"
        return log.read_text(errors="replace").count(text) if log.is_file() else 0


class Gateways:
    """Gateway A (deploys the engine app) and gateway B (joins it), on the same cluster and database."""

    JOINED = "joining the running engine app"
    STOPPED = "gateway stopped: usage written"

    def __init__(
        self, model: Path, scratch: Path, ray_address: str, database_url: str, ray_env: dict[str, str], pool_mb: int
    ) -> None:
        env = ray_env | {
            "LORAPLEX_ENGINE": "ray",
            "LORAPLEX_RAY_ADDRESS": ray_address,
            "LORAPLEX_RAY_REPLICAS": str(NUM_REPLICAS),
            "LORAPLEX_RAY_REPLICA_CPUS": "1",
            "LORAPLEX_POOL_MB": str(pool_mb),
            "DATABASE_URL": database_url,
            "LORAPLEX_MIGRATE": "0",  # the database is migrated before the gateways start
            "LORAPLEX_KEY_SECRET": secrets.token_hex(32),
        }
        self.a = DrillGateway(model, env, parent=scratch)
        self.b = DrillGateway(model, env, parent=scratch)
        self.b.admin_key = self.a.admin_key  # the admin key A creates in the shared database

    def start_a(self) -> None:
        _start("A", self.a)

    def start_b(self) -> None:
        _start("B", self.b)

    def start_both(self) -> None:
        """A and B at the same moment: both find no engine app and race to deploy it."""
        started = time.perf_counter()
        self.a.start()
        self.b.start()
        _wait("A", self.a, started)
        _wait("B", self.b, started)

    def stop(self) -> None:
        """Stop both (the data folders stay, under the scratch folder)."""
        for gateway in (self.b, self.a):
            gateway.terminate()

    def make_tenant(self, adapters: dict[str, Path]) -> str:
        """A tenant owning ``adapters``, made through A's admin API; its inference key."""
        admin = AdminClient(self.a.url, self.a.admin_key)
        try:
            tenant = admin.create_tenant("drill")
            key = admin.create_key(tenant["id"], "drill", ["inference"])["key"]
            for name, folder in adapters.items():
                admin.upload_adapter(tenant["id"], name, folder)
        finally:
            admin.close()
        logger.info("tenant, key and %d adapters made through gateway A", len(adapters))
        return key

    def wait_until_served(self, url: str, key: str, models: list[str]) -> None:
        """One request per model through ``url``, retried while the gateway does not know the model yet."""
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=url, timeout=120.0) as http:
            for model in models:
                deadline = time.monotonic() + SERVED_WAIT_S
                body = {"model": model, "prompt": "Hello", "max_tokens": 2}
                while (answer := http.post("/v1/completions", json=body, headers=headers)).status_code != 200:
                    if answer.status_code != 404 or time.monotonic() > deadline:
                        raise RuntimeError(f"{model} through {url}: HTTP {answer.status_code} {answer.text}")
                    time.sleep(POLL_S)
        logger.info("%s serves all %d adapters", url, len(models))

    def wait_for_replicas(self, count: int) -> dict[str, int]:
        """The directory's live replicas (id -> pid) once there are ``count`` (this process must be a Ray driver)."""
        import ray

        from app.cluster.directory import DIRECTORY_NAME, DIRECTORY_NAMESPACE

        directory = ray.get_actor(DIRECTORY_NAME, namespace=DIRECTORY_NAMESPACE)
        deadline = time.monotonic() + REPLICA_WAIT_S
        while len(members := ray.get(directory.members.remote())) != count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{count} engine replicas did not join in {REPLICA_WAIT_S:.0f} s: {members}")
            time.sleep(POLL_S)
        return members


def parent_pid(pid: int) -> int:
    """The parent of process ``pid`` (a replica's is its node's raylet)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _start(name: str, gateway: DrillGateway) -> None:
    started = time.perf_counter()
    gateway.start()
    _wait(name, gateway, started)


def _wait(name: str, gateway: DrillGateway, started: float) -> None:
    try:
        gateway.wait_ready()
    except Exception:
        logger.error("gateway %s's log ends:\n%s", name, gateway.log_tail())
        raise
    logger.info("gateway %s ready at %s in %.1f s", name, gateway.url, time.perf_counter() - started)
