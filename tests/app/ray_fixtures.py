"""A real local Ray cluster for the session, and the engine deployed on it as two replicas.

The replicas reserve no CPUs (``replica_cpus=0``), so both fit on the two-CPU cluster with Serve's own
actors; each loads the default model into a pool of its own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import ray
from ray import serve

from app.cluster.deployment import RaySettings
from app.cluster.directory import DIRECTORY_NAME, DIRECTORY_NAMESPACE
from app.cluster.environment import configure_ray_environment
from app.cluster.ray_client import RayEngineClient
from engine import EngineStats
from tests.app.gateway_fixtures import default_engine_config

NUM_REPLICAS = 2
REPLICA_WAIT_S = 120.0


def start_ray() -> None:
    """Ray with the settings a gateway gives it, so its processes (Serve's controller, the replicas) run as deployed."""
    configure_ray_environment()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)


def stop_ray() -> None:
    serve.shutdown()
    ray.shutdown()


def start_ray_engine(model_home: Path, home: Path) -> RayEngineClient:
    """The default model's engine as NUM_REPLICAS Serve replicas, started (Ray must be running)."""
    config = default_engine_config(model_home)
    client = RayEngineClient(
        config, Path(config.model).name, home, RaySettings(num_replicas=NUM_REPLICAS, replica_cpus=0)
    )
    asyncio.run(client.start())
    wait_for_replicas(NUM_REPLICAS)
    return client


def replica_pids() -> dict[str, int]:
    """The live replicas' ids and process ids, as the directory knows them."""
    directory = ray.get_actor(DIRECTORY_NAME, namespace=DIRECTORY_NAMESPACE)
    return ray.get(directory.members.remote())


def wait_for_replicas(count: int, without: str | None = None) -> dict[str, int]:
    """Wait until ``count`` replicas have joined the directory (none of them ``without``)."""
    deadline = time.monotonic() + REPLICA_WAIT_S
    while time.monotonic() < deadline:
        members = replica_pids()
        if len(members) == count and without not in members:
            return members
        time.sleep(0.2)
    raise TimeoutError(f"{count} engine replicas did not join within {REPLICA_WAIT_S:.0f} s: {replica_pids()}")


def generated_by_replica(stats: dict[str, EngineStats]) -> dict[str, int]:
    return {replica_id: one.num_generated_tokens for replica_id, one in stats.items()}


def serving_replica(before: dict[str, int], after: dict[str, int]) -> str:
    """The one replica whose generated-token count moved between two stats readings."""
    moved = [replica_id for replica_id, count in after.items() if count != before.get(replica_id, 0)]
    assert len(moved) == 1, f"expected one replica to have served the request, got {moved}"
    return moved[0]


def session_ray_engine(model_home: Path, home: Path) -> Iterator[RayEngineClient]:
    start_ray()
    try:
        client = start_ray_engine(model_home, home)
        yield client
        asyncio.run(client.stop())
    finally:
        stop_ray()
