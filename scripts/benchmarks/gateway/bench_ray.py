"""What Ray Serve costs per request, and how well its multiplexing keeps each adapter on one replica.

Every measurement runs on a fresh ``loraplex serve`` (``load_server.py``: a scratch data folder under the
data folder, demo off, one tenant, its key and adapters made over the admin API), one server at a time:

1. **Overhead**: ``--num-sequential`` non-streamed ``/v1/completions`` requests of one output token on the
   base model, one after another, to the gateway over the local engine (``LORAPLEX_ENGINE=local``) and over
   ONE Ray replica on this machine (``LORAPLEX_ENGINE=ray``, the replica given every CPU). Latency p50/p99 of
   each and Ray's extra (``ray_overhead_p50_ms``, ``ray_overhead_p99_ms``).
2. **Throughput**: bench_vllm_cpu.py's HTTP workload (``bench_http_level.run_case``: 64 streams × 64 tokens, all at
   once) on the base model and with 8 adapters, on the same two servers: output tok/s and Ray ÷ local.
3. **Affinity**: TWO replicas (one CPU each), 32 adapters, ``--affinity-requests`` requests whose adapter
   is drawn from a power law (Zipf, s = 1.1), ``--affinity-concurrency`` at a time. A request is a hit when
   Serve sends it to a replica that already holds its adapter; every miss makes that replica register the
   adapter, so the replicas' registration counts (``loraplex_registered_adapters{worker}`` in /metrics; no
   adapter is unloaded: 32 is below each replica's capacity) give
   ``hit rate = 1 - (registrations - adapters used) / (requests - adapters used)``: the first request of an
   adapter, which no replica can hold yet, is left out.

The servers alternate per round (``--repeats``); medians are reported. The last line with ``--json``.

    python -m scripts.benchmarks.gateway.bench_ray --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from app.model_store import resolve_model
from app.settings import Settings
from engine.config import ModelConfig
from scripts.benchmarks.engine.bench_lora import write_synthetic_adapter
from scripts.benchmarks.peers.bench_http_level import Target, completion_tokens, on_fresh_server, run_case
from scripts.common.load_server import LocalServer
from scripts.common.percentiles import percentile
from scripts.common.raw_http import RawConnectionPool, encode_request

logger = logging.getLogger("bench_ray")

NUM_CPUS = 2
THROUGHPUT_REQUESTS = 64
THROUGHPUT_TOKENS = 64
THROUGHPUT_ADAPTERS = 8
AFFINITY_ADAPTERS = 32
ZIPF_S = 1.1
ADAPTER_RANK = 8
PROMPT = "The capital of France is"


def zipf_choices(num_items: int, num_draws: int, seed: int) -> list[int]:
    """``num_draws`` item indexes, item i drawn with weight 1 / (i + 1) ** ZIPF_S."""
    weights = [1.0 / (rank + 1) ** ZIPF_S for rank in range(num_items)]
    return random.Random(seed).choices(range(num_items), weights=weights, k=num_draws)


def _completion(target: Target, model: str, max_tokens: int, stream: bool) -> bytes:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {target.api_key}", "Content-Type": "application/json"}
    return encode_request("POST", "/v1/completions", headers, json.dumps(body).encode())


async def sequential_latencies_ms(target: Target, num_requests: int) -> list[float]:
    """Each request's round trip, one after another on one keep-alive connection."""
    raw = _completion(target, target.base_model, 1, stream=False)
    pool = RawConnectionPool(target.port)
    try:
        for _ in range(3):  # warm: the connection, the prefix cache
            await pool.request(raw)
        latencies = []
        for _ in range(num_requests):
            start = time.perf_counter()
            status, body = await pool.request(raw)
            latencies.append((time.perf_counter() - start) * 1000)
            if status != 200:
                raise RuntimeError(f"HTTP {status}: {body[:300]!r}")
    finally:
        await pool.close()
    return latencies


async def run_affinity(target: Target, draws: list[int], concurrency: int) -> None:
    """The drawn adapters' streamed requests, ``concurrency`` at a time; every one must finish."""
    raws = [_completion(target, target.adapters[i], 4, stream=True) for i in draws]
    queue = list(reversed(raws))
    pool = RawConnectionPool(target.port)

    async def worker() -> None:
        while queue:
            status, body = await pool.request(queue.pop())
            completion_tokens(status, body)

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await pool.close()


def registrations_by_worker(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        if family.name == "loraplex_registered_adapters":
            return {sample.labels["worker"]: sample.value for sample in family.samples}
    raise RuntimeError("/metrics has no loraplex_registered_adapters gauge")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2, help="rounds of the overhead and throughput servers")
    parser.add_argument("--num-sequential", type=int, default=200, help="sequential requests per overhead round")
    parser.add_argument("--affinity-requests", type=int, default=400)
    parser.add_argument("--affinity-concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args(argv)
    if min(args.repeats, args.num_sequential, args.affinity_requests, args.affinity_concurrency) < 1:
        parser.error("--repeats, --num-sequential, --affinity-requests and --affinity-concurrency must be at least 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)

    settings = Settings.from_env()
    folder = resolve_model(settings.model, settings.home)
    model_config = ModelConfig.from_folder(folder)
    scratch = settings.home / "bench" / "ray"
    adapters = {
        f"zipf{i}": write_synthetic_adapter(scratch / "adapters" / f"zipf{i}", model_config, ADAPTER_RANK, seed=i)
        for i in range(AFFINITY_ADAPTERS)
    }
    few = dict(list(adapters.items())[:THROUGHPUT_ADAPTERS])
    prompts = random.Random(args.seed).sample(range(1000, 20000), THROUGHPUT_REQUESTS)

    def overhead_and_throughput(target: Target, _server: LocalServer) -> dict:
        latencies = asyncio.run(sequential_latencies_ms(target, args.num_sequential))
        rates = {}
        for k in (0, THROUGHPUT_ADAPTERS):
            case_prompts = [[p + k, p + 1, p + 2, *range(100, 164)] for p in prompts]
            rates[k] = run_case(target, case_prompts, k, THROUGHPUT_TOKENS)
        return {"p50": percentile(latencies, 50), "p99": percentile(latencies, 99), "base": rates[0], "k8": rates[8]}

    servers = {
        "local": {"LORAPLEX_ENGINE": "local"},
        "ray": {"LORAPLEX_ENGINE": "ray", "LORAPLEX_RAY_REPLICAS": "1", "LORAPLEX_RAY_REPLICA_CPUS": str(NUM_CPUS)},
    }
    rounds: dict[str, list[dict]] = {name: [] for name in servers}
    for round_ in range(args.repeats):
        for name in servers if round_ % 2 == 0 else reversed(servers):
            figures = on_fresh_server(folder, servers[name], scratch, few, overhead_and_throughput)
            rounds[name].append(figures)
            logger.info("round %d/%d, %s: %s", round_ + 1, args.repeats, name, figures)

    draws = zipf_choices(AFFINITY_ADAPTERS, args.affinity_requests, args.seed)

    def affinity(target: Target, server: LocalServer) -> dict:
        asyncio.run(run_affinity(target, draws, args.affinity_concurrency))
        return registrations_by_worker(server.url)

    two_replicas = {"LORAPLEX_ENGINE": "ray", "LORAPLEX_RAY_REPLICAS": "2", "LORAPLEX_RAY_REPLICA_CPUS": "1"}
    registrations = on_fresh_server(folder, two_replicas, scratch, adapters, affinity)
    used = len(set(draws))
    misses = sum(registrations.values()) - used
    result = summarize(rounds) | {
        "affinity_requests": args.affinity_requests,
        "affinity_adapters_used": used,
        "affinity_registrations_by_worker": registrations,
        "affinity_hit_rate": round(1 - misses / (args.affinity_requests - used), 4),
    }
    logger.info("result: %s", result)
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    return 0


def summarize(rounds: dict[str, list[dict]]) -> dict:
    median = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in rounds.items()}
    result: dict = {}
    for name, figures in median.items():
        result |= {
            f"{name}_p50_ms": round(figures["p50"], 2),
            f"{name}_p99_ms": round(figures["p99"], 2),
            f"{name}_base_tok_s": round(figures["base"], 1),
            f"{name}_k8_tok_s": round(figures["k8"], 1),
        }
    result |= {
        "ray_overhead_p50_ms": round(median["ray"]["p50"] - median["local"]["p50"], 2),
        "ray_overhead_p99_ms": round(median["ray"]["p99"] - median["local"]["p99"], 2),
        "ray_vs_local_base": round(median["ray"]["base"] / median["local"]["base"], 3),
        "ray_vs_local_k8": round(median["ray"]["k8"] / median["local"]["k8"], 3),
        "rounds": rounds,
    }
    return result


if __name__ == "__main__":
    sys.exit(main())
