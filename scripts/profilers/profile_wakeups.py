"""Which processes wake, and how often the engine's compute threads are taken off their cores, idle and under load.

Starts a fresh ``loraplex serve`` (``load_server.py``, as bench_ray.py does) with ``--engine local`` or
``ray`` (one replica given every CPU), waits ``--settle-s``, counts every thread's CPU and context switches
on the machine for ``--idle-s`` (``thread_switches.py``), then again over ``--rounds`` rounds of
bench_vllm_cpu.py's HTTP workload (64 streams x 64 tokens on the base model, after one warm-up round).
Reports each process's wake-ups a second (voluntary + involuntary switches of all its threads) and the
busiest thread groups (CPU, switches, and the time their threads waited for a core), idle and under load,
and the output tok/s of each round.

On a machine whose every core runs the engine's threads, each wake-up of another process takes one of
them off its core (an involuntary switch of that thread): docs/ray-serve.md#what-a-request-pays-for-ray.

    python -m scripts.profilers.profile_wakeups --engine ray --json     # last line: one JSON object
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from dataclasses import asdict

from app.model_store import resolve_model
from app.settings import Settings
from scripts.benchmarks.peers.bench_http_level import Target, on_fresh_server, run_case
from scripts.common.load_server import LocalServer
from scripts.common.thread_switches import GroupRates, rates, snapshot

logger = logging.getLogger("profile_wakeups")

NUM_CPUS = 2
REQUESTS = 64
TOKENS = 64
TOP_GROUPS = 25
MIN_WAKEUPS_PER_S = 1.0
ENGINES = {
    "local": {"LORAPLEX_ENGINE": "local"},
    "ray": {"LORAPLEX_ENGINE": "ray", "LORAPLEX_RAY_REPLICAS": "1", "LORAPLEX_RAY_REPLICA_CPUS": str(NUM_CPUS)},
}


def by_process(groups: list[GroupRates]) -> dict[str, float]:
    """Wake-ups a second (voluntary + involuntary switches) of each process that woke at least once a second,
    its threads summed, most first."""
    totals: dict[str, float] = {}
    for group in groups:
        totals[group.process] = totals.get(group.process, 0.0) + group.voluntary_per_s + group.involuntary_per_s
    ranked = sorted(totals.items(), key=lambda item: -item[1])
    return {process: round(total, 1) for process, total in ranked if total >= MIN_WAKEUPS_PER_S}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=list(ENGINES), default="ray")
    parser.add_argument("--settle-s", type=float, default=15.0, help="wait after the server is ready")
    parser.add_argument("--idle-s", type=float, default=20.0, help="how long the idle count runs")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds of the workload")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args(argv)
    if args.idle_s <= 0 or args.rounds < 1 or args.settle_s < 0:
        parser.error("--idle-s must be positive, --rounds at least 1 and --settle-s not negative")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)

    settings = Settings.from_env()
    folder = resolve_model(settings.model, settings.home)
    scratch = settings.home / "bench" / "wakeups"
    prompts = random.Random(args.seed).sample(range(1000, 20000), REQUESTS)

    def measure(target: Target, _server: LocalServer) -> dict:
        time.sleep(args.settle_s)
        before = snapshot()
        time.sleep(args.idle_s)
        idle = rates(before, snapshot(), args.idle_s)
        run_case(target, [[p, p + 1, p + 2, *range(100, 164)] for p in prompts], 0, TOKENS)  # warm
        before, started = snapshot(), time.perf_counter()
        tok_s = [
            run_case(target, [[p + r, p + 1, p + 2, *range(100, 164)] for p in prompts], 0, TOKENS)
            for r in range(1, args.rounds + 1)
        ]
        load = rates(before, snapshot(), time.perf_counter() - started)
        return {
            "engine": args.engine,
            "tok_s": [round(rate, 1) for rate in tok_s],
            "idle_wakeups_per_s": by_process(idle),
            "load_wakeups_per_s": by_process(load),
            "idle_threads": [asdict(group) for group in idle[:TOP_GROUPS]],
            "load_threads": [asdict(group) for group in load[:TOP_GROUPS]],
        }

    result = on_fresh_server(folder, ENGINES[args.engine], scratch, {}, measure)
    for phase in ("idle", "load"):
        logger.info("%s, wake-ups a second by process: %s", phase, result[f"{phase}_wakeups_per_s"])
        for group in result[f"{phase}_threads"][:10]:
            logger.info("  %s", group)
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
