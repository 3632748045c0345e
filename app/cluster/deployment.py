"""The engine tier on Ray Serve: connect to (or start) Ray, and deploy the engine replicas once.

The gateway is a Ray driver on a node of the cluster (not a Serve ingress): it keeps its own HTTP server,
database pools and shutdown, reaches the engine replicas through a deployment handle, and several gateways
share one deployment. Serve's own HTTP proxy is not started. With no address, the gateway starts a
single-node Ray of its own and shuts it down when it stops; given an address, it joins that cluster and
leaves the engine app running when it stops. There it joins the engine app as it runs (with the settings
of the gateway that deployed it), waits while another gateway deploys it, and deploys it itself only when
it is absent or failed, after claiming the deployment in the directory: gateways that start together
start Serve once and deploy the app once, and a gateway's start or restart never replaces the replicas
under the others' streams.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import ray
from ray import serve
from ray.actor import ActorHandle
from ray.exceptions import ActorAlreadyExistsError
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from ray.serve.schema import ApplicationStatus

from app.cluster.affinity_router import AdapterAffinityRouter
from app.cluster.directory import DIRECTORY_NAME, DIRECTORY_NAMESPACE, EngineDirectory
from app.cluster.environment import (
    CONTROLLER_ENVIRONMENT,
    REPLICA_ENVIRONMENT,
    component_environment,
    configure_ray_environment,
)
from app.cluster.replica import EngineReplica
from engine.config import EngineConfig

logger = logging.getLogger(__name__)

ENGINE_APP = "loraplex-engine"
REPLICA_CACHE_FOLDER = "worker-adapters"  # under the data folder on each replica's node
HEALTH_CHECK_PERIOD_S = 2.0  # how soon Serve notices a replica whose engine died
DEPLOY_CLAIM_S = 30.0  # a gateway's claim to deploy the engine app; its deployment shows in Serve's status before
DEPLOY_POLL_S = 0.5  # between looks at the status of an engine app another gateway deploys
WAIT_STATUSES = (ApplicationStatus.DEPLOYING, ApplicationStatus.DELETING)  # another gateway's doing: wait for it


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
    output_port: int = 0
    """The port on the gateway's node where replicas send it its requests' outputs; 0: any free port."""


@dataclass(frozen=True, slots=True)
class EngineDeployment:
    handle: DeploymentHandle
    directory: ActorHandle
    owns_ray: bool
    """This process started Ray, so it shuts Ray down when it stops."""


def connect_ray(settings: RaySettings) -> bool:
    """Connect this process to the cluster at ``settings.address``, or start a single-node Ray when there is
    none; True when this call started Ray (the gateway then shuts it down when it stops).

    Run it on a thread that lasts as long as Ray (``daemon_thread.LastingThread``): each process Ray starts
    here dies with the thread that started it. Not on the main thread either, where ``ray.init`` would
    replace the server's SIGTERM handler with an exit.
    """
    configure_ray_environment()  # a no-op when the gateway did it before importing Ray
    if ray.is_initialized():
        return False
    if settings.address is None:  # "local": a new single-node Ray, never someone else's running one
        ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING)
        return True
    ray.init(address=settings.address, logging_level=logging.WARNING)
    return False


def deploy_engine(
    config: EngineConfig, home: Path, settings: RaySettings, owns_ray: bool, database_url: str | None = None
) -> EngineDeployment:
    """Create the directory and deploy the engine replicas on the Ray this process is connected to
    (``connect_ray``; ``owns_ray``: it started it); blocks until they serve.

    ``database_url`` is where the replicas fetch adapters from (``adapter_files``); the store folder second.
    """
    directory = EngineDirectory.options(
        name=DIRECTORY_NAME, namespace=DIRECTORY_NAMESPACE, get_if_exists=True, lifetime="detached"
    ).remote()
    _start_serve()
    gateway_id = uuid.uuid4().hex
    if not owns_ray and join_or_claim(ENGINE_APP, directory, gateway_id):  # another gateway deployed it: share it
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
        request_router_config=RequestRouterConfig(request_router_class=AdapterAffinityRouter),
        ray_actor_options={
            "num_cpus": cpus,
            "num_gpus": settings.replica_gpus,
            "runtime_env": {"env_vars": component_environment(REPLICA_ENVIRONMENT)},
        },
    )
    app = replica.bind(config, str(home / "adapters"), str(home / REPLICA_CACHE_FOLDER), database_url)
    logger.info("deploying the engine app %s: %d replica(s) of %s CPUs", ENGINE_APP, settings.num_replicas, cpus)
    try:
        handle = serve.run(app, name=ENGINE_APP, route_prefix=None)
    finally:
        directory.release_deployment.remote(gateway_id)
    logger.info("engine app deployed on Ray: %d replica(s)", settings.num_replicas)
    return EngineDeployment(handle, directory, owns_ray)


def _start_serve() -> None:
    """Start Serve on the cluster, or connect to it: to the one another gateway starts this very moment too.

    A controller this gateway starts gets ``CONTROLLER_ENVIRONMENT``; one already running keeps its own.
    """
    options = {"runtime_env": {"env_vars": component_environment(CONTROLLER_ENVIRONMENT)}}
    try:
        serve.start(proxy_location="Disabled", controller_options=options)
    except ActorAlreadyExistsError:  # another gateway created Serve's controller between our look and our create
        logger.info("Serve was started by another gateway at the same moment; connecting to it")
        serve.start(proxy_location="Disabled", controller_options=options)


def join_or_claim(app_name: str, directory: ActorHandle, gateway_id: str) -> bool:
    """True when ``app_name`` runs (join it); False when ``gateway_id`` claimed its deployment (deploy it,
    then release the claim).

    Waits while another gateway deploys it (Serve says DEPLOYING, or that gateway's claim is fresh), as long
    as a deployment of its own would take; an app that is absent, failed or unhealthy is claimed.
    """
    waiting = False
    while True:
        overview = serve.status().applications.get(app_name)
        status = None if overview is None else overview.status
        if status == ApplicationStatus.RUNNING:
            return True
        if status not in WAIT_STATUSES and ray.get(directory.claim_deployment.remote(gateway_id, DEPLOY_CLAIM_S)):
            return False
        if not waiting:
            logger.info("waiting for the engine app %s that another gateway deploys (%s)", app_name, status)
            waiting = True
        time.sleep(DEPLOY_POLL_S)


def shut_down(deployment: EngineDeployment) -> None:
    """Stop what this process started: all of Ray when it started it; nothing on a shared cluster.

    Its own Ray goes down with ``ray.shutdown()`` alone, which ends Serve's processes with it: this
    gateway's requests were ended already, and ``serve.shutdown()`` first took 30 s here (Serve's
    controller timed out draining a router that runs on the gateway's event loop).
    """
    if deployment.owns_ray:
        ray.shutdown()
