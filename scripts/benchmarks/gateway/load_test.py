"""Load: many concurrent streaming clients across several tenants and adapters, on the real server.

By default the script starts the real server (``python -m app.cli.main serve``, see ``load_server.py``) on the
default model with an embedded PostgreSQL in a temporary data folder, builds ``--tenants`` x
``--adapters-per-tenant`` distinct PEFT LoRA adapters and creates, over the admin REST API, that many
tenants without limits, each with an inference key and its own adapters (``load_tenants.py``). With
``--url`` it drives a server that is already running instead, creating (and at the end deleting) its
tenants with ``--admin-key``; ``--server-pid`` then names the process whose memory is watched.

Each of ``--clients`` clients loops: pick a tenant, then one of its models (the base model or one of its
adapters), send a streaming chat completion (one in four: a raw completion) with a short prompt and
``--max-tokens``, and read the SSE stream to ``data: [DONE]`` (``sse_client.py`` says what counts as an
error). First every (tenant, model) pair is called once, all together (``warmup_requests``: each adapter
is loaded, every path taken); then the clients run for ``--duration`` seconds. A client starts no request
after that; the requests in flight then are read to their end (``drain_s``) and count. ``requests`` and
``errors`` are every request the clients sent; one still unread ``DRAIN_TIMEOUT_S`` after the end is an
error (``unfinished``).

- ``ttft_*``: from sending a request to the first event carrying text; with most clients queued behind
  the engine's running batch, this is mostly time spent waiting for a slot.
- ``itl_*``: gaps between successive events carrying text (one decode step of the running batch).
- ``rss_*``: the server process's resident memory (VmRSS; its PostgreSQL is not counted): ``rss_start_mb``
  once the load has run for ``--rss-baseline-after`` seconds (the running batch is full by then, so
  buffers sized by it exist), ``rss_end_mb`` once the last request is read, ``rss_max_mb`` over that span
  (sampled every second), ``rss_trace_mb`` every ``--trace-interval`` seconds of it; ``rss_growth_mb`` =
  end - start.

The machine's other work shares its cores with the server and this client: ``load_average_before`` and
the CPU seconds of both sides say how busy it was.

    python -m scripts.benchmarks.gateway.load_test --json  # 200 clients for 60 s; last line: one JSON object
    python -m scripts.benchmarks.gateway.load_test --clients 4 --duration 3 --rss-baseline-after 1 --max-tokens 4 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import secrets
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

from app.cli.admin_client import AdminClient
from app.model_store import resolve_model
from app.settings import Settings
from scripts.benchmarks.gateway.load_stats import MemoryWatch, Tally, summarize
from scripts.benchmarks.gateway.load_tenants import LoadTenant, build_adapters, create_tenants, delete_tenants
from scripts.common.load_server import LocalServer
from scripts.common.sse_client import StreamResult, stream_request

logger = logging.getLogger("load_test")

PROMPTS = (
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "Name three colours.",
    "Why do cats purr?",
    "Give me a short tip for sleeping well.",
    "What is two plus three?",
)
COMPLETION_SHARE = 0.25  # of requests sent to /v1/completions; the rest go to /v1/chat/completions
CONNECT_TIMEOUT_S = 30.0
READ_TIMEOUT_S = 300.0  # headers come with the first token, after the request has waited for a running slot
DRAIN_TIMEOUT_S = 300.0  # requests still unread this long after the end count as errors (`unfinished`)
RSS_SAMPLE_S = 1.0


async def client(
    http: httpx.AsyncClient, tenants: list[LoadTenant], seed: int, max_tokens: int, end: float, tally: Tally
) -> None:
    rng = random.Random(seed)
    while time.perf_counter() < end:
        tenant = rng.choice(tenants)
        path, body = request_for(tenant, rng, max_tokens)
        tally.num_in_flight += 1
        try:
            result = await stream_request(http, path, body, tenant.api_key)
        finally:
            tally.num_in_flight -= 1
        tally.add(result, path)


def request_for(tenant: LoadTenant, rng: random.Random, max_tokens: int) -> tuple[str, dict[str, object]]:
    """A random model of ``tenant`` and a random prompt, as a chat or (sometimes) a raw completion."""
    model, prompt = rng.choice(tenant.models), rng.choice(PROMPTS)
    common = {"model": model, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    if rng.random() < COMPLETION_SHARE:
        return "/v1/completions", {**common, "prompt": prompt}
    return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}]}


async def first_calls(http: httpx.AsyncClient, tenants: list[LoadTenant], max_tokens: int) -> list[StreamResult]:
    """Every (tenant, model) once, together: each adapter is loaded and every path taken before the clock starts."""
    calls = []
    for tenant in tenants:
        for model in tenant.models:
            body = {
                "model": model,
                "max_tokens": max_tokens,
                "stream": True,
                "messages": [{"role": "user", "content": PROMPTS[0]}],
            }
            calls.append(stream_request(http, "/v1/chat/completions", body, tenant.api_key))
    return list(await asyncio.gather(*calls))


async def monitor(tally: Tally, memory: MemoryWatch, end: float, progress_s: float, trace_s: float) -> None:
    """Sample the server's RSS every second; log progress every ``progress_s`` and trace RSS every ``trace_s``."""
    next_progress, next_trace = tally.started + progress_s, memory.baseline_at
    while True:
        await asyncio.sleep(RSS_SAMPLE_S)
        now = time.perf_counter()
        rss = memory.sample(now)
        if rss is not None and now >= next_trace:
            memory.trace_mb.append(round(rss, 1))
            next_trace += trace_s
        if now >= next_progress:
            logger.info(
                "%5.0f s %-5s requests %d, in flight %d, errors %d, rss %s MiB",
                now - tally.started,
                "load" if now < end else "drain",
                len(tally.results),
                tally.num_in_flight,
                tally.num_errors(),
                "?" if rss is None else f"{rss:.0f}",
            )
            next_progress += progress_s


async def drive(url: str, tenants: list[LoadTenant], args: argparse.Namespace, pid: int | None) -> dict[str, object]:
    limits = httpx.Limits(max_connections=args.clients + 1, max_keepalive_connections=args.clients + 1)
    timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S, pool=None)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as http:
        warmup = await first_calls(http, tenants, args.max_tokens)
        tally = Tally(started=time.perf_counter())
        memory = MemoryWatch(pid=pid, baseline_at=tally.started + args.rss_baseline_after)
        end = tally.started + args.duration
        logger.info(
            "%d clients for %.0f s (RSS baseline at %.0f s)", args.clients, args.duration, args.rss_baseline_after
        )
        watcher = asyncio.create_task(monitor(tally, memory, end, args.progress_interval, args.trace_interval))
        tasks = [
            asyncio.create_task(client(http, tenants, seed, args.max_tokens, end, tally))
            for seed in range(args.clients)
        ]
        await asyncio.sleep(max(0.0, end - time.perf_counter()))
        _, pending = await asyncio.wait(tasks, timeout=DRAIN_TIMEOUT_S)
        tally.drained_at = time.perf_counter()
        for task in [*pending, watcher]:
            task.cancel()
        await asyncio.gather(*pending, watcher, return_exceptions=True)
        memory.finish()
    return summarize(warmup, tally, memory, len(pending), end)


def default_model_folder() -> Path:
    """The configured model (the default one unless LORAPLEX_MODEL says otherwise), pulled on first use."""
    settings = Settings.from_env()
    return resolve_model(settings.model, settings.home)


def run(args: argparse.Namespace) -> dict[str, object]:
    """Set up the server and tenants (``--url``: only the tenants), drive the load, tear down; the summary."""
    model = args.model or default_model_folder()
    server = None if args.url else LocalServer(model, extra_env=server_env(args))
    url = args.url or server.url
    admin_key = args.admin_key or (server.admin_key if server else None)
    pid = args.server_pid
    tenants: list[LoadTenant] = []
    exit_code = None
    with tempfile.TemporaryDirectory(prefix="loraplex-load-adapters-") as scratch:
        try:
            if server is not None:
                server.start()  # it starts its database and loads the model while the adapters are built here
            logger.info("building %d adapters for %s", args.tenants * args.adapters_per_tenant, model.name)
            adapters = build_adapters(model, Path(scratch), args.tenants * args.adapters_per_tenant)
            if server is not None:
                server.wait_ready()
                pid = server.pid
                logger.info("server on %s (pid %d), data folder %s", url, pid, server.home)
            admin = AdminClient(url, admin_key)
            try:
                tenants = create_tenants(admin, adapters, args.tenants, args.adapters_per_tenant, secrets.token_hex(3))
            finally:
                admin.close()
            result = run_config(args) | asyncio.run(drive(url, tenants, args, pid))
        finally:
            if server is not None:
                exit_code = server.stop()
            elif tenants:
                delete_tenants(url, admin_key, tenants)
    result["server_exit_code"] = exit_code
    return result


def run_config(args: argparse.Namespace) -> dict[str, object]:
    names = ("clients", "duration", "tenants", "adapters_per_tenant", "max_tokens", "rss_baseline_after")
    return {name: getattr(args, name) for name in names}


def server_env(args: argparse.Namespace) -> dict[str, str]:
    env = {}
    if args.max_num_seqs is not None:
        env["LORAPLEX_MAX_NUM_SEQS"] = str(args.max_num_seqs)
    if args.pool_mb is not None:
        env["LORAPLEX_POOL_MB"] = str(args.pool_mb)
    return env


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=200, help="concurrent streaming clients")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds during which clients send requests")
    parser.add_argument(
        "--rss-baseline-after",
        type=float,
        default=10.0,
        help="seconds of load before the server's RSS baseline (rss_start_mb) is taken",
    )
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--adapters-per-tenant", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32, help="max_tokens of every request")
    parser.add_argument("--url", help="drive this running server instead of starting one (needs --admin-key)")
    parser.add_argument("--admin-key", default=os.environ.get("LORAPLEX_ADMIN_KEY"), help="with --url")
    parser.add_argument("--server-pid", type=int, help="with --url: the server process whose RSS is watched")
    parser.add_argument("--model", type=Path, help="base model folder (default: the data folder's default model)")
    parser.add_argument("--max-num-seqs", type=int, help="the started server's LORAPLEX_MAX_NUM_SEQS")
    parser.add_argument("--pool-mb", type=int, help="the started server's LORAPLEX_POOL_MB")
    parser.add_argument("--progress-interval", type=float, default=5.0, help="seconds between progress lines")
    parser.add_argument("--trace-interval", type=float, default=5.0, help="seconds between rss_trace_mb samples")
    parser.add_argument("--json", action="store_true", help="end stdout with one JSON line")
    args = parser.parse_args(argv)
    for name in ("clients", "tenants", "max_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.adapters_per_tenant < 0 or args.duration <= 0:
        parser.error("--adapters-per-tenant must be at least 0, --duration more than 0")
    if not 0 <= args.rss_baseline_after < args.duration:
        parser.error("--rss-baseline-after must be at least 0 and less than --duration")
    if args.url and not args.admin_key:
        parser.error("--url needs --admin-key (or LORAPLEX_ADMIN_KEY)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    load_before = os.getloadavg()[0]  # other work on this machine shares its cores with the server and clients
    result = run(args)
    result["load_average_before"] = round(load_before, 2)
    # uvicorn re-raises SIGTERM once it has shut down, so a clean stop reads -SIGTERM (or 0); None: not ours
    result["server_stopped_cleanly"] = result["server_exit_code"] in (None, 0, -signal.SIGTERM)
    result["meets_target"] = result["errors"] == 0 and result["warmup_errors"] == 0 and result["server_stopped_cleanly"]
    table = "".join(f"{key:>22}: {value}\n" for key, value in result.items())
    (sys.stderr if args.json else sys.stdout).write(table)
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    return 0 if result["meets_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
