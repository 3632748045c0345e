"""The messages between an engine worker and its client, and how errors cross between them (docs/architecture.md).

A worker runs an :class:`~engine.engine.Engine` away from the gateway (a process of its own today, a Ray
replica later) and speaks in these small typed messages. Commands go in: submit, abort, abort all, and
named calls that each get one :class:`Reply`. Events come out: :class:`Ready` once, one
:class:`StepOutputs` per engine step with every output of that step (as deltas, see
``engine/output/output_delta.py``), replies, the worker's log records, and :class:`Fatal` when it cannot go on.

Encoded with msgspec's MessagePack rather than pickle: the messages are a closed, typed set and decoding
checks them against it (``SamplingParams`` runs its own checks again on the way in); a step's batch of
deltas is a few KiB and encodes and decodes faster than pickle's
(docs/benchmarks.md#engine-constants-and-choices); and decoding can never run code. Errors cross as
their class name and message (:class:`WireError`) and are rebuilt as the engine's own error classes, so
the gateway maps them to HTTP statuses as it does for an engine in its process.

On a byte stream, each message is a frame: its length as 4 bytes, big-endian, then its MessagePack body.
"""

from typing import Any

import msgspec

from engine.errors import (
    AdapterBusyError,
    AdapterError,
    AdapterFormatError,
    AdapterMismatchError,
    AdapterNotFoundError,
    ConfigError,
    EngineDeadError,
    EngineError,
    PoolExhaustedError,
    RequestError,
    RequestFailedError,
    UnknownAdapterError,
    UnsupportedAdapterError,
)
from engine.output.output_delta import OutputDelta
from engine.sampling.grammar import GrammarConstraint, GrammarError
from engine.sampling.sampling_params import SamplingParams

FRAME_HEADER_BYTES = 4

# The errors that keep their class across the boundary; any other arrives as a plain EngineError.
ERROR_TYPES: dict[str, type[EngineError]] = {
    cls.__name__: cls
    for cls in (
        EngineError,
        ConfigError,
        RequestError,
        PoolExhaustedError,
        EngineDeadError,
        RequestFailedError,
        AdapterError,
        AdapterNotFoundError,
        AdapterFormatError,
        UnsupportedAdapterError,
        AdapterMismatchError,
        AdapterBusyError,
        UnknownAdapterError,
        GrammarError,
    )
}


class WireError(msgspec.Struct, frozen=True, array_like=True):
    kind: str
    """The error's class name."""
    message: str


def to_wire(error: BaseException) -> WireError:
    return WireError(type(error).__name__, str(error))


def from_wire(error: WireError) -> EngineError:
    """The engine error that ``error`` was, of the same class when it is one of ``ERROR_TYPES``."""
    cls = ERROR_TYPES.get(error.kind)
    if cls is None:
        return EngineError(f"the engine worker failed: {error.kind}: {error.message}")
    return cls(error.message)


class AdapterSummary(msgspec.Struct, frozen=True, array_like=True):
    """What validating a PEFT folder found (its tensors stay in the worker)."""

    digest: str
    rank: int
    """The largest rank over the adapter's modules."""
    alpha: float
    target_modules: tuple[str, ...]
    size_bytes: int


# Commands: client to worker ---------------------------------------------------------------------------


class Submit(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """Start a request; its outputs come in StepOutputs, or a Rejected says why it could not start."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None
    tenant: str | None
    weight: float
    """The tenant's fair-share weight (applied when it changed since the tenant's previous request)."""


class Abort(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """Stop a request and free its pages; nothing more is sent for it (its client has gone)."""

    request_id: str


class AbortAll(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """End every running request now; each gets its last output, finish reason "abort"."""


class AbortRequests(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """End these requests now (those still running): each gets its last output, finish reason "abort".

    AbortAll for one client among several (gateways sharing Ray replicas end only their own requests).
    """

    request_ids: list[str]


class Shutdown(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """End every running request (as AbortAll), stop the step loop and exit."""


class AddAdapter(msgspec.Struct, frozen=True, array_like=True, tag=True):
    call_id: int
    name: str
    path: str


class RemoveAdapter(msgspec.Struct, frozen=True, array_like=True, tag=True):
    call_id: int
    name: str


class PinAdapter(msgspec.Struct, frozen=True, array_like=True, tag=True):
    call_id: int
    name: str
    pinned: bool


class ValidateAdapter(msgspec.Struct, frozen=True, array_like=True, tag=True):
    call_id: int
    path: str


class GetStats(msgspec.Struct, frozen=True, array_like=True, tag=True):
    call_id: int


class SetTenantWeight(msgspec.Struct, frozen=True, array_like=True, tag=True):
    call_id: int
    tenant: str
    weight: float


class CheckConstraint(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """Compile a structured-output constraint (cached, so the request that uses it finds it compiled)."""

    call_id: int
    constraint: GrammarConstraint


Call = AddAdapter | RemoveAdapter | PinAdapter | ValidateAdapter | GetStats | SetTenantWeight | CheckConstraint
Command = Submit | Abort | AbortAll | AbortRequests | Shutdown | Call


# Events: worker to client -----------------------------------------------------------------------------


class Ready(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """The engine is built and takes commands."""

    max_model_len: int
    vocab_size: int


class Rejected(msgspec.Struct, frozen=True, array_like=True):
    """A submitted request that could not start (too long, an unknown adapter, a bad grammar...)."""

    request_id: str
    error: WireError


class StepOutputs(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """Every output of one engine step (or of an abort of all), and the requests refused since the previous one."""

    outputs: list[OutputDelta]
    rejected: list[Rejected]


class Reply(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """The result of one call (None when it has none), or its error."""

    call_id: int
    result: Any
    error: WireError | None


class LogLine(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """A record of the worker's log, for the client's log."""

    logger: str
    level: int
    message: str


class Fatal(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """The worker cannot go on (its engine did not start, or its step loop died); it exits after this."""

    error: WireError


Event = Ready | StepOutputs | Reply | LogLine | Fatal

_encoder = msgspec.msgpack.Encoder()
_commands = msgspec.msgpack.Decoder(Command)
_events = msgspec.msgpack.Decoder(Event)


def frame(message: msgspec.Struct) -> bytes:
    """``message`` (a Command, an Event, or another message on a byte stream) as one frame: its length, its body."""
    body = _encoder.encode(message)
    return len(body).to_bytes(FRAME_HEADER_BYTES, "big") + body


def frame_size(header: bytes | bytearray | memoryview) -> int:
    """The body's length from a frame's first ``FRAME_HEADER_BYTES``."""
    return int.from_bytes(header[:FRAME_HEADER_BYTES], "big")


def decode_command(body: bytes | memoryview) -> Command:
    return _commands.decode(body)


def decode_event(body: bytes | memoryview) -> Event:
    return _events.decode(body)
