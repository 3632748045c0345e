"""The engine tier on a Ray cluster started apart, exercised end to end on this one machine.

1. A Ray head (``ray start --head``, 1 CPU, no dashboard) and a worker node (``ray start --address``, 1 CPU,
   a custom resource of its own): two alive nodes. Token authentication with a token made here (Ray turns
   it on for a head when ``~/.ray/auth_token`` exists, and then every node and driver needs it).
2. One PostgreSQL (the embedded server, migrated here) and two ``loraplex serve`` gateways, A and B, on it with
   ``LORAPLEX_ENGINE=ray``, ``LORAPLEX_RAY_ADDRESS`` set to the head and two replicas of one CPU each (one
   per node). A deploys the engine app; B joins it ("joining the running engine app" in its log). With
   ``--together`` both start at once and race to deploy: one deploys, the other joins. Serve's controller
   log must show one deployment and two replicas started, to the end.
3. A tenant, its key and ``--adapters`` synthetic adapters made through A's admin API; ``--requests``
   requests for them, alternately through A and B, must all succeed, and the replicas' adapter
   registrations give the affinity hit rate (as ``bench_ray.py`` computes it; no adapter is unloaded, so
   it cannot fall below 1 - adapters / requests: ``adapters_on_two_replicas``, 0 when every adapter stayed
   on one replica, is the sharper figure).
4. Streams of ``--stream-tokens`` tokens on B, one after another, while A is stopped (SIGTERM) and started
   again: the first runs when A gets its signal, the last through A's rejoining. Each must end with all
   its tokens, no error event and no gap over ``MAX_GAP_S``; A must exit cleanly; the replicas' process
   ids must be the same before and after; A, restarted, serves every adapter again.

Everything started here is stopped at the end, on failure too: the gateways, both Ray nodes (their own
processes only; ``ray stop`` would end every Ray on the machine), the PostgreSQL. Progress goes to stderr;
with ``--json`` the figures end stdout as one JSON object.

    python -m scripts.drills.ray_cluster_drill --json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from app.db.embedded import EmbeddedPostgres
from app.db.migrate import upgrade
from app.model_store import resolve_model
from app.settings import Settings
from engine.config import ModelConfig
from scripts import REPO_ROOT
from scripts.benchmarks.engine.bench_lora import write_synthetic_adapter
from scripts.benchmarks.gateway.bench_ray import registrations_by_worker
from scripts.common.sse_client import StreamResult, stream_request
from scripts.drills.drill_gateways import Gateways, parent_pid
from scripts.drills.ray_nodes import RayNode, kill_leftovers

logger = logging.getLogger("ray_cluster_drill")

ADAPTER_RANK = 8
PROMPT = "The capital of France is"
CONCURRENCY = 4
MIN_HIT_RATE = 0.9
MAX_GAP_S = 5.0
STREAM_HEAD_START_S = 1.0  # B's first stream runs this long before A is stopped
DEPLOYED = "Deploying new version of Deployment(name='EngineReplica'"
CLEAN_EXITS = (0, -signal.SIGTERM)  # uvicorn raises SIGTERM again once its graceful shutdown is complete


class DrillFailed(AssertionError):
    """A check of the drill failed."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise DrillFailed(message)


def completion_body(model: str, max_tokens: int, stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    return body


async def run_requests(urls: list[str], key: str, models: list[str]) -> dict[str, int]:
    """One 4-token completion per model, the i-th through ``urls[i % len(urls)]``; successes per gateway URL."""
    done = {url: 0 for url in urls}
    queue = list(enumerate(models))
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=120.0) as http:

        async def worker() -> None:
            while queue:
                index, model = queue.pop(0)
                url = urls[index % len(urls)]
                answer = await http.post(f"{url}/v1/completions", json=completion_body(model, 4), headers=headers)
                check(answer.status_code == 200, f"{model} through {url}: HTTP {answer.status_code} {answer.text}")
                done[url] += 1

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return done


def serve_figures(temp_dir: Path) -> dict[str, int]:
    """From Serve's own logs on these nodes: how often the engine app was deployed, how many replicas ever started."""
    logs = temp_dir / "session_latest" / "logs" / "serve"
    deployed = sum(log.read_text(errors="replace").count(DEPLOYED) for log in logs.glob("controller_*.log"))
    return {"engine_deployments": deployed, "replicas_started": len(list(logs.glob("replica_*.log")))}


def hit_rate(registrations: dict[str, float], num_requests: int, num_adapters: int) -> float:
    """bench_ray.py's figure: a request is a miss when it makes a replica register an adapter again."""
    misses = sum(registrations.values()) - num_adapters
    return round(1 - misses / (num_requests - num_adapters), 4)


async def streams_through_restart(gateways: Gateways, key: str, model: str, tokens: int) -> dict[str, Any]:
    """Streams on B one after another while A is stopped and started again; their figures and the restart's.

    B's first stream is running when A gets its SIGTERM, and B's streams go on until one has run through A's
    start as well (A's rejoining of the engine app), so both moments fall within a stream of B.
    """
    a_ready = asyncio.Event()
    results: list[StreamResult] = []
    body = completion_body(model, tokens, stream=True)

    async def stream_on_b(http: httpx.AsyncClient) -> None:
        while True:
            ready_before = a_ready.is_set()
            results.append(await stream_request(http, "/v1/completions", body, key))
            if ready_before or not results[-1].ok:
                return

    async with httpx.AsyncClient(base_url=gateways.b.url, timeout=600.0) as http:
        streams = asyncio.create_task(stream_on_b(http))
        await asyncio.sleep(STREAM_HEAD_START_S)
        check(not results, f"B's stream ended within {STREAM_HEAD_START_S} s: ask for more tokens")
        restart_start = time.perf_counter()
        exit_code = await asyncio.to_thread(gateways.a.terminate)
        stopped_s = time.perf_counter() - restart_start
        a_stopped_while_streaming = not results
        await asyncio.to_thread(gateways.start_a)
        ready_s = time.perf_counter() - restart_start
        a_ready.set()
        await streams
    gaps = [gap for result in results for gap in [result.ttft_s or 0.0, *result.itl_s]]
    return {
        "b_streams": len(results),
        "b_stream_tokens": [result.completion_tokens for result in results],
        "b_stream_errors": [result.error_kind for result in results if not result.ok],
        "b_streams_s": round(results[-1].ended_at - results[0].started_at, 2),
        "b_longest_gap_s": round(max(gaps), 3),
        "a_exit_code": exit_code,
        "a_stop_s": round(stopped_s, 2),
        "a_restart_ready_s": round(ready_s, 2),
        "a_stopped_while_streaming": a_stopped_while_streaming,
    }


def run_drill(args: argparse.Namespace, scratch: Path, stack: contextlib.ExitStack) -> dict[str, Any]:
    settings = Settings.from_env()
    folder = resolve_model(settings.model, settings.home)
    model_config = ModelConfig.from_folder(folder)
    adapters = {
        f"drill{i}": write_synthetic_adapter(scratch / "adapters" / f"drill{i}", model_config, ADAPTER_RANK, seed=i)
        for i in range(args.adapters)
    }
    # Ray turns token authentication on for a head when ~/.ray/auth_token exists; the drill chooses it itself.
    ray_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_USAGE_STATS_ENABLED": "0"}
    os.environ.update(ray_env)
    # The drill's teardown stops every node at once: nothing to drain work to (Ray waits 30 s per node).
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    node_env = ray_env | {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", "PYTHONPATH": python_path}
    temp_dir = scratch / "ray"

    postgres = EmbeddedPostgres(scratch / "pgdata")
    database_url = postgres.start()
    stack.callback(postgres.stop)
    applied = upgrade(database_url)  # as a deployment's migration job does: gateways started together would race
    logger.info("PostgreSQL: %s, migrations applied: %s", database_url, applied)

    stack.callback(kill_leftovers, temp_dir)
    head = RayNode(temp_dir, scratch / "ray-head.log", num_cpus=1, env=node_env)
    stack.callback(head.stop)
    head.start()
    worker = RayNode(temp_dir, scratch / "ray-worker.log", 1, head.address, {"drill_worker": 1}, node_env)
    stack.callback(worker.stop)
    worker.start()
    import ray  # after the environment above: Ray reads it at import

    ray.init(address=head.address, logging_level=logging.WARNING, log_to_driver=False)
    stack.callback(ray.shutdown)
    alive = [node for node in ray.nodes() if node["Alive"]]
    check(len(alive) == 2, f"expected two alive Ray nodes, got {len(alive)}")
    logger.info("Ray: head %s and a worker node, 2 alive nodes", head.address)

    gateways = Gateways(folder, scratch, head.address, database_url, ray_env, args.pool_mb)
    stack.callback(gateways.stop)
    if args.together:
        gateways.start_both()
        joined = gateways.a.log_count(gateways.JOINED) + gateways.b.log_count(gateways.JOINED)
        check(joined == 1, f"{joined} of the two gateways started together joined the engine app, not one")
    else:
        gateways.start_a()
        gateways.start_b()
        check(gateways.b.log_count(gateways.JOINED) == 1, "gateway B did not join the running engine app")
    before = gateways.wait_for_replicas(2)
    check(len({parent_pid(pid) for pid in before.values()}) == 2, f"both replicas on one node: {before}")
    serve = serve_figures(temp_dir)
    check(serve == {"engine_deployments": 1, "replicas_started": 2}, f"the gateways' starts deployed again: {serve}")
    logger.info("gateways A (%s) and B (%s) on replicas %s", gateways.a.url, gateways.b.url, before)

    key = gateways.make_tenant(adapters)
    gateways.wait_until_served(gateways.b.url, key, list(adapters))
    names = [list(adapters)[i % len(adapters)] for i in range(args.requests)]
    served = asyncio.run(run_requests([gateways.a.url, gateways.b.url], key, names))
    registrations = registrations_by_worker(gateways.b.url)
    # B's probes above were each adapter's first request: they count, as the misses no replica could avoid
    rate = hit_rate(registrations, args.requests + len(adapters), len(adapters))
    logger.info("affinity: %s requests served by gateway, registrations %s, hit rate %s", served, registrations, rate)
    check(rate >= MIN_HIT_RATE, f"affinity hit rate {rate} < {MIN_HIT_RATE}")

    figures = asyncio.run(streams_through_restart(gateways, key, next(iter(adapters)), args.stream_tokens))
    logger.info("B's streams through A's restart: %s", figures)
    after = gateways.wait_for_replicas(2)
    check(not figures["b_stream_errors"], f"B's streams failed: {figures['b_stream_errors']}")
    check(
        all(tokens == args.stream_tokens for tokens in figures["b_stream_tokens"]),
        f"B's streams ended early: {figures['b_stream_tokens']} tokens",
    )
    check(figures["b_longest_gap_s"] <= MAX_GAP_S, f"B's stream stalled {figures['b_longest_gap_s']} s")
    check(figures["a_stopped_while_streaming"], "B's first stream ended before A stopped")
    check(figures["a_exit_code"] in CLEAN_EXITS, f"gateway A exited with {figures['a_exit_code']}")
    check(gateways.a.log_count(gateways.STOPPED) == 1, "gateway A did not stop gracefully")
    check(after == before, f"the replicas changed across A's restart: {before} -> {after}")
    check(gateways.a.log_count(gateways.JOINED) == 1, "gateway A, restarted, did not join the running engine app")
    gateways.wait_until_served(gateways.a.url, key, list(adapters))
    serve = serve_figures(temp_dir)
    check(serve == {"engine_deployments": 1, "replicas_started": 2}, f"the engine app was deployed again: {serve}")
    return {
        "gateways_started_together": args.together,
        "ok": True,
        "alive_nodes": len(alive),
        "requests": args.requests,
        "adapters": len(adapters),
        "served_by_gateway": {"A": served[gateways.a.url], "B": served[gateways.b.url]},
        "registrations_by_worker": registrations,
        "affinity_hit_rate": rate,
        "adapters_on_two_replicas": int(sum(registrations.values())) - len(adapters),
        **figures,
        "replica_pids_before": before,
        "replica_pids_after": after,
        **serve,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100, help="4-token requests split between the gateways")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--stream-tokens", type=int, default=400, help="tokens of each of B's streams")
    parser.add_argument("--pool-mb", type=int, default=512, help="each replica's page pool")
    parser.add_argument("--together", action="store_true", help="start A and B at once (both race to deploy)")
    parser.add_argument("--json", action="store_true", help="end with one JSON object")
    args = parser.parse_args(argv)
    if args.adapters < 1 or args.requests <= args.adapters or args.stream_tokens < 1:
        parser.error("--adapters and --stream-tokens must be at least 1, --requests more than --adapters")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("httpx", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    scratch = Path(tempfile.mkdtemp(prefix="raydrill-"))  # short: Ray's socket paths live under it
    scratch.chmod(0o755)  # as root, the embedded PostgreSQL runs as its own user and must reach it
    result: dict[str, Any]
    started = time.perf_counter()
    try:
        with contextlib.ExitStack() as stack:
            result = run_drill(args, scratch, stack)
    except (DrillFailed, RuntimeError, httpx.HTTPError) as error:
        logger.error("the drill failed: %s", error)
        for log in [*sorted(scratch.glob("*.log")), *sorted(scratch.glob("*/server.log"))]:
            logger.error("%s ends:\n%s", log.relative_to(scratch), log.read_text(errors="replace")[-3000:])
        result = {"ok": False, "error": str(error)[:2000]}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result["wall_s"] = round(time.perf_counter() - started, 1)  # everything, the start-up and the teardown too
    logger.info("result: %s", result)
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
