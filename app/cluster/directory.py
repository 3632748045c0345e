"""The engine workers' directory: one Ray actor that reaches every replica, which Serve's handles cannot.

A Serve handle sends each call to ONE replica, but removing an adapter, pinning one, ending every request
and reading each worker's gauges must reach them ALL. Each replica joins the directory when it starts and
long-polls it for commands (``engine/drivers/worker_protocol.py`` messages, as bytes); :meth:`EngineDirectory.broadcast`
queues a command for every live replica and returns each one's :class:`Reply`. A replica that has not
polled for ``LIVENESS_S`` is dropped (it died; Serve starts another, which joins afresh). Pins are kept
here as well, so a replica that joins later (a restart, a scale-up) pins the same adapters.

Ray restarts the directory when its process dies (``max_restarts=-1``). The replicas find out at their
next poll and join again; the pins, which nobody would announce again, are kept in Ray's key-value store
(held by the cluster's control store, GCS) and read back by the restarted directory. A directory created
afresh (a new cluster, or the first gateway after one was removed) starts with none.

Gateways that join a cluster also claim here the right to deploy the engine app
(:meth:`EngineDirectory.claim_deployment`), so that two of them starting at once deploy it once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import ray
from ray.experimental import internal_kv

logger = logging.getLogger(__name__)

DIRECTORY_NAME = "loraplex-engine-directory"
DIRECTORY_NAMESPACE = "loraplex"
POLL_S = 1.0  # a replica's long poll returns after this with no commands, proving it is alive
LIVENESS_S = 5.0  # a replica silent for this long is taken for dead
BROADCAST_TIMEOUT_S = 60.0  # most a broadcast waits for a live replica's reply
PINS_NAMESPACE = "loraplex-engine-directory-pins"  # Ray's key-value store: digest -> its PinAdapter command


@dataclass(slots=True)
class _Member:
    pid: int
    seen: float
    inbox: list[tuple[int, bytes]] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)


@ray.remote(num_cpus=0, max_restarts=-1)
class EngineDirectory:
    """Who the engine replicas are, what each must do next, and the adapters every one of them pins."""

    def __init__(self, pins_namespace: str = PINS_NAMESPACE) -> None:
        """``pins_namespace``: where in Ray's key-value store the pins outlive this actor's process."""
        self._members: dict[str, _Member] = {}
        self._seq = 0
        self._replies: dict[int, dict[str, bytes]] = {}
        self._replied = asyncio.Condition()
        self._pins_namespace = pins_namespace
        self._pins: dict[str, bytes] = {}  # digest -> the PinAdapter command a joining replica replays
        self._deployer: tuple[str, float] | None = None  # the gateway deploying the engine app, until (monotonic)
        if ray.get_runtime_context().was_current_actor_reconstructed:
            for key in internal_kv._internal_kv_list(b"", namespace=pins_namespace):
                self._pins[key.decode()] = internal_kv._internal_kv_get(key, namespace=pins_namespace)
            logger.info("engine directory restarted: %d pins read back", len(self._pins))
        else:
            internal_kv._internal_kv_del(b"", del_by_prefix=True, namespace=pins_namespace)

    async def join(self, replica_id: str, pid: int) -> list[bytes]:
        """Register a replica; the pin commands it must apply before it serves."""
        self._members[replica_id] = _Member(pid, time.monotonic())
        logger.info("engine replica %s (pid %d) joined", replica_id, pid)
        return list(self._pins.values())

    async def claim_deployment(self, gateway_id: str, lease_s: float) -> bool:
        """Whether ``gateway_id`` may deploy the engine app now: no other gateway claimed it in the last ``lease_s``.

        A claim lasts ``lease_s`` (the claimant's deployment shows in Serve's status well before), so a gateway
        that died before deploying holds no one up for long.
        """
        now = time.monotonic()
        if self._deployer is not None and self._deployer[0] != gateway_id and now < self._deployer[1]:
            return False
        self._deployer = (gateway_id, now + lease_s)
        return True

    async def release_deployment(self, gateway_id: str) -> None:
        """``gateway_id`` deployed the engine app (or failed to): another gateway may claim it at once."""
        if self._deployer is not None and self._deployer[0] == gateway_id:
            self._deployer = None

    async def leave(self, replica_id: str) -> None:
        self._members.pop(replica_id, None)
        async with self._replied:
            self._replied.notify_all()

    async def members(self) -> dict[str, int]:
        """The live replicas' ids and process ids."""
        self._drop_silent()
        return {replica_id: member.pid for replica_id, member in self._members.items()}

    async def next_commands(self, replica_id: str) -> list[tuple[int, bytes]] | None:
        """The commands queued for a replica, waiting up to ``POLL_S`` for one; None if it must join again."""
        member = self._members.get(replica_id)
        if member is None:
            return None
        member.seen = time.monotonic()
        if not member.inbox:
            member.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(member.wake.wait(), POLL_S)
        member.seen = time.monotonic()
        commands, member.inbox = member.inbox, []
        return commands

    async def reply(self, replica_id: str, seq: int, reply: bytes) -> None:
        replies = self._replies.get(seq)
        if replies is not None:
            replies[replica_id] = reply
            async with self._replied:
                self._replied.notify_all()

    async def broadcast(self, command: bytes, pin: tuple[str, bool] | None = None) -> dict[str, bytes]:
        """Send ``command`` to every live replica; each one's reply by replica id (a dead one's is missing).

        ``pin`` (digest, pinned) records a pin change (or a removal: not pinned) for replicas that join later.
        """
        if pin is not None:
            digest, pinned = pin
            if pinned:
                self._pins[digest] = command
                internal_kv._internal_kv_put(digest, command, namespace=self._pins_namespace)
            else:
                self._pins.pop(digest, None)
                internal_kv._internal_kv_del(digest, namespace=self._pins_namespace)
        self._drop_silent()
        self._seq += 1
        seq = self._seq
        replies: dict[str, bytes] = {}
        self._replies[seq] = replies
        targets = set(self._members)  # a replica that joins meanwhile gets the state at join, not this command
        for member in self._members.values():
            member.inbox.append((seq, command))
            member.wake.set()
        deadline = time.monotonic() + BROADCAST_TIMEOUT_S
        try:
            async with self._replied:
                while not self._answered(replies, targets) and time.monotonic() < deadline:
                    try:
                        await asyncio.wait_for(self._replied.wait(), POLL_S)
                    except TimeoutError:
                        self._drop_silent()
        finally:
            del self._replies[seq]
        return replies

    def _answered(self, replies: dict[str, bytes], targets: set[str]) -> bool:
        return all(replica_id in replies for replica_id in targets if replica_id in self._members)

    def _drop_silent(self) -> None:
        now = time.monotonic()
        for replica_id, member in list(self._members.items()):
            if now - member.seen > LIVENESS_S:
                del self._members[replica_id]
                logger.warning("engine replica %s was silent for %.0f s; taken for dead", replica_id, LIVENESS_S)
