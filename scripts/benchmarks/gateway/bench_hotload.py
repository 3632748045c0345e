"""Hot-loading: from an adapter upload's response to the first token of a request that uses it.

The real app (``create_app``) runs under uvicorn in a child process (this script with ``--serve``) on
127.0.0.1, on the real default model and an embedded PostgreSQL in a temporary data folder, demo off.
At startup the child creates, directly in the database, a tenant with an inference key and an ``ops``
tenant with an admin key, and writes the port and keys to a file the parent reads.

The parent builds one PEFT LoRA adapter for the default model, rank 16 on every linear layer (q, k, v,
o, gate, up, down projections) with random non-zero B, and then, ``--runs`` times under a new name each
time: uploads it through ``POST /admin/tenants/{id}/adapters`` (``upload_ms``: request sent to response
received), and at once sends a streaming chat request with ``model`` set to that name, timing from the
upload's response to the first content token (``upload_to_first_token_ms``). That span holds what a user
waits for after an upload: the name's resolution, the adapter's first copy into the engine's page pool and
the prompt's prefill. For scale, ``base_first_token_ms`` is the same request's time to first token on the
base model (prefill alone), measured after one warm-up request that is not counted.

    python -m scripts.benchmarks.gateway.bench_hotload --json        # last line: one JSON object
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from scripts import REPO_ROOT
from scripts.benchmarks.gateway.bench_gateway import (  # the child's start file and stop, shared
    INFO_FILE,
    stop_server,
    wait_for_info,
)

logger = logging.getLogger("bench_hotload")

TARGET_MS = 1000.0  # the bar: an uploaded adapter answers within a second
RANK = 16
LORA_ALPHA = 32
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
B_STD = 0.02  # PEFT starts B at zero, which would make the adapter a no-op; a small random B is a real delta
MAX_TOKENS = 4  # only the first token is timed; a few more show the stream goes on
NUM_BASE_SAMPLES = 3
PROMPT = "Write one sentence about the sea."
REQUEST_TIMEOUT_S = 60.0


# --- the server (child process) ---------------------------------------------------------------------------


def serve(home: Path, model: Path, log_level: str) -> None:
    """Run the app until SIGTERM/SIGINT; write INFO_FILE once it takes requests."""
    import uvicorn
    from litestar import Litestar

    from app.db.tables import Tenant
    from app.factory import create_app
    from app.keys.service import Scope, create_api_key
    from app.settings import Settings

    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    settings = Settings(home=home, model=str(model), demo=False)
    app = create_app(settings)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # a free port, chosen here so that no other process can take it first

    async def announce(app: Litestar) -> None:
        gateway = app.state.gateway
        keys = {}
        async with gateway.database.sessions() as session, session.begin():
            for tenant_name, scope in (("bench", Scope.INFERENCE), ("ops", Scope.ADMIN)):
                tenant = Tenant(name=tenant_name)
                session.add(tenant)
                await session.flush()
                _, keys[scope] = await create_api_key(
                    session,
                    tenant_id=tenant.id,
                    name=f"{tenant_name}-key",
                    scopes=[scope],
                    key_secret=gateway.key_secret,
                )
                if scope == Scope.INFERENCE:
                    tenant_id = str(tenant.id)
        info = {
            "port": sock.getsockname()[1],
            "tenant_id": tenant_id,
            "inference_key": keys[Scope.INFERENCE],
            "admin_key": keys[Scope.ADMIN],
            "model": gateway.engine.model_name,
        }
        partial = home / f"{INFO_FILE}.partial"
        partial.write_text(json.dumps(info))
        partial.rename(home / INFO_FILE)  # the parent never sees half a file

    app.on_startup.append(announce)
    config = uvicorn.Config(app, log_config=None, lifespan="on", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])


# --- the adapter --------------------------------------------------------------------------------------------


def default_model_folder() -> Path:
    """The converted default model in the user's data folder (pulled and converted on first use)."""
    from app.model_store import resolve_model
    from app.settings import Settings

    return resolve_model("default", Settings.from_env().home)


def build_adapter(model: Path, out: Path, seed: int) -> Path:
    """A PEFT LoRA of rank RANK on every linear projection of ``model``, with random non-zero B."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=LORA_ALPHA, target_modules=TARGET_MODULES))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, B_STD)
    peft_model.save_pretrained(out)
    return out


# --- the measurements (parent process) ----------------------------------------------------------------------


def upload(http: httpx.Client, info: dict[str, str], name: str, adapter: Path) -> float:
    """Upload ``adapter`` as ``name``; seconds from sending the request to reading its response."""
    files = [
        (part, (part, (adapter / part).read_bytes(), "application/octet-stream"))
        for part in ("adapter_config.json", "adapter_model.safetensors")
    ]
    started = time.perf_counter()
    response = http.post(
        f"/admin/tenants/{info['tenant_id']}/adapters",
        data={"name": name},
        files=files,
        headers={"Authorization": f"Bearer {info['admin_key']}"},
    )
    elapsed = time.perf_counter() - started
    if response.status_code != 201:
        raise RuntimeError(f"upload of {name} answered {response.status_code}: {response.text}")
    return elapsed


def first_token_s(http: httpx.Client, info: dict[str, str], model: str, since: float) -> float:
    """Stream a chat with ``model``; seconds from ``since`` (a perf_counter time) to the first content token."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {info['inference_key']}"}
    first = None
    with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"chat with {model} answered {response.status_code}: {response.read().decode()}")
        for line in response.iter_lines():
            if first is None and line.startswith("data: {"):
                chunk = json.loads(line.removeprefix("data: "))
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    first = time.perf_counter() - since
    if first is None:
        raise RuntimeError(f"the stream with {model} held no token")
    return first


def measure(info: dict[str, str], adapter: Path, runs: int) -> dict[str, object]:
    with httpx.Client(base_url=f"http://127.0.0.1:{info['port']}", timeout=REQUEST_TIMEOUT_S) as http:
        first_token_s(http, info, info["model"], time.perf_counter())  # warm-up: the engine's first request
        base = [first_token_s(http, info, info["model"], time.perf_counter()) for _ in range(NUM_BASE_SAMPLES)]
        uploads, spans = [], []
        for run in range(runs):
            name = f"bench-r{RANK}-{run}"
            uploads.append(upload(http, info, name, adapter))
            uploaded_at = time.perf_counter()
            spans.append(first_token_s(http, info, name, uploaded_at))
            logger.info(
                "run %d: upload %.0f ms, upload to first token %.0f ms", run, uploads[-1] * 1e3, spans[-1] * 1e3
            )
    median_ms = statistics.median(spans) * 1e3
    return {
        "upload_to_first_token_ms": round(median_ms, 1),
        "runs_ms": [round(s * 1e3, 1) for s in spans],
        "upload_ms": round(statistics.median(uploads) * 1e3, 1),
        "upload_runs_ms": [round(s * 1e3, 1) for s in uploads],
        "base_first_token_ms": round(statistics.median(base) * 1e3, 1),
        "adapter_rank": RANK,
        "adapter_modules": TARGET_MODULES,
        "adapter_bytes": sum(f.stat().st_size for f in adapter.iterdir() if f.is_file()),
        "target_ms": TARGET_MS,
        "meets_target": median_ms <= TARGET_MS,
    }


# --- the child's lifetime -----------------------------------------------------------------------------------


def start_server(home: Path, model: Path, log_level: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", __spec__.name, "--serve", str(home), "--model", str(model)]
    command += ["--server-log-level", log_level]
    log = (home / "server.log").open("wb")
    return subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="uploads measured, each under a new name")
    parser.add_argument("--json", action="store_true", help="end stdout with one JSON line")
    parser.add_argument("--server-log-level", default="WARNING", help="the server's log level")
    parser.add_argument("--serve", type=Path, metavar="HOME", help=argparse.SUPPRESS)  # the child's entry
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")

    if args.serve is not None:
        serve(args.serve, args.model, args.server_log_level)
        return 0

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    load_before = os.getloadavg()[0]  # other work on this machine shares its cores with the benchmark
    model = default_model_folder()
    home = Path(tempfile.mkdtemp(prefix="loraplex-hotload-"))
    os.chmod(home, 0o755)  # as root, the embedded PostgreSQL runs as its own user and must reach its folder
    try:
        logger.info("building a rank-%d adapter on %s", RANK, ", ".join(TARGET_MODULES))
        adapter = build_adapter(model, home / "adapter", seed=0)
        server = start_server(home, model, args.server_log_level)
        try:
            info = wait_for_info(home, server)
            logger.info("server on port %s with %s", info["port"], info["model"])
            result = measure(info, adapter, args.runs)
        finally:
            stop_server(home, server)
    finally:
        shutil.rmtree(home, ignore_errors=True)

    result["load_average_before"] = round(load_before, 2)
    table = "".join(f"{key:>26}: {value}\n" for key, value in result.items())
    (sys.stderr if args.json else sys.stdout).write(table)
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
