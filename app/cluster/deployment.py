"""The engine tier on Ray Serve: connect to (or start) Ray, and deploy the engine replicas once.

The gateway is a Ray driver on a node of the cluster (not a Serve ingress): it keeps its own HTTP server,
database pools and shutdown, reaches the engine replicas through a deployment handle, and several gateways
share one deployment. Serve's own HTTP proxy is not started. With no address, the gateway
starts a single-node Ray of its own and shuts it down when it stops; given an address, it joins that
cluster, deploys the engine app if it is not running there (or updates it), and leaves it running.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path

import ray
from ray import serve
from ray.actor import ActorHandle
from ray.serve.handle import DeploymentHandle

from app.cluster.directory import DIRECTORY_NAME, DIRECTORY_NAMESPACE, EngineDirectory
from app.cluster.environment import REPLICA_ENVIRONMENT, configure_ray_environment
from app.cluster.replica import EngineReplica
from engine.config import EngineConfig

logger = logging.getLogger(__name__)

ENGINE_APP = "loraplex-engine"
REPLICA_CACHE_FOLDER = "worker-adapters"  # under the data folder on each replica's node
HEALTH_CHECK_PERIOD_S = 2.0  # how soon Serve notices a replica whose engine died


@dataclass(frozen=True, slots=True)
class RaySettings:
    """Where the engine replicas run and what each one takes."""

    address: str | None = None
    """A Ray cluster to join ("auto", "ray://host:10001", ...); None starts a single-node Ray in this process."""
    num_replicas: int = 1
    replica_cpus: float | None = None
    """CPUs Ray reserves for each replica (its torch threads follow, when at least 1); None: this machine's
    cores shared equally among the replicas (a cluster's operator says how many its GPU nodes give each)."""
    replica_gpus: float = 0.0


@dataclass(frozen=True, slots=True)
class EngineDeployment:
    handle: DeploymentHandle
    directory: ActorHandle
    owns_ray: bool
    """This process started Ray, so it shuts Ray down when it stops."""


def deploy_engine(
    config: EngineConfig, home: Path, settings: RaySettings, database_url: str | None = None
) -> EngineDeployment:
    """Connect to Ray (or start it), create the directory, and deploy the engine replicas; blocks until they serve.

    ``database_url`` is where the replicas fetch adapters from (``adapter_files``); the store folder second.
    """
    owns_ray = False
    configure_ray_environment()  # a no-op when the gateway did it before importing Ray
    if not ray.is_initialized():
        if settings.address is None:  # "local": a new single-node Ray, never someone else's running one
            ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING)
            owns_ray = True
        else:
            ray.init(address=settings.address, logging_level=logging.WARNING)
    directory = EngineDirectory.options(
        name=DIRECTORY_NAME, namespace=DIRECTORY_NAMESPACE, get_if_exists=True, lifetime="detached"
    ).remote()
    serve.start(proxy_location="Disabled")
    if not owns_ray and _is_running(ENGINE_APP):  # another gateway deployed it: share it as it is
        logger.info("joining the running engine app %s", ENGINE_APP)
        return EngineDeployment(serve.get_app_handle(ENGINE_APP), directory, owns_ray)
    cpus = settings.replica_cpus
    if cpus is None:
        cpus = float(max(1, (os.cpu_count() or 1) // settings.num_replicas))
    if cpus >= 1 and config.num_threads is None:
        config = replace(config, num_threads=int(cpus))
    replica = serve.deployment(EngineReplica).options(
        name="EngineReplica",
        num_replicas=settings.num_replicas,
        max_ongoing_requests=config.max_num_seqs,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        ray_actor_options={
            "num_cpus": cpus,
            "num_gpus": settings.replica_gpus,
            "runtime_env": {"env_vars": REPLICA_ENVIRONMENT},
        },
    )
    app = replica.bind(config, str(home / "adapters"), str(home / REPLICA_CACHE_FOLDER), database_url)
    handle = serve.run(app, name=ENGINE_APP, route_prefix=None)
    logger.info("engine app deployed on Ray: %d replica(s)", settings.num_replicas)
    return EngineDeployment(handle, directory, owns_ray)


def _is_running(app_name: str) -> bool:
    status = serve.status().applications.get(app_name)
    return status is not None and status.status == "RUNNING"


def shut_down(deployment: EngineDeployment) -> None:
    """Stop what this process started: all of Ray when it started it; nothing on a shared cluster.

    Its own Ray goes down with ``ray.shutdown()`` alone, which ends Serve's processes with it: this
    gateway's requests were ended already, and ``serve.shutdown()`` first took 30 s here (Serve's
    controller timed out draining a router that runs on the gateway's event loop).
    """
    if deployment.owns_ray:
        ray.shutdown()
