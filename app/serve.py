"""`loraplex serve`: the demo adapters on first use, then the HTTP server, then a banner that works as printed."""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from pathlib import Path

import uvicorn
from litestar import Litestar

from app.demo.adapters import ensure_demo_adapters
from app.demo.tenant import DemoAccess
from app.factory import create_app
from app.model_store import resolve_model
from app.settings import Settings

logger = logging.getLogger(__name__)

END_MARGIN_S = 2.0  # before the grace period runs out, requests still running are ended, so streams end cleanly


class GracefulServer(uvicorn.Server):
    """uvicorn's graceful shutdown, with a clean end for requests that outlast the grace period.

    On SIGTERM (or Ctrl-C) uvicorn stops accepting connections, lets running responses finish for up to
    ``timeout_graceful_shutdown`` seconds, then cancels what is left, which would cut streams mid-response.
    ``END_MARGIN_S`` before that, the engine ends every request it still runs: each stream gets OpenAI's
    error event saying to retry, each usage row says ``cancelled``. The lifespan then stops the engine and
    writes the usage still buffered (or spills it to the data folder when the database is away).
    """

    def __init__(self, config: uvicorn.Config, app: Litestar) -> None:
        super().__init__(config)
        self._app = app

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        engine = getattr(self._app.state, "gateway", None) and self._app.state.gateway.engine
        grace = self.config.timeout_graceful_shutdown or 0
        timer = None
        if engine is not None and engine.is_ready():
            timer = asyncio.get_running_loop().call_later(max(0.0, grace - END_MARGIN_S), engine.abort_all)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()


def run_server(settings: Settings, host: str, port: int) -> None:
    demo_adapters: dict[str, Path] = {}
    if settings.demo:
        demo_adapters = ensure_demo_adapters(settings, resolve_model(settings.model, settings.home))
    app = create_app(settings, demo_adapters=demo_adapters)
    base_url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"

    async def announce(app: Litestar) -> None:
        gateway = app.state.gateway
        sys.stdout.write(banner(base_url, gateway.engine.model_name, gateway.demo))
        sys.stdout.flush()

    app.on_startup.append(announce)
    grace_s = round(settings.shutdown_grace_s)
    config = uvicorn.Config(
        app, host=host, port=port, log_config=None, lifespan="on", timeout_graceful_shutdown=grace_s
    )
    GracefulServer(config, app).run()


def banner(base_url: str, base_model: str, demo: DemoAccess | None) -> str:
    """What the server prints once it is ready: where it listens, and examples that work as printed."""
    lines = [f"\nloraplex is serving {base_model} on {base_url}  (OpenAI API under {base_url}/v1)\n"]
    if demo is None:
        lines.append("Create a tenant and an API key to call it (see docs/admin.md).\n")
        return "\n".join(lines)
    model = demo.adapters[0] if demo.adapters else base_model
    lines += [
        f"Demo tenant key: {demo.api_key}",
        f"Models for this key: {', '.join((base_model, *demo.adapters))}\n",
        "Try it with curl:\n",
        f"  curl -s {base_url}/v1/chat/completions \\",
        f'    -H "Authorization: Bearer {demo.api_key}" -H "Content-Type: application/json" \\',
        f'    -d \'{{"model": "{model}", "max_tokens": 48, '
        '"messages": [{"role": "user", "content": "What is the capital of France?"}]}\'\n',
        "or with the openai Python package:\n",
        "  from openai import OpenAI",
        f'  client = OpenAI(base_url="{base_url}/v1", api_key="{demo.api_key}")',
        f'  reply = client.chat.completions.create(model="{model}", max_tokens=48,',
        '      messages=[{"role": "user", "content": "What is the capital of France?"}])',
        "  print(reply.choices[0].message.content)\n",
    ]
    return "\n".join(lines)
