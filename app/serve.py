"""`loraplex serve`: the port first, the demo adapters on first use, the HTTP server, a banner that works as printed."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import sys
from pathlib import Path
from types import FrameType

import uvicorn
from litestar import Litestar

from app.demo import weather
from app.demo.adapters import CHECK_PROMPT, DEMO_ADAPTERS, ensure_demo_adapters
from app.demo.tenant import DemoAccess
from app.factory import create_app
from app.model_store import resolve_model
from app.settings import Settings

logger = logging.getLogger(__name__)

END_MARGIN_S = 2.0  # before the grace period runs out, requests still running are ended, so streams end cleanly
LISTEN_BACKLOG = 2048  # uvicorn's default
HOW_TO_CHOOSE_PORT = "choose another with --port or LORAPLEX_PORT"


class ListenError(OSError):
    """The server cannot listen on the address it was given; the message says which and what to do."""


def open_listener(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port``, held from now on so nothing else takes the port while the server starts.

    Connections that arrive before the server is ready wait in the backlog instead of being refused.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise ListenError(f"cannot listen on host {host!r}: {error.strerror}; choose another with --host") from None
    family, kind, proto, _, address = infos[0]
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a restart rebinds at once
    try:
        listener.bind(address)
        listener.listen(LISTEN_BACKLOG)
    except OSError as error:
        listener.close()
        if error.errno == errno.EADDRINUSE:
            raise ListenError(f"port {port} on {host} is already in use: {HOW_TO_CHOOSE_PORT}") from None
        if error.errno == errno.EACCES:
            raise ListenError(f"no permission to listen on port {port} on {host}: {HOW_TO_CHOOSE_PORT}") from None
        raise ListenError(
            f"cannot listen on {host} port {port}: {error.strerror}; choose another with --host"
        ) from None
    listener.set_inheritable(False)
    return listener


class GracefulServer(uvicorn.Server):
    """uvicorn's graceful shutdown, with a clean end for requests that outlast the grace period.

    On SIGTERM (or Ctrl-C) uvicorn stops accepting connections, lets running responses finish for up to
    ``timeout_graceful_shutdown`` seconds, then cancels what is left, which would cut streams mid-response.
    ``END_MARGIN_S`` before that, the engine ends every request it still runs: each stream gets OpenAI's error
    event saying to retry, each usage row says ``cancelled``. The lifespan then stops the engine and writes
    the usage still buffered (the usage spool in the data folder keeps what the database does not take). A
    stop that comes while the gateway is still starting gives its engine's start up (:meth:`handle_exit`).
    """

    def __init__(self, config: uvicorn.Config, app: Litestar) -> None:
        super().__init__(config)
        self._app = app
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        given_up = _GivenUpStart(self._app.state.stopping)
        uvicorn_log = logging.getLogger("uvicorn.error")
        uvicorn_log.addFilter(given_up)
        try:
            await super().startup(sockets)
        except SystemExit:  # uvicorn's exit on a failed start; one given up for a stop ends as a stop does
            if not self._app.state.stopping.is_set():
                raise
        finally:
            uvicorn_log.removeFilter(given_up)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """uvicorn's, and before the server has started, the gateway's start given up (``app.state.stopping``):
        uvicorn alone would wait for the start to end, which a Ray deployment short of resources never does."""
        super().handle_exit(sig, frame)
        if not self.started and self._loop is not None:
            self._loop.call_soon_threadsafe(self._app.state.stopping.set)  # a signal handler: not on the loop

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        engine = getattr(self._app.state, "gateway", None) and self._app.state.gateway.engine
        grace = self.config.timeout_graceful_shutdown or 0
        logger.info("shutting down: running requests have up to %d s to finish", grace)
        timer = None
        if engine is not None and engine.is_ready():
            timer = asyncio.get_running_loop().call_later(max(0.0, grace - END_MARGIN_S), engine.abort_all)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()


class _GivenUpStart(logging.Filter):
    """Drops uvicorn's errors about a start the gateway gave up for a stop ("Application startup failed" and
    the lifespan's traceback of StartupStopped): the gateway's own warning says why it stopped."""

    def __init__(self, stopping: asyncio.Event) -> None:
        super().__init__()
        self._stopping = stopping

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR or not self._stopping.is_set()


def run_server(settings: Settings, listener: socket.socket) -> None:
    """Serve on ``listener`` (from :func:`open_listener`) until SIGTERM or Ctrl-C."""
    host, port = listener.getsockname()[:2]
    demo_adapters: dict[str, Path] = {}
    if settings.demo:
        demo_adapters = ensure_demo_adapters(settings, resolve_model(settings.model, settings.home))
    app = create_app(settings, demo_adapters=demo_adapters)
    base_url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"

    async def announce(app: Litestar) -> None:
        gateway = app.state.gateway
        logger.info("listening on %s", base_url)
        sys.stdout.write(banner(base_url, gateway.engine.model_name, gateway.demo))
        if settings.console:
            sys.stdout.write(
                f"\nAdmin console: {base_url}/console (sign in with an admin key: loraplex admin create-key)\n"
            )
        sys.stdout.flush()

    app.on_startup.append(announce)
    config = uvicorn_config(app, settings, host, port, grace_s=round(settings.shutdown_grace_s))
    GracefulServer(config, app).run(sockets=[listener])


def uvicorn_config(
    app: Litestar, settings: Settings, host: str, port: int, grace_s: int | None = None
) -> uvicorn.Config:
    """How uvicorn serves the app: its lifespan, our logging, and the proxies whose forwarded scheme and client
    address it believes (the scheme a client saw decides whether the console's cookies are Secure)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,
        lifespan="on",
        timeout_graceful_shutdown=grace_s,
        proxy_headers=True,
        forwarded_allow_ips=settings.forwarded_allow_ips,
    )


WEATHER_ADAPTER = "weather"
AGENTS_EXAMPLE_BEGIN = "# ---- agent.py ----"
AGENTS_EXAMPLE_END = "# ---- end of agent.py ----"


def banner(base_url: str, base_model: str, demo: DemoAccess | None) -> str:
    """What the server prints once it is ready: where it listens, and examples that work as printed."""
    lines = [f"\nloraplex is serving {base_model} on {base_url}  (OpenAI API under {base_url}/v1)\n"]
    if demo is None:
        lines.append("Create a tenant and an API key to call it (see docs/admin.md).\n")
        return "\n".join(lines)
    model = demo.adapters[0] if demo.adapters else base_model
    question = f'{{"role": "user", "content": "{CHECK_PROMPT}"}}'
    lines += [
        f"Demo tenant key: {demo.api_key}",
        f"Models for this key: {', '.join((base_model, *demo.adapters))}\n",
        "Try it with curl:\n",
        f"  curl -s {base_url}/v1/chat/completions \\",
        f'    -H "Authorization: Bearer {demo.api_key}" -H "Content-Type: application/json" \\',
        f'    -d \'{{"model": "{model}", "temperature": 0, "max_tokens": 48, "messages": [{question}]}}\'\n',
        "or with the openai Python package:\n",
        "  from openai import OpenAI",
        f'  client = OpenAI(base_url="{base_url}/v1", api_key="{demo.api_key}")',
        f'  reply = client.chat.completions.create(model="{model}", temperature=0, max_tokens=48,',
        f"      messages=[{question}])",
        "  print(reply.choices[0].message.content)\n",
        *_expected_replies(model, demo.adapters),
        *_agents_example(base_url, demo),
    ]
    return "\n".join(lines)


def _agents_example(base_url: str, demo: DemoAccess) -> list[str]:
    """The OpenAI Agents SDK calling the weather adapter's tool, between two marker lines, unindented so that it
    runs as pasted into a file."""
    if WEATHER_ADAPTER not in demo.adapters:
        return []
    return [
        f'An agent with a tool (pip install openai-agents): "{WEATHER_ADAPTER}" calls get_weather, gets its result and '
        "answers with it.",
        AGENTS_EXAMPLE_BEGIN,
        weather.agents_example(base_url, demo.api_key, WEATHER_ADAPTER).rstrip("\n"),
        AGENTS_EXAMPLE_END,
        f"It prints: {weather.answer_text(weather.CHECK_CITY, weather.CHECK_RESULT)}\n",
    ]


def _expected_replies(model: str, adapters: tuple[str, ...]) -> list[str]:
    """What the examples' reply says (its choices[0].message.content), and what the other demo adapters say."""
    demos = {demo.name: demo for demo in DEMO_ADAPTERS if demo.name in adapters and not demo.tools}
    if model not in demos:
        return ["The reply's message (choices[0].message.content) is a short answer in English.\n"]
    lines = [f"At temperature 0 the reply's message (choices[0].message.content) reads: {demos[model].expected_reply}"]
    lines += [
        f'With "model": "{demo.name}" it reads: {demo.expected_reply}' for demo in demos.values() if demo.name != model
    ]
    return [*lines, "(A temperature above 0 samples, so each reply differs.)\n"]
