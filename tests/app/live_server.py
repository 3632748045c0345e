"""The app under uvicorn on a loopback port, in a thread of the test process (for real HTTP clients)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import uvicorn
from litestar import Litestar

from app.engine_clients.interface import EngineClient
from app.factory import create_app
from app.serve import uvicorn_config
from app.services import Gateway
from app.settings import Settings

START_TIMEOUT_S = 30.0

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass(frozen=True, slots=True)
class LiveServer:
    url: str
    gateway: Gateway
    loop: asyncio.AbstractEventLoop

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the server's event loop (its database pool lives there) and return its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=START_TIMEOUT_S)


@contextmanager
def live_server(settings: Settings, engine: EngineClient) -> Iterator[LiveServer]:
    """Yield the running server; it stops (gracefully) when the block ends."""
    app = create_app(settings, engine=engine)
    loops: list[asyncio.AbstractEventLoop] = []

    async def remember_loop(app: Litestar) -> None:
        loops.append(asyncio.get_running_loop())

    app.on_startup.append(remember_loop)
    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, settings, "127.0.0.1", port))
    thread = threading.Thread(target=server.run, name="live-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the live server did not start")
        time.sleep(0.05)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", app.state.gateway, loops[0])
    finally:
        server.should_exit = True
        thread.join(timeout=30)
