"""What crosses a replica's output connection to a gateway, beside the engine's own messages.

A gateway listens on its node (``output_inbox.py``) and names itself in every request it sends through
Serve as an :class:`InboxAddress`. A replica that runs one of its requests connects there once
(``output_links.py``), says :class:`Hello` with the gateway's token, then sends one ``StepOutputs`` frame
per engine step holding every output of that gateway's requests on the replica; the gateway sends
``Abort`` frames back for requests its callers left. The Serve call of a request returns when the request
has ended, as a :class:`RunEnded`.
"""

from __future__ import annotations

import msgspec

from engine.drivers.worker_protocol import WireError


class InboxAddress(msgspec.Struct, frozen=True, array_like=True):
    """Where a gateway takes its replicas' outputs: its node's address, a port, and the token a replica proves."""

    host: str
    port: int
    token: str


class Hello(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """A replica's first frame on a new connection."""

    token: str
    replica_id: str


class RunEnded(msgspec.Struct, frozen=True, array_like=True):
    """How a request's Serve call ended: after its last output was sent (no error), or refused or cut off."""

    replica_id: str
    error: WireError | None
