"""A gateway that joins a Ray cluster where the engine app runs, is being deployed, or is claimed by another.

On the session's real Ray (``ray_engine`` in conftest.py): a Serve app whose replica takes a few seconds to
start stands for an engine app another gateway is deploying; the directory actor is the real one.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import ray
from ray import serve

from app.cluster.deployment import join_or_claim
from app.cluster.directory import DIRECTORY_NAME, DIRECTORY_NAMESPACE

pytestmark = [pytest.mark.default_model]

START_S = 3.0  # the slow app's replica start
SHORT_CLAIM_S = 1.0
APPEAR_WAIT_S = 30.0


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class SlowStart:
    def __init__(self, start_s: float) -> None:
        time.sleep(start_s)
        self.pid = os.getpid()

    def __call__(self) -> int:
        return self.pid


def _directory() -> ray.actor.ActorHandle:
    return ray.get_actor(DIRECTORY_NAME, namespace=DIRECTORY_NAMESPACE)


def _wait_until_listed(app_name: str) -> None:
    deadline = time.monotonic() + APPEAR_WAIT_S
    while app_name not in serve.status().applications:
        assert time.monotonic() < deadline, f"{app_name} never showed in Serve's status"
        time.sleep(0.05)


def test_a_deployment_claim_holds_off_other_gateways_until_it_lapses(ray_engine) -> None:
    directory = _directory()
    assert ray.get(directory.claim_deployment.remote("gateway-a", SHORT_CLAIM_S))
    assert not ray.get(directory.claim_deployment.remote("gateway-b", SHORT_CLAIM_S))
    assert ray.get(directory.claim_deployment.remote("gateway-a", SHORT_CLAIM_S)), "the claimant renews its claim"
    time.sleep(SHORT_CLAIM_S + 0.2)
    assert ray.get(directory.claim_deployment.remote("gateway-b", SHORT_CLAIM_S)), "a lapsed claim holds no one"
    ray.get(directory.release_deployment.remote("gateway-b"))
    assert ray.get(directory.claim_deployment.remote("gateway-c", SHORT_CLAIM_S)), "a released claim holds no one"
    ray.get(directory.release_deployment.remote("gateway-c"))


def test_a_gateway_starting_while_the_app_deploys_waits_and_joins_the_same_replica(ray_engine) -> None:
    app_name = "loraplex-test-slow-start"
    deployer = threading.Thread(target=serve.run, args=(SlowStart.bind(START_S),), kwargs={"name": app_name})
    deployer.start()
    try:
        _wait_until_listed(app_name)
        started = time.monotonic()
        joined = join_or_claim(app_name, _directory(), "gateway-joining")
        assert joined, "the gateway claimed an app another one was deploying"
        assert time.monotonic() - started > 0.5, "the gateway did not wait for the deployment"
        deployer.join()
        first = serve.get_app_handle(app_name).remote().result()
        assert join_or_claim(app_name, _directory(), "gateway-restarted")
        assert serve.get_app_handle(app_name).remote().result() == first
    finally:
        deployer.join()
        serve.delete(app_name)


def test_a_gateway_waits_for_another_gateways_fresh_claim_then_claims_an_absent_app(ray_engine) -> None:
    directory = _directory()
    assert ray.get(directory.claim_deployment.remote("another-gateway", SHORT_CLAIM_S))
    started = time.monotonic()
    try:
        assert not join_or_claim("loraplex-test-absent", directory, "gateway-waiting")
        assert time.monotonic() - started >= SHORT_CLAIM_S * 0.9
    finally:
        ray.get(directory.release_deployment.remote("gateway-waiting"))
