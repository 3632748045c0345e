"""The limits' state in Redis, shared by every gateway replica (``LORAPLEX_REDIS_URL``).

Each operation is one Lua script call (redis_scripts.py), registered once and sent by digest (EVALSHA,
loaded again if the server lost it): an admission looks at and charges both levels of a request at once,
a settle lowers its token charge and corrects its budget reservation, and a renewal keeps the leases of
running requests alive (leases.py). The month's budget counter is seeded from ``usage_events`` by the
first replica that finds it missing: the script answers "missing", the replica reads the table (one
query for all the requests that need it, budget.py) and asks again with the number.

The routes settle and read headers synchronously, so a settle is sent as a task; the next admission of
the same tenant on this replica waits for the tenant's settles still under way, so a replica always sees
its own settles (another replica sees them a round trip later). Headers come from the replies (redis_views.py).

When Redis cannot be reached, each limit does what its policy says (backend_failure.py). A settle that
does not reach Redis leaves the request's tokens charged as reserved (at most a minute for the minute
window; for the budget, until the month ends: the safe side) and its lease lapses after the TTL.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from redis.asyncio import Redis
from redis.exceptions import RedisError

from app.limits.backend_failure import BackendFailures, kinds_of
from app.limits.budget import UsageLoader, UsageReads
from app.limits.leases import Lease, LeaseKeeper
from app.limits.limits import Limits
from app.limits.redis_scripts import ADMIT, KEYS_PER_LEVEL, LEASES_INDEX, RENEW, SETTLE, level_keys
from app.limits.redis_views import Observed, SeenWindows
from app.limits.store import NOTHING_SEEN, Ask, Month, Seen, Settle, WindowView
from app.limits.window import WINDOW_S

logger = logging.getLogger(__name__)

LEASE_TTL_S = 30.0  # a crashed replica's slots come back within this; renewed every 10 s while they run
USAGE_REUSE_S = 10.0  # a month read from usage_events also seeds the requests that learn it is missing within 10 s
MONTH_KEEP_S = 7 * 86_400  # a month's counter outlives the month by a week: long runs that straddle it settle there
STORE_ERRORS = (RedisError, OSError)  # OSError: a socket error redis-py did not wrap
NO_LIMIT = -1
CLOSE_WAIT_S = 5.0  # how long a closing store waits for its settles (one script each: milliseconds when Redis answers)
ADMIT_FIELDS = 8  # per level in the admission's reply: requests, their wait, tokens, theirs, running, used, newest x2
SETTLE_FIELDS = 4  # per level in the settle's reply: requests, newest, tokens, newest


class RedisStore:
    """The limits' state in Redis; see the module docstring.

    ``clock`` (seconds), when given, replaces Redis's clock in the scripts (tests move time without sleeping).
    """

    def __init__(
        self,
        client: Redis,
        load_usage: UsageLoader,
        failures: BackendFailures,
        *,
        clock: Callable[[], float] | None = None,
        lease_ttl_s: float = LEASE_TTL_S,
    ) -> None:
        self._client = client
        self._admit = client.register_script(ADMIT)
        self._settle = client.register_script(SETTLE)
        self._renew = client.register_script(RENEW)
        self._reads = UsageReads(load_usage, reuse_s=USAGE_REUSE_S)
        self._failures = failures
        self._clock = clock
        self._lease_ttl_s = lease_ttl_s
        self._seen = SeenWindows(clock)
        self._leases = LeaseKeeper(self._renew_leases, lease_ttl_s)
        self._settling: dict[uuid.UUID, set[asyncio.Task[None]]] = {}

    async def ping(self) -> bool:
        """Whether Redis answers now (logged either way: the gateway calls it once at its start)."""
        try:
            await self._client.ping()
        except STORE_ERRORS as error:
            logger.warning("the limits store (Redis) does not answer (%s); limits apply their failure policy", error)
            return False
        logger.info("limits shared by the replicas through Redis")
        return True

    async def take(self, asks: Sequence[Ask], num_tokens: int, month: Month) -> tuple[list[Seen], Settle | None]:
        tenant_id = asks[0].tenant_id
        kinds = set().union(*(kinds_of(ask.limits) for ask in asks))
        if self._failures.is_down:  # settles still try Redis (off the request path); admissions do not wait
            self._failures.admit_anyway(kinds)
            return [NOTHING_SEEN] * len(asks), _nothing
        await self._settled(tenant_id)
        charge = _Charge(uuid.uuid4().hex, tenant_id, [ask.level_id for ask in asks], keys_of(asks, month), kinds)
        try:
            reply = await self._admit_seeded(charge, asks, num_tokens, month)
        except asyncio.CancelledError:  # the script may have run: take back whatever it charged
            self._send_settle(charge, 0, undo=True)
            raise
        except STORE_ERRORS as error:
            self._failures.failed(error)
            self._failures.admit_anyway(kinds)
            return [NOTHING_SEEN] * len(asks), _nothing
        fields = reply.split()
        admitted, at = fields[0] == b"1", float(fields[1])
        levels = [fields[i : i + ADMIT_FIELDS] for i in range(2, len(fields), ADMIT_FIELDS)]
        seen = [_seen_of(level) for level in levels]
        local_at = time.monotonic()
        for level_id, level, level_seen in zip(charge.level_ids, levels, seen, strict=True):
            observed = Observed(
                at,
                local_at,
                level_seen.num_requests,
                _time_or_none(level[6]),
                level_seen.num_tokens,
                _time_or_none(level[7]),
            )
            if admitted:  # the reply says what was there before; the headers show the request in it
                observed.num_requests, observed.num_tokens = observed.num_requests + 1, observed.num_tokens + num_tokens
                observed.newest_request_at = observed.newest_token_at = at
            self._seen.observe(level_id, observed)
        if not admitted:
            return seen, None
        lease_keys = tuple(charge.keys[LEASES_INDEX::KEYS_PER_LEVEL])
        self._leases.add(Lease(charge.lease_id, tenant_id, lease_keys, frozenset(kinds)))
        return seen, partial(self._settle_admission, charge, at, num_tokens)

    async def _admit_seeded(self, charge: _Charge, asks: Sequence[Ask], num_tokens: int, month: Month) -> bytes:
        """The admission script's reply, after seeding the month's counters it found missing from ``usage_events``."""
        month_ttl_s = int((month.end - month.now).total_seconds()) + MONTH_KEEP_S
        recorded: dict[int, int] = {}
        while True:
            args = [self._now_arg(), WINDOW_S, charge.lease_id, num_tokens, self._lease_ttl_s]
            for index, ask in enumerate(asks):
                args += [*_limit_args(ask.limits), recorded.get(index, ""), month_ttl_s]
            reply = await self._admit(keys=charge.keys, args=args)
            if not reply.startswith(b"missing"):
                return reply
            for index in map(int, reply.split()[1:]):
                ask = asks[index]
                recorded[index] = await self._reads.read(ask.tenant_id, ask.key_id, month.start, month.end)

    def _settle_admission(self, charge: _Charge, charged_at: float, num_tokens: int, num_tokens_used: int) -> None:
        """The settle of an admission: its lease stops being renewed, the headers lower at once, Redis follows."""
        self._leases.remove(charge.lease_id)
        if num_tokens_used < num_tokens:
            for level_id in charge.level_ids:
                self._seen.lower_tokens(level_id, charged_at, num_tokens - num_tokens_used)
        self._send_settle(charge, num_tokens_used, undo=False)

    def view(self, ask: Ask) -> WindowView:
        return self._seen.view(ask.level_id)

    async def close(self) -> None:
        """Stop renewing leases, wait for the settles under way (CLOSE_WAIT_S at most), close the connections.

        A settle Redis does not take by then is cancelled and counted lost (its lease lapses after its TTL):
        a gateway's shutdown must not wait on a Redis that stopped answering.
        """
        await self._leases.close(CLOSE_WAIT_S)
        pending = [task for tasks in self._settling.values() for task in tasks]
        if pending:
            _, unfinished = await asyncio.wait(pending, timeout=CLOSE_WAIT_S)
            for task in unfinished:
                task.cancel()  # each counts itself lost (_settle_in_redis)
            if unfinished:
                await asyncio.wait(unfinished, timeout=CLOSE_WAIT_S)
                logger.warning("%d settles did not reach Redis within %.0f s of closing", len(unfinished), CLOSE_WAIT_S)
        # Not wait_for: on its timeout it waits for the call to take its cancellation, which may never come.
        closing = asyncio.ensure_future(self._client.aclose())
        _, unfinished = await asyncio.wait({closing}, timeout=CLOSE_WAIT_S)
        error = None if unfinished else closing.exception()
        if unfinished or isinstance(error, STORE_ERRORS):
            closing.cancel()
            logger.warning("closing the Redis connections did not finish within %.0f s", CLOSE_WAIT_S)
        elif error is not None:
            raise error

    async def _settled(self, tenant_id: uuid.UUID) -> None:
        """Wait for this replica's settles of the tenant still under way (usually none)."""
        pending = self._settling.get(tenant_id)
        if pending:
            await asyncio.wait(set(pending))

    def _send_settle(self, charge: _Charge, num_tokens_used: int, *, undo: bool) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # settled outside the loop (a generator finalized late): the lease lapses
            self._failures.lost("settle", charge.kinds)
            return
        task = loop.create_task(self._settle_in_redis(charge, num_tokens_used, undo))
        self._settling.setdefault(charge.tenant_id, set()).add(task)
        task.add_done_callback(lambda done: self._forget(charge.tenant_id, done))

    def _forget(self, tenant_id: uuid.UUID, task: asyncio.Task[None]) -> None:
        pending = self._settling.get(tenant_id)
        if pending is not None:
            pending.discard(task)
            if not pending:
                del self._settling[tenant_id]

    async def _settle_in_redis(self, charge: _Charge, num_tokens_used: int, undo: bool) -> None:
        args = [self._now_arg(), WINDOW_S, charge.lease_id, num_tokens_used, "1" if undo else "0"]
        try:
            reply = await self._settle(keys=charge.keys, args=args)
        except STORE_ERRORS as error:
            self._failures.failed(error)
            self._failures.lost("settle", charge.kinds)
            return
        except asyncio.CancelledError:  # close() gave up waiting for it
            self._failures.lost("settle", charge.kinds)
            raise
        fields = reply.split()
        at, local_at = float(fields[0]), time.monotonic()
        levels = [fields[i : i + SETTLE_FIELDS] for i in range(1, len(fields), SETTLE_FIELDS)]
        for level_id, level in zip(charge.level_ids, levels, strict=True):
            num_requests, num_tokens = int(level[0]), int(level[2])
            observed = Observed(
                at, local_at, num_requests, _time_or_none(level[1]), num_tokens, _time_or_none(level[3])
            )
            self._seen.observe(level_id, observed)

    async def _renew_leases(self, leases: list[Lease]) -> None:
        keys = [key for lease in leases for key in lease.keys]
        lease_ids = [lease.lease_id for lease in leases for _ in lease.keys]
        try:
            await self._renew(keys=keys, args=[self._now_arg(), WINDOW_S, self._lease_ttl_s, *lease_ids])
        except STORE_ERRORS as error:
            self._failures.failed(error)
            self._failures.lost("lease renewal", set().union(*(lease.kinds for lease in leases)))

    def _now_arg(self) -> float | str:
        """The scripts' first argument: the time, or empty for Redis's own clock."""
        return "" if self._clock is None else self._clock()


@dataclass(frozen=True, slots=True)
class _Charge:
    """One admission's identity in Redis: its lease id is its member in every window and lease set."""

    lease_id: str
    tenant_id: uuid.UUID
    level_ids: list[tuple[uuid.UUID, uuid.UUID | None]]
    keys: list[str]
    """Every level's keys, one level after the other (redis_scripts.level_keys)."""
    kinds: set[str]


def keys_of(asks: Sequence[Ask], month: Month) -> list[str]:
    return [key for ask in asks for key in level_keys(ask, month.start)]


def _nothing(num_tokens_used: int) -> None:
    """The settle of a request let in without Redis: nothing was charged."""


def _limit_args(limits: Limits) -> list[int]:
    values = (
        limits.max_requests_per_minute,
        limits.max_tokens_per_minute,
        limits.max_concurrent,
        limits.max_tokens_per_month,
    )
    return [NO_LIMIT if value is None else value for value in values]


def _seen_of(level: list[bytes]) -> Seen:
    num_requests, requests_wait, num_tokens, tokens_wait, num_running, num_used = level[:6]
    return Seen(
        num_requests=int(num_requests),
        requests_wait_s=float(requests_wait),
        num_tokens=int(num_tokens),
        tokens_wait_s=float(tokens_wait),
        num_running=int(num_running),
        num_month_used=None if int(num_used) == NO_LIMIT else int(num_used),
    )


def _time_or_none(value: bytes) -> float | None:
    return None if value == b"-" else float(value)
