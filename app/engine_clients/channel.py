"""Frames over a socket, read and written by an asyncio event loop: the gateway's end of an engine worker's socket.

Non-blocking and thread-free: reading is a reader callback on the event loop, writing goes through an
outbox that is flushed as fast as the socket takes it. A frame is its length (4 bytes) and its body
(``engine/drivers/worker_protocol.py``). The channel serves one event loop at a time: a server has one, while
tests run one loop after another, so :meth:`FrameChannel.bind` moves it to the caller's loop once the
loop it served has stopped. Frames may be sent from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import Callable

from engine.drivers.worker_protocol import FRAME_HEADER_BYTES, frame_size

logger = logging.getLogger(__name__)

RECEIVE_BYTES = 256 * 1024  # per read; one step's outputs for 64 requests take a few KiB


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def stays_on(current: asyncio.AbstractEventLoop | None, loop: asyncio.AbstractEventLoop) -> bool:
    """Whether something served by ``current`` stays there rather than move to ``loop``: it is ``loop``
    already, or it still runs (and goes on serving everyone); a stopped or closed loop is left."""
    return current is loop or (current is not None and not current.is_closed() and current.is_running())


class FrameChannel:
    """A socket carrying frames both ways; ``on_frame`` gets each body, ``on_close`` is called once at the end.

    ``max_frame_bytes``, when set, bounds the frames it takes: a header that announces a longer body closes the
    channel before any of that body is kept (a peer not yet trusted cannot make it buffer gigabytes).
    """

    def __init__(self, sock: socket.socket, on_frame: Callable[[bytes], None], on_close: Callable[[], None]) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._fd = sock.fileno()
        self._on_frame = on_frame
        self._on_close = on_close
        self._received = bytearray()
        self._outbox = bytearray()
        self._outbox_lock = threading.Lock()  # send() may run on any thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._writing = False  # a writer callback waits for room in the socket
        self._closed = False
        self.max_frame_bytes: int | None = None

    @property
    def closed(self) -> bool:
        return self._closed

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve ``loop`` from now on, unless the loop served so far still runs (it goes on reading for everyone)."""
        if self._closed or stays_on(self._loop, loop):
            return
        self._detach()
        self._loop = loop
        loop.add_reader(self._fd, self._read)
        self._flush()

    def send(self, data: bytes) -> None:
        """Queue a frame; it leaves as soon as the socket takes it (dropped once the channel is closed)."""
        if self._closed:
            return
        with self._outbox_lock:
            self._outbox += data
        loop = self._loop
        if loop is None:
            return  # flushed when a loop binds
        if _running_loop() is loop:
            self._flush()
            return
        with contextlib.suppress(RuntimeError):  # a closed loop: the next loop to bind flushes it
            loop.call_soon_threadsafe(self._flush)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._detach()
        self._sock.close()
        self._on_close()

    def _detach(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError, ValueError, OSError):
            loop.remove_reader(self._fd)
            if self._writing:
                loop.remove_writer(self._fd)
        self._writing = False

    def _flush(self) -> None:
        loop = self._loop
        if self._closed or loop is None or _running_loop() is not loop:
            return
        broken = False
        with self._outbox_lock:
            if self._outbox:
                try:
                    sent = self._sock.send(self._outbox)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                except OSError:  # the other end is gone; reading sees it too
                    sent, broken = 0, True
                    self._outbox.clear()
                del self._outbox[:sent]
            pending = bool(self._outbox)
        if broken:
            self.close()
        elif pending and not self._writing:
            loop.add_writer(self._fd, self._flush)
            self._writing = True
        elif not pending and self._writing:
            loop.remove_writer(self._fd)
            self._writing = False

    def _read(self) -> None:
        try:
            data = self._sock.recv(RECEIVE_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.close()
            return
        buffer = self._received
        buffer += data
        start = 0
        while len(buffer) - start >= FRAME_HEADER_BYTES:
            size = frame_size(buffer[start : start + FRAME_HEADER_BYTES])
            if self.max_frame_bytes is not None and size > self.max_frame_bytes:
                logger.warning(
                    "closed a connection that announced a %d-byte frame (%d at most)", size, self.max_frame_bytes
                )
                buffer.clear()
                self.close()
                return
            end = start + FRAME_HEADER_BYTES + size
            if len(buffer) < end:
                break
            body = bytes(buffer[start + FRAME_HEADER_BYTES : end])
            start = end
            try:
                self._on_frame(body)
            except Exception:  # one bad frame must not stop the frames after it
                logger.exception("a frame from the engine worker could not be handled")
            if self._closed:  # the frame's handler closed the channel (a Hello without the token)
                return
        del buffer[:start]
