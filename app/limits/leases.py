"""Keeps the Redis leases of this replica's running requests alive.

A concurrency slot in Redis is a lease that expires ``ttl_s`` after it was last renewed, so the slots of
a replica that crashed (and never settled its requests) come back by themselves. A live replica renews
all its leases every third of the TTL, one script call per tenant (a tenant's keys share a slot), so a
lease survives two missed renewals before it lapses. The task starts with the first lease, not before.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

RENEWALS_PER_TTL = 3


@dataclass(frozen=True, slots=True)
class Lease:
    """A running request's slot on each of its levels."""

    lease_id: str
    tenant_id: uuid.UUID
    keys: tuple[str, ...]
    """The ``leases`` sorted set of each level."""
    kinds: frozenset[str]
    """The kinds of limit its levels have (for counting a renewal that failed)."""


Renew = Callable[[list[Lease]], Awaitable[None]]
"""Renews leases of one tenant; handles its own errors."""


class LeaseKeeper:
    """The live leases of this replica and the task that renews them every ``ttl_s / 3`` seconds."""

    def __init__(self, renew: Renew, ttl_s: float) -> None:
        self._renew = renew
        self._interval_s = ttl_s / RENEWALS_PER_TTL
        self._live: dict[str, Lease] = {}
        self._task: asyncio.Task[None] | None = None

    def add(self, lease: Lease) -> None:
        self._live[lease.lease_id] = lease
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="lease-renewals")

    def remove(self, lease_id: str) -> None:
        self._live.pop(lease_id, None)

    async def close(self, wait_s: float) -> None:
        """Stop renewing: the leases still live lapse after the TTL unless they are settled. Waits ``wait_s`` at
        most for a renewal under way to end (``asyncio.wait`` never waits past its timeout for a task to take
        its cancellation, so a Redis call that does not end holds up no shutdown)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            _, unfinished = await asyncio.wait({task}, timeout=wait_s)
            if unfinished:
                logger.warning("a lease renewal did not end within %.0f s of closing", wait_s)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            by_tenant: dict[uuid.UUID, list[Lease]] = defaultdict(list)
            for lease in self._live.values():
                by_tenant[lease.tenant_id].append(lease)
            for leases in by_tenant.values():
                try:
                    await self._renew(leases)
                except Exception:  # the renewals must go on for the other tenants, and next time
                    logger.exception("renewing %d leases failed", len(leases))
