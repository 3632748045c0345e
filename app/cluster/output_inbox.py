"""The gateway's end of its replicas' output links: a listening socket on this node, and each request's outputs.

A request goes to a replica through Serve (routing and adapter affinity stay Serve's), naming this inbox;
the replica connects here once and sends one frame per engine step with the outputs of all of this
gateway's requests it runs (``output_links.py``). A connection must first prove the inbox's token
(``output_wire.Hello``). Outputs are rebuilt into RequestOutputs here and handed to each request's reader.

The port listens on the node's address, where anyone on the network can connect, so a connection is held
to little until its Hello proves the token: a first frame of at most ``MAX_HELLO_BYTES`` (a longer one is
refused from its header, before its body is read), within ``HELLO_TIMEOUT_S`` of connecting, and at most
``MAX_PENDING`` such connections at once (the oldest is closed for a new one).

The inbox serves one event loop at a time, as :class:`~app.engine_clients.channel.FrameChannel` does: tests
run one loop after another, so :meth:`OutputInbox.bind` moves it to the caller's loop once the loop it
served has stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import time
from dataclasses import dataclass

import msgspec

from app.cluster.output_wire import Hello, InboxAddress, RunEnded
from app.engine_clients.channel import FrameChannel, stays_on
from engine.drivers.worker_protocol import Abort, StepOutputs, frame, from_wire
from engine.errors import EngineDeadError, EngineError, RequestError
from engine.output.output_delta import OutputAssembler
from engine.output.output_queue import OutputQueue

logger = logging.getLogger(__name__)

LISTEN_BACKLOG = 64
MAX_HELLO_BYTES = 1024  # a Hello's frame body is under 100 bytes (a 32-character token and a replica id)
HELLO_TIMEOUT_S = 10.0  # a replica says Hello as soon as it connects; a silent connection is closed after this
MAX_PENDING = LISTEN_BACKLOG  # connections accepted and waiting for their Hello
LINK_WAIT_S = 5.0  # how long a request whose call returned waits for its replica's connection to show
ABANDONED_S = 600.0  # how long a request left before its first output may still start on a replica
_hellos = msgspec.msgpack.Decoder(Hello)
_steps = msgspec.msgpack.Decoder(StepOutputs)


@dataclass(slots=True)
class InboxStream:
    """One request's outputs on their way to its reader."""

    queue: OutputQueue
    assembler: OutputAssembler
    replica_id: str | None = None
    """The replica running it, once its first output (or the end of its call) said so."""
    complete: bool = False
    """Its last output arrived."""
    ended: bool = False
    """The replica has forgotten it (refused it, ended it, or is gone): leaving needs no abort."""


class _Connection:
    """One replica's connection: a Hello with the token first, then StepOutputs."""

    def __init__(self, inbox: OutputInbox, sock: socket.socket) -> None:
        self.inbox = inbox
        self.replica_id: str | None = None
        self.channel = FrameChannel(sock, self._on_frame, self._on_close)
        self.channel.max_frame_bytes = MAX_HELLO_BYTES  # lifted once the Hello proves the token

    def expire(self) -> None:
        """Close the connection if it has not proved the token yet."""
        if self.replica_id is None and not self.channel.closed:
            logger.warning("closed an output connection that sent no Hello within %g s", HELLO_TIMEOUT_S)
            self.channel.close()

    def _on_frame(self, body: bytes) -> None:
        if self.replica_id is not None:
            self.inbox.deliver(self, _steps.decode(body))
            return
        try:
            hello = _hellos.decode(body)
        except msgspec.DecodeError:
            hello = None
        if hello is None or not secrets.compare_digest(hello.token, self.inbox.address.token):
            logger.warning("closed an output connection that did not prove this gateway's token")
            self.channel.close()
            return
        self.replica_id = hello.replica_id
        self.channel.max_frame_bytes = None
        self.inbox.attach(self)

    def _on_close(self) -> None:
        self.inbox.detach(self)


class OutputInbox:
    """Listens on ``host`` (this node's address); ``address`` is what each request names."""

    def __init__(self, host: str, port: int = 0) -> None:
        self._listener = socket.create_server((host, port), family=_family(host), backlog=LISTEN_BACKLOG)
        self._listener.setblocking(False)
        self.address = InboxAddress(host, self._listener.getsockname()[1], secrets.token_urlsafe(24))
        self.encoded_address = msgspec.msgpack.encode(self.address)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: dict[_Connection, None] = {}  # accepted, before their Hello; the oldest first
        self._links: dict[str, _Connection] = {}  # replica id -> its connection
        self._streams: dict[str, InboxStream] = {}
        self._abandoned: dict[str, float] = {}  # left before any output said where they run -> monotonic time left
        self._closed = False

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve ``loop`` from now on, unless the loop served so far still runs."""
        current = self._loop
        if self._closed or stays_on(current, loop):
            return
        if current is not None and not current.is_closed():
            with contextlib.suppress(RuntimeError, ValueError, OSError):
                current.remove_reader(self._listener.fileno())
        self._loop = loop
        loop.add_reader(self._listener.fileno(), self._accept)
        for connection in (*self._pending, *self._links.values()):
            connection.channel.bind(loop)

    def open(self, request_id: str, prompt_ids: list[int]) -> InboxStream:
        if request_id in self._streams:
            raise RequestError(f"request id {request_id!r} is already in use")
        stream = InboxStream(OutputQueue(asyncio.get_running_loop()), OutputAssembler(prompt_ids))
        self._streams[request_id] = stream
        return stream

    def leave(self, request_id: str) -> bool:
        """The reader is done with the request. False when the replica still runs it and no output has said
        which one yet: the caller cancels its Serve call, and the request's first output, should one still
        come, is answered with an abort."""
        stream = self._streams.pop(request_id, None)
        if stream is None or stream.complete or stream.ended:
            return True
        connection = None if stream.replica_id is None else self._links.get(stream.replica_id)
        if connection is None:
            self._abandon(request_id)
            return False
        connection.channel.send(frame(Abort(request_id)))
        return True

    def ended(self, request_id: str, result: RunEnded) -> None:
        """The request's Serve call returned."""
        self._abandoned.pop(request_id, None)
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if result.error is not None:
            self._end(stream, from_wire(result.error))
            return
        stream.replica_id = result.replica_id  # a connection of its replica's that closes now ends it
        if not stream.complete and result.replica_id not in self._links and self._loop is not None:
            # The last frame was sent before the call returned, but its connection is not here: it may still be
            # on its way (a new connection not read yet), or closed already.
            self._loop.call_later(LINK_WAIT_S, self._cut_off, request_id, stream)

    def _cut_off(self, request_id: str, stream: InboxStream) -> None:
        waiting = self._streams.get(request_id) is stream and not stream.complete and not stream.ended
        if waiting and stream.replica_id not in self._links:
            self._end(stream, EngineDeadError(f"the connection from engine replica {stream.replica_id} closed"))

    def fail(self, request_id: str, error: EngineError) -> None:
        """The request's Serve call failed (the replica died, or its code raised)."""
        self._abandoned.pop(request_id, None)
        stream = self._streams.get(request_id)
        if stream is not None:
            self._end(stream, error)

    def close(self) -> None:
        """Stop listening and close every connection (the replicas end this gateway's requests)."""
        if self._closed:
            return
        self._closed = True
        loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError, ValueError, OSError):
                loop.remove_reader(self._listener.fileno())
        self._listener.close()
        for connection in (*self._pending, *self._links.values()):
            connection.channel.close()

    # The connections' side ------------------------------------------------------------------------

    def deliver(self, connection: _Connection, step: StepOutputs) -> None:
        replica_id = connection.replica_id
        for delta in step.outputs:
            stream = self._streams.get(delta.request_id)
            if stream is None:  # its reader left: an Abort is on its way, or goes now
                if self._abandoned.pop(delta.request_id, None) is not None and not delta.request_finished:
                    connection.channel.send(frame(Abort(delta.request_id)))
                continue
            stream.replica_id = replica_id
            stream.complete = delta.request_finished
            if not stream.queue.put(stream.assembler.apply(delta)):
                self._streams.pop(delta.request_id, None)  # its event loop is gone: nobody reads it

    def attach(self, connection: _Connection) -> None:
        self._pending.pop(connection, None)
        if connection.replica_id is None:
            return
        previous = self._links.get(connection.replica_id)
        self._links[connection.replica_id] = connection
        if previous is not None:
            previous.channel.close()

    def detach(self, connection: _Connection) -> None:
        """A connection closed: the requests its replica was sending on it end (their outputs cannot come)."""
        self._pending.pop(connection, None)
        replica_id = connection.replica_id
        if replica_id is None or self._links.get(replica_id) is not connection:
            return
        del self._links[replica_id]
        if self._closed:
            return
        lost = [stream for stream in self._streams.values() if stream.replica_id == replica_id and not stream.complete]
        for stream in lost:
            self._end(stream, EngineDeadError(f"the connection from engine replica {replica_id} closed"))

    def _accept(self) -> None:
        loop = self._loop
        while loop is not None:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                logger.exception("the gateway's output port could not accept a connection")
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if len(self._pending) >= MAX_PENDING:
                oldest = next(iter(self._pending))
                logger.warning("closed the oldest of %d output connections waiting for their Hello", MAX_PENDING)
                oldest.channel.close()  # its on_close takes it out of _pending
            connection = _Connection(self, sock)
            self._pending[connection] = None
            connection.channel.bind(loop)
            loop.call_later(HELLO_TIMEOUT_S, connection.expire)

    def _abandon(self, request_id: str) -> None:
        """Remember a request left before its replica was known. Cancelling its Serve call does not always
        stop it (Serve may have sent it just before), so its first output is answered with an abort; the
        entries of calls that never ran are dropped after ``ABANDONED_S``."""
        now = time.monotonic()
        self._abandoned[request_id] = now
        oldest = next(iter(self._abandoned.values()))
        if now - oldest > ABANDONED_S:
            self._abandoned = {key: left for key, left in self._abandoned.items() if now - left <= ABANDONED_S}

    def _end(self, stream: InboxStream, error: EngineError) -> None:
        stream.ended = True
        stream.queue.put(error)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
