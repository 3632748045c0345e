"""A minimal HTTP/1.1 keep-alive client for loopback load generation.

httpx spends 1.5-2 ms of CPU per request on this 2-core machine, as much as the server under test, so
its own scheduling delays would be counted as the gateway's. This client writes pre-encoded requests
and parses just enough of the response (status line, Content-Length or chunked body) to check it.
"""

from __future__ import annotations

import asyncio
import socket

StreamPair = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def encode_request(method: str, path: str, headers: dict[str, str], body: bytes = b"") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class RawConnectionPool:
    """Keep-alive connections to one port; a request takes an idle one or opens a new one."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._idle: list[StreamPair] = []

    async def request(self, raw: bytes) -> tuple[int, bytes]:
        """Send a pre-encoded request; its status and body (de-chunked). A stale idle connection is retried once."""
        if self._idle:
            pair = self._idle.pop()
            try:
                return await self._exchange(pair, raw)
            except (asyncio.IncompleteReadError, ConnectionError):
                pair[1].close()
        return await self._exchange(await self._connect(), raw)

    async def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()

    async def _connect(self) -> StreamPair:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        # Without TCP_NODELAY, a keep-alive request waits ~40 ms for the peer's delayed ACK.
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return reader, writer

    async def _exchange(self, pair: StreamPair, raw: bytes) -> tuple[int, bytes]:
        reader, writer = pair
        writer.write(raw)
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        headers = {
            name.strip().lower(): value.strip()
            for name, _, value in (line.partition(b":") for line in head.split(b"\r\n")[1:] if line)
        }
        if headers.get(b"transfer-encoding") == b"chunked":
            body = await _read_chunked(reader)
        else:
            body = await reader.readexactly(int(headers.get(b"content-length", b"0")))
        if headers.get(b"connection") == b"close":
            writer.close()
        else:
            self._idle.append(pair)
        return status, body


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")  # the empty trailer section
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)
