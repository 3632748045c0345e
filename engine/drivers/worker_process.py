"""The engine worker as a process of its own, fed over a socket (app/engine_clients/process.py is the other end).

:func:`run_worker_process` is the process's target, started with the "spawn" method (a fresh interpreter:
nothing of the gateway's threads or event loop is copied). It builds the engine from the frozen config,
sends Ready, and then runs the :class:`EngineWorker`'s step loop on its main thread (the thread that built
the engine: see :meth:`EngineWorker.run`), which sends one frame per step, while a second thread reads
command frames and hands them to the worker; a call's reply is sent by whichever thread finishes it. The
worker's log records travel to the gateway as LogLine events, so they come out of the gateway's log in its
format. The process ends on Shutdown, when the gateway's end of the socket closes (the gateway died), and
after Fatal when the engine could not start or its step loop died.
"""

import contextlib
import functools
import logging
import signal
import socket
import sys
import threading
from concurrent.futures import Future

from engine.config import EngineConfig
from engine.drivers.worker import EngineWorker
from engine.drivers.worker_protocol import (
    FRAME_HEADER_BYTES,
    Command,
    Event,
    Fatal,
    LogLine,
    Ready,
    Reply,
    Shutdown,
    decode_command,
    frame,
    frame_size,
    to_wire,
)
from engine.engine import Engine
from engine.errors import EngineDeadError
from engine.memory.host_memory import freeze_startup_heap

logger = logging.getLogger(__name__)

EXIT_FAILED = 1  # the engine did not start, or its step loop died


class FramedSocket:
    """Blocking frames over a socket: sent by any thread (one at a time), received by one."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._send_lock = threading.Lock()

    def send(self, message: Event) -> None:
        data = frame(message)
        with self._send_lock:
            self._sock.sendall(data)

    def receive(self) -> Command | None:
        """The next command; None once the other end has closed."""
        header = self._read(FRAME_HEADER_BYTES)
        if header is None:
            return None
        body = self._read(frame_size(header))
        return None if body is None else decode_command(body)

    def close(self) -> None:
        """Close both directions; a thread blocked in :meth:`receive` returns None."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def _read(self, size: int) -> bytearray | None:
        buffer = bytearray(size)
        view = memoryview(buffer)
        received = 0
        while received < size:
            count = self._sock.recv_into(view[received:])
            if count == 0:
                return None
            received += count
        return buffer


class LogForwarder(logging.Handler):
    """Sends each log record to the client as a LogLine (its traceback, if any, in the message)."""

    def __init__(self, channel: FramedSocket) -> None:
        super().__init__()
        self._channel = channel
        self._formatter = logging.Formatter()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            if record.exc_info:
                message += "\n" + self._formatter.formatException(record.exc_info)
            self._channel.send(LogLine(record.name, record.levelno, message))
        except OSError:  # the gateway is gone (or going): nobody reads the log any more
            return
        except Exception:  # a log record must never take the worker down
            self.handleError(record)


def run_worker_process(sock: socket.socket, config: EngineConfig, log_level: int) -> None:
    """The worker process: build the engine, say Ready, serve commands until Shutdown or the client is gone."""
    # Ctrl-C reaches every process of the terminal's group; the gateway decides when its engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    channel = FramedSocket(sock)
    logging.basicConfig(level=log_level, handlers=[LogForwarder(channel)], force=True)
    try:
        engine = Engine(config)
    except Exception as error:
        channel.send(Fatal(to_wire(error)))
        channel.close()
        sys.exit(EXIT_FAILED)
    freeze_startup_heap()  # this process serves this engine until it exits (engine/memory/host_memory.py)
    died = threading.Event()

    def on_death(error: BaseException) -> None:
        died.set()
        with contextlib.suppress(OSError):
            channel.send(Fatal(to_wire(EngineDeadError(f"the engine stopped after an error: {error}"))))
        channel.close()

    worker = EngineWorker(engine, emit=channel.send, on_death=on_death)
    channel.send(Ready(engine.max_model_len, engine.model_config.vocab_size))
    reader = threading.Thread(target=_serve, args=(channel, worker), name="loraplex-commands", daemon=True)
    reader.start()
    try:
        worker.run()  # the step loop on this thread, which built the engine (see EngineWorker.run)
    finally:
        channel.close()
    if died.is_set():
        sys.exit(EXIT_FAILED)


def _serve(channel: FramedSocket, worker: EngineWorker) -> None:
    """Hand each command to the worker; on Shutdown or once the gateway's end is closed, stop its step loop."""
    try:
        while (command := channel.receive()) is not None:
            if isinstance(command, Shutdown):
                return
            future = worker.handle(command)
            if future is not None:
                future.add_done_callback(functools.partial(_reply, channel, command.call_id))  # type: ignore[union-attr]
    finally:
        worker.request_stop()


def _reply(channel: FramedSocket, call_id: int, future: Future) -> None:
    error = future.exception()
    reply = Reply(call_id, None, to_wire(error)) if error is not None else Reply(call_id, future.result(), None)
    with contextlib.suppress(OSError):  # the client is gone: nobody waits for the reply
        channel.send(reply)
