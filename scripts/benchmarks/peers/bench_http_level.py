"""The HTTP level of bench_vllm_cpu.py: its workload as concurrent streams to vLLM's server and loraplex serve.

Each request is one streamed ``/v1/completions`` request: token ids as the ``prompt``, ``max_tokens``,
temperature 0, ``ignore_eos`` (both servers take it), usage in the last event; a case's requests are all
sent at once, each on its own keep-alive connection, and read to their end with ``raw_http.py`` (httpx's
own CPU per request would be taken from the servers on two cores). Output tokens (from the usage events)
per second, from the first request sent to the last stream read. Before a case is timed, one short
request per model it uses has run (so no adapter is loaded from disk while timed, on either server), and
each case sends prompts of its own, so no case finds another's prompts in a prefix cache.

A server runs every case of one round: vLLM's server with LoRA off (its compiled default) for the base
model, vLLM's server with LoRA on (eager, ``--max-loras`` the largest k) for the adapter cases and, for
reference, the base model; ``loraplex serve`` (its data folder a scratch one under the data folder, demo
off, one tenant, key and its adapters made over the admin API) for all of them, once per engine setting
asked for (``LORAPLEX_ENGINE``: ``process``, ``thread``). Servers bind 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from app.cli.admin_client import AdminClient
from scripts.benchmarks.peers.vllm_cpu_server import VllmServer
from scripts.common.load_server import LocalServer
from scripts.common.raw_http import RawConnectionPool, encode_request

logger = logging.getLogger("bench_http_level")

T = TypeVar("T")

WARM_TOKENS = 4
PATH = "/v1/completions"


@dataclass(frozen=True, slots=True)
class Target:
    """A running server as the streams see it: its port, a key, and the model name of each adapter count."""

    port: int
    api_key: str
    base_model: str
    adapters: tuple[str, ...]

    def models(self, num_adapters: int, num_requests: int) -> list[str]:
        """Request i's model: adapter i mod k, or the base model for k = 0."""
        if num_adapters == 0:
            return [self.base_model] * num_requests
        return [self.adapters[i % num_adapters] for i in range(num_requests)]


class StreamError(RuntimeError):
    """A stream answered with an error status, an error event, or no usage."""


def _request(target: Target, model: str, prompt: list[int], max_tokens: int) -> bytes:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {target.api_key}", "Content-Type": "application/json"}
    return encode_request("POST", PATH, headers, json.dumps(body).encode())


def completion_tokens(status: int, body: bytes) -> int:
    """The output tokens a streamed answer reports in its usage event."""
    if status != 200:
        raise StreamError(f"HTTP {status}: {body[:300]!r}")
    tokens = None
    for line in body.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[len(b"data: ") :])
        if "error" in event:
            raise StreamError(f"error event: {event['error']}")
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    if tokens is None:
        raise StreamError("the stream carried no usage event")
    return tokens


async def _stream_all(target: Target, raws: list[bytes]) -> tuple[int, float]:
    pool = RawConnectionPool(target.port)
    try:
        loop = asyncio.get_running_loop()
        start = loop.time()
        answers = await asyncio.gather(*(pool.request(raw) for raw in raws))
        elapsed = loop.time() - start
    finally:
        await pool.close()
    return sum(completion_tokens(status, body) for status, body in answers), elapsed


def run_case(target: Target, prompts: list[list[int]], num_adapters: int, max_tokens: int) -> float:
    """Output tok/s of the case's streams, all sent at once, after a warm-up of each model they use."""
    models = target.models(num_adapters, len(prompts))
    warm = [_request(target, model, prompts[0][:8], WARM_TOKENS) for model in dict.fromkeys(models)]
    asyncio.run(_stream_all(target, warm))
    raws = [_request(target, model, prompt, max_tokens) for model, prompt in zip(models, prompts, strict=True)]
    num_tokens, elapsed = asyncio.run(_stream_all(target, raws))
    expected = max_tokens * len(prompts)
    if num_tokens != expected:
        raise StreamError(f"{num_tokens} output tokens, expected {expected}")
    return num_tokens / elapsed


CaseRunner = Callable[[Target], dict[str, float]]


def on_vllm(
    python: Path,
    env: dict[str, str],
    model: Path,
    log_dir: Path,
    adapters: dict[str, Path] | None,
    run: CaseRunner,
    dtype: str = "float32",
) -> dict[str, float]:
    """``run``'s rates on a fresh vLLM server in ``dtype`` (LoRA on when ``adapters`` are given)."""
    server = VllmServer(
        python, env, model, model.name, log_dir / f"vllm-server-lora{len(adapters or {})}.log", adapters, dtype=dtype
    )
    logger.info("starting vLLM's server (%s)", f"LoRA on, {len(adapters)} adapters" if adapters else "LoRA off")
    server.start()
    try:
        return run(Target(server.port, "unused", model.name, tuple(adapters or ())))
    finally:
        server.stop()


def on_loraplex(
    model: Path, engine: str, scratch: Path, adapters: dict[str, Path], run: CaseRunner, dtype: str = "float32"
) -> dict[str, float]:
    """``run``'s rates on a fresh ``loraplex serve`` with ``LORAPLEX_ENGINE=engine`` in ``dtype``, its tenant owning
    ``adapters``."""
    env = {"LORAPLEX_ENGINE": engine, "LORAPLEX_DTYPE": dtype}
    return on_fresh_server(model, env, scratch, adapters, lambda target, _: run(target))


def on_fresh_server(
    model: Path,
    env: dict[str, str],
    scratch: Path,
    adapters: dict[str, Path],
    run: Callable[[Target, LocalServer], T],
) -> T:
    """``run(target, server)`` on a fresh ``loraplex serve`` with ``env`` (64 sequences at once unless it says),
    one tenant and its key made over the admin API, the tenant owning ``adapters``."""
    server = LocalServer(model, {"LORAPLEX_MAX_NUM_SEQS": "64", **env}, parent=scratch)
    logger.info("starting loraplex serve (%s) in %s", env, server.home)
    server.start()
    try:
        server.wait_ready()
        admin = AdminClient(server.url, server.admin_key)
        try:
            tenant = admin.create_tenant("bench")
            key = admin.create_key(tenant["id"], "bench", ["inference"])["key"]
            for name, folder in adapters.items():
                admin.upload_adapter(tenant["id"], name, folder)
        finally:
            admin.close()
        return run(Target(server.port, key, model.name, tuple(adapters)), server)
    except Exception:
        logger.error("loraplex serve's log ends:\n%s", server.log_tail())
        raise
    finally:
        server.stop()
