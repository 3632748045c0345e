"""A replica's connections to the gateways whose requests it runs: one per gateway, opened on its first request.

Each step's outputs go to a gateway as one frame over its connection (``output_wire.py``), instead of one
Ray streamed object per request per step. The gateway sends ``Abort`` frames back. A connection that
closes (the gateway stopped, or the network failed) is forgotten: ``on_lost`` ends the requests that were
sending on it, and the next request from that gateway connects again.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

from app.cluster.output_wire import Hello, InboxAddress
from app.engine_clients.channel import FrameChannel
from engine.drivers.worker_protocol import Abort, StepOutputs, decode_command, frame
from engine.errors import EngineDeadError

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0


class OutputLink:
    """One gateway's connection: frames out, the gateway's aborts in."""

    def __init__(self, address: InboxAddress, sock: socket.socket, links: OutputLinks) -> None:
        self.address = address
        self._links = links
        self.channel = FrameChannel(sock, self._on_frame, self._on_close)

    def send(self, step: StepOutputs) -> None:
        self.channel.send(frame(step))

    def _on_frame(self, body: bytes) -> None:
        command = decode_command(body)
        if isinstance(command, Abort):
            self._links.on_abort(command.request_id)

    def _on_close(self) -> None:
        self._links.forget(self)


class OutputLinks:
    """The replica's links by gateway; ``on_abort(request_id)`` and ``on_lost(link)`` run on the replica's loop."""

    def __init__(self, replica_id: str, on_abort: Callable[[str], None], on_lost: Callable[[OutputLink], None]) -> None:
        self.replica_id = replica_id
        self.on_abort = on_abort
        self._on_lost = on_lost
        self._links: dict[InboxAddress, OutputLink] = {}
        self._connecting: dict[InboxAddress, asyncio.Future[OutputLink]] = {}

    async def get(self, address: InboxAddress) -> OutputLink:
        """The link to the gateway at ``address``, connected now if there is none (EngineDeadError if unreachable:
        the request is refused with it, a 503 for the client, rather than run unheard)."""
        link = self._links.get(address)
        if link is not None:
            return link
        connecting = self._connecting.get(address)
        if connecting is None:  # the requests that arrive meanwhile wait for the same connection
            connecting = asyncio.ensure_future(self._connect(address))
            self._connecting[address] = connecting
            connecting.add_done_callback(lambda done: self._connected(address, done))
        return await asyncio.shield(connecting)

    def _connected(self, address: InboxAddress, done: asyncio.Future[OutputLink]) -> None:
        self._connecting.pop(address, None)
        if not done.cancelled():
            done.exception()  # retrieved here too: every request that waited for it may have been cancelled

    def forget(self, link: OutputLink) -> None:
        if self._links.get(link.address) is link:
            del self._links[link.address]
        self._on_lost(link)

    async def _connect(self, address: InboxAddress) -> OutputLink:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(address.host, address.port, type=socket.SOCK_STREAM)
            family, kind, proto, _, target = infos[0]
            sock = socket.socket(family, kind, proto)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                await asyncio.wait_for(loop.sock_connect(sock, target), CONNECT_TIMEOUT_S)
            except BaseException:
                sock.close()
                raise
        except (OSError, TimeoutError) as error:
            raise EngineDeadError(
                f"engine replica {self.replica_id} could not connect to the gateway's output port "
                f"{address.host}:{address.port}: {error or type(error).__name__}"
            ) from error
        link = OutputLink(address, sock, self)
        link.channel.bind(loop)
        link.channel.send(frame(Hello(address.token, self.replica_id)))
        self._links[address] = link
        logger.info("replica %s sends outputs to the gateway at %s:%d", self.replica_id, address.host, address.port)
        return link
