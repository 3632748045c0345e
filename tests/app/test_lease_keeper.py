"""The lease keeper's close never waits past its bound for a renewal that does not end."""

import asyncio
import time
import uuid

import pytest

from app.limits.leases import Lease, LeaseKeeper

pytestmark = pytest.mark.anyio


async def test_close_waits_its_bound_at_most_for_a_renewal_that_ignores_its_cancellation() -> None:
    started = asyncio.Event()
    release = asyncio.Event()

    async def stubborn_renew(leases: list[Lease]) -> None:
        started.set()
        while not release.is_set():  # a call that swallows its cancellation, as a stuck client may
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue
        raise asyncio.CancelledError  # released: the task ends as its cancellation would have ended it

    keeper = LeaseKeeper(stubborn_renew, ttl_s=0.03)
    keeper.add(Lease("lease", uuid.uuid4(), ("leases",), frozenset({"concurrency"})))
    await asyncio.wait_for(started.wait(), 5)
    begun = time.monotonic()
    await keeper.close(0.2)
    assert 0.15 <= time.monotonic() - begun < 2.0
    release.set()  # let the renewal end, so the test leaves no task behind
    await asyncio.sleep(0.05)
    assert not [task for task in asyncio.all_tasks() if task.get_name() == "lease-renewals"]


async def test_close_of_a_keeper_that_renews_nothing_returns_at_once() -> None:
    renewed: list[int] = []

    async def renew(leases: list[Lease]) -> None:
        renewed.append(len(leases))

    keeper = LeaseKeeper(renew, ttl_s=30.0)
    begun = time.monotonic()
    await keeper.close(5.0)  # no lease was ever added: no task to stop
    keeper.add(Lease("lease", uuid.uuid4(), ("leases",), frozenset({"concurrency"})))
    await keeper.close(5.0)  # the task sleeps until its first renewal: cancelled at once
    assert time.monotonic() - begun < 1.0 and renewed == []
