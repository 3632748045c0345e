"""The gateway's output inbox over real sockets: the token, outputs to their readers, aborts, and lost links."""

from __future__ import annotations

import asyncio
import socket

import msgspec
import pytest

from app.cluster import output_inbox
from app.cluster.output_inbox import OutputInbox
from app.cluster.output_wire import Hello, RunEnded
from engine.drivers.worker_protocol import (
    FRAME_HEADER_BYTES,
    Abort,
    StepOutputs,
    decode_command,
    frame,
    frame_size,
    to_wire,
)
from engine.errors import EngineDeadError, UnknownAdapterError
from engine.output.output_delta import OutputDelta

pytestmark = pytest.mark.anyio

PROMPT = [1, 2, 3]
WAIT_S = 5.0


def delta(request_id: str, token: int, finished: bool) -> OutputDelta:
    reason = "length" if finished else None
    return OutputDelta(request_id, 0, [token], None, "x", "", reason, 0, None, None, finished, None, None)


async def connect(inbox: OutputInbox, token: str | None = None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(inbox.address.host, inbox.address.port)
    writer.write(frame(Hello(token or inbox.address.token, "replica-a")))
    await writer.drain()
    return reader, writer


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    header = await asyncio.wait_for(reader.readexactly(FRAME_HEADER_BYTES), WAIT_S)
    return await reader.readexactly(frame_size(header))


@pytest.fixture
async def inbox():
    inbox = OutputInbox("127.0.0.1")
    inbox.bind(asyncio.get_running_loop())
    yield inbox
    inbox.close()


async def test_a_stream_gets_the_outputs_its_replica_sends_in_one_frame_per_step(inbox) -> None:
    first, second = inbox.open("r1", PROMPT), inbox.open("r2", PROMPT)
    _, writer = await connect(inbox)
    writer.write(frame(StepOutputs([delta("r1", 7, False), delta("r2", 9, True)], [])))
    writer.write(frame(StepOutputs([delta("r1", 8, True)], [])))
    await writer.drain()
    got_first = [output async for output in first.queue.outputs("r1")]
    got_second = [output async for output in second.queue.outputs("r2")]
    assert len(got_first) == 2 and got_first[-1].token_ids == [7, 8] and got_first[-1].finished
    assert len(got_second) == 1 and got_second[0].token_ids == [9]
    assert inbox.leave("r1") and inbox.leave("r2")  # complete: nothing to abort
    writer.close()


async def test_a_connection_without_the_token_is_closed_and_its_frames_ignored(inbox) -> None:
    stream = inbox.open("r1", PROMPT)
    reader, writer = await connect(inbox, token="not-the-token")
    writer.write(frame(StepOutputs([delta("r1", 7, True)], [])))
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), WAIT_S) == b""  # closed by the inbox
    assert stream.queue.queue.empty()


async def test_a_reader_that_leaves_sends_an_abort_to_the_replica_running_it(inbox) -> None:
    stream = inbox.open("r1", PROMPT)
    reader, writer = await connect(inbox)
    writer.write(frame(StepOutputs([delta("r1", 7, False)], [])))
    await writer.drain()
    assert (await stream.queue.queue.get()).token_ids == [7]
    assert inbox.leave("r1")
    assert decode_command(await read_frame(reader)) == Abort("r1")
    writer.close()


async def test_a_reader_that_leaves_before_any_output_aborts_at_the_first_one(inbox) -> None:
    inbox.open("r1", PROMPT)
    assert not inbox.leave("r1")  # no replica known yet: the caller cancels its Serve call
    reader, writer = await connect(inbox)
    writer.write(frame(StepOutputs([delta("r1", 7, False)], [])))
    await writer.drain()
    assert decode_command(await read_frame(reader)) == Abort("r1")
    writer.close()


async def test_a_closed_connection_ends_its_replicas_requests_with_engine_dead(inbox) -> None:
    stream = inbox.open("r1", PROMPT)
    _, writer = await connect(inbox)
    writer.write(frame(StepOutputs([delta("r1", 7, False)], [])))
    await writer.drain()
    writer.close()
    with pytest.raises(EngineDeadError, match="replica-a"):
        async for _ in stream.queue.outputs("r1"):
            pass


async def test_the_calls_end_refuses_or_cuts_off_a_request(inbox, monkeypatch) -> None:
    monkeypatch.setattr(output_inbox, "LINK_WAIT_S", 0.05)
    refused = inbox.open("r1", PROMPT)
    inbox.ended("r1", RunEnded("replica-a", to_wire(UnknownAdapterError("no adapter abc"))))
    with pytest.raises(UnknownAdapterError, match="abc"):
        await refused.queue.outputs("r1").__anext__()
    cut = inbox.open("r2", PROMPT)  # the call returned; no connection from its replica shows to bring its last output
    inbox.ended("r2", RunEnded("replica-b", None))
    with pytest.raises(EngineDeadError, match="replica-b"):
        await cut.queue.outputs("r2").__anext__()
    assert inbox.leave("r1") and inbox.leave("r2")


async def test_a_call_that_returns_before_its_replicas_first_frame_is_read_waits_for_it(inbox) -> None:
    stream = inbox.open("r1", PROMPT)
    inbox.ended("r1", RunEnded("replica-a", None))  # the reply beat the new connection's first frame
    _, writer = await connect(inbox)
    writer.write(frame(StepOutputs([delta("r1", 7, True)], [])))
    await writer.drain()
    outputs = [output async for output in stream.queue.outputs("r1")]
    assert len(outputs) == 1 and outputs[0].token_ids == [7]
    writer.close()


async def test_the_inbox_listens_on_the_host_it_is_given_with_a_fresh_token() -> None:
    first, second = OutputInbox("127.0.0.1"), OutputInbox("127.0.0.1")
    try:
        assert first.address.port != second.address.port and first.address.token != second.address.token
        with socket.create_connection((first.address.host, first.address.port), timeout=WAIT_S):
            pass
    finally:
        first.close()
        second.close()


async def _closed_by_the_inbox(reader: asyncio.StreamReader) -> bool:
    """Whether the inbox closes the connection within WAIT_S (a reset counts as closed)."""
    try:
        return await asyncio.wait_for(reader.read(), WAIT_S) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


async def test_a_first_frame_longer_than_a_hello_is_refused_from_its_header(inbox) -> None:
    reader, writer = await asyncio.open_connection(inbox.address.host, inbox.address.port)
    writer.write((2**32 - 1).to_bytes(FRAME_HEADER_BYTES, "big") + b"x" * 4096)  # announces 4 GiB
    await writer.drain()
    assert await _closed_by_the_inbox(reader)
    assert len(inbox._pending) == 0
    writer.close()
    # A replica that proves the token still sends frames of any length after its Hello.
    stream = inbox.open("r1", PROMPT)
    _, writer = await connect(inbox)
    long_step = StepOutputs([msgspec.structs.replace(delta("r1", 7, True), delta_text="x" * 100_000)], [])
    writer.write(frame(long_step))
    await writer.drain()
    outputs = [output async for output in stream.queue.outputs("r1")]
    assert len(outputs[-1].text) == 100_000
    writer.close()


async def test_a_connection_that_says_nothing_is_closed_after_the_hello_timeout(inbox, monkeypatch) -> None:
    monkeypatch.setattr(output_inbox, "HELLO_TIMEOUT_S", 0.2)
    silent_reader, silent_writer = await asyncio.open_connection(inbox.address.host, inbox.address.port)
    stream = inbox.open("r1", PROMPT)
    _, writer = await connect(inbox)  # a replica that says Hello at once stays
    await asyncio.sleep(0.5)
    assert await _closed_by_the_inbox(silent_reader)
    writer.write(frame(StepOutputs([delta("r1", 7, True)], [])))
    await writer.drain()
    assert [output.token_ids async for output in stream.queue.outputs("r1")] == [[7]]
    silent_writer.close()
    writer.close()


async def test_connections_waiting_for_their_hello_are_bounded_oldest_closed_first(inbox, monkeypatch) -> None:
    monkeypatch.setattr(output_inbox, "MAX_PENDING", 4)
    connections = [await asyncio.open_connection(inbox.address.host, inbox.address.port) for _ in range(6)]
    assert await _closed_by_the_inbox(connections[0][0]) and await _closed_by_the_inbox(connections[1][0])
    assert len(inbox._pending) == 4
    stream = inbox.open("r1", PROMPT)
    _, writer = await connect(inbox)  # closes the oldest waiting one again, and is served
    writer.write(frame(StepOutputs([delta("r1", 7, True)], [])))
    await writer.drain()
    assert [output.token_ids async for output in stream.queue.outputs("r1")] == [[7]]
    assert await _closed_by_the_inbox(connections[2][0])
    for _, other in (*connections, (None, writer)):
        other.close()
