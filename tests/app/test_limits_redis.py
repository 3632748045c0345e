"""What only the Redis store does: replicas that share limits, leases that lapse, outages, Cluster-ready keys.

Each "replica" is a Limiter with a Redis store and a client of its own, on one real redis-server, on
Redis's own clock (the semantics shared with the in-process store are tested in test_limits.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
import redis
from redis.crc import key_slot

from app.limits import redis_store
from app.limits.backend_failure import BackendFailures, FailurePolicy
from app.limits.factory import failure_policy, open_limiter, redis_client
from app.limits.limiter import Admission, Limiter
from app.limits.limits import Limits
from app.limits.redis_store import RedisStore
from app.observability.metrics import GatewayMetrics
from app.settings import Settings, SettingsError
from app.web.errors import InsufficientQuotaError, RateLimitError, ServiceUnavailableError
from tests.app.redis_server import RedisServer, real_redis
from tests.app.test_limits import KEY_A, TENANT_ID, FakeUsage, caller, refused

pytestmark = pytest.mark.anyio

SHORT_TTL_S = 0.5  # leases that lapse quickly, renewed every ~0.17 s while their replica lives
RETRY_S = 0.05  # how long a replica leaves a failed Redis alone, shortened for the outage tests
SETTLE_WAIT_S = 5.0  # a settle reaches Redis in milliseconds; this is for a machine busy with other tests


class Replicas:
    """Limiters on one Redis, each with its own client, closed together."""

    def __init__(self, url: str, usage: FakeUsage) -> None:
        self.url = url
        self.usage = usage
        self.metrics = GatewayMetrics()
        self._limiters: list[Limiter] = []

    def start(self, policy: FailurePolicy | None = None, lease_ttl_s: float = 30.0) -> Limiter:
        failures = BackendFailures(policy or FailurePolicy(), self.metrics.limit_backend_errors, retry_after_s=RETRY_S)
        store = RedisStore(redis_client(self.url, 2.0), self.usage, failures, lease_ttl_s=lease_ttl_s)
        limiter = Limiter(store)
        self._limiters.append(limiter)
        return limiter

    def errors(self, limit: str, outcome: str) -> float:
        labels = {"limit": limit, "outcome": outcome}
        return self.metrics.registry.get_sample_value("loraplex_limit_backend_errors_total", labels) or 0.0

    async def close(self) -> None:
        for limiter in self._limiters:
            await limiter.close()


@pytest.fixture
async def replicas(redis_url: str) -> AsyncIterator[Replicas]:
    started = Replicas(redis_url, FakeUsage())
    yield started
    await started.close()


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A Redis of the test's own, to stop and start (the session's stays up for the others)."""
    with real_redis() as server:
        yield server


async def admitted(limiter: Limiter, principal, num_prompt: int = 1, max_tokens: int = 1) -> Admission | None:
    try:
        return await limiter.admit(principal, num_prompt, max_tokens)
    except (RateLimitError, InsufficientQuotaError):
        return None


async def admitted_soon(limiter: Limiter, principal, num_prompt: int = 1, max_tokens: int = 1) -> Admission:
    """Admitted once another replica's settle has reached Redis (it goes as a task, a round trip later)."""
    deadline = time.monotonic() + SETTLE_WAIT_S
    while (admission := await admitted(limiter, principal, num_prompt, max_tokens)) is None:
        assert time.monotonic() < deadline, "still refused: the other replica's settle never reached Redis"
        await asyncio.sleep(0.01)
    return admission


async def test_two_replicas_let_through_no_more_than_the_rpm_together(replicas) -> None:
    first, second = replicas.start(), replicas.start()
    principal = caller(Limits(max_requests_per_minute=10))
    results = await asyncio.gather(*(admitted((first, second)[i % 2], principal) for i in range(30)))
    assert sum(result is not None for result in results) == 10
    error = await refused(second, principal)
    assert "Limit 10, Used 10" in error.message and 59 < error.retry_after_s <= 60


async def test_the_concurrency_limit_holds_across_replicas(replicas) -> None:
    first, second = replicas.start(), replicas.start()
    principal = caller(Limits(max_concurrent=2))
    running = [await first.admit(principal, 1, 1), await second.admit(principal, 1, 1)]
    for limiter in (first, second):
        assert "Limit 2, Running 2" in (await refused(limiter, principal)).message
    running[0].settle(2)  # settled on the first replica, taken on the second
    await admitted_soon(second, principal)
    await refused(first, principal)


async def test_a_stopped_replicas_lease_lapses_after_the_ttl_and_a_live_ones_does_not(replicas) -> None:
    crashing, live, other = (replicas.start(lease_ttl_s=SHORT_TTL_S) for _ in range(3))
    principal = caller(Limits(max_concurrent=1))
    key_principal = caller(Limits(max_concurrent=5), Limits(max_concurrent=1), tenant_id=uuid.uuid4())
    await crashing.admit(principal, 1, 1)  # never settled: its replica stops renewing below
    held = await live.admit(key_principal, 1, 1)
    await crashing.close()
    started = time.monotonic()
    while await admitted(other, principal) is None:
        assert time.monotonic() - started < 5 * SHORT_TTL_S, "the stopped replica's lease never lapsed"
        await asyncio.sleep(0.05)
    assert time.monotonic() - started >= SHORT_TTL_S * 0.8  # it lapsed, it was not freed at once
    await asyncio.sleep(3 * SHORT_TTL_S)  # the live replica renews its lease meanwhile
    assert "Running 1" in (await refused(other, key_principal)).message
    held.settle(2)
    await admitted_soon(other, key_principal)


async def test_a_budget_is_read_once_and_shared_by_the_replicas(replicas) -> None:
    replicas.usage.recorded[(TENANT_ID, None)] = 900
    first, second = replicas.start(), replicas.start()
    principal = caller(Limits(max_tokens_per_month=1000))
    running = await first.admit(principal, 50, 40)  # 990 of 1000
    error = await refused(second, principal, 5, 10)
    assert "used 990 of its 1000 tokens" in error.message
    running.settle(50 + 30)  # 980: the second replica's next 15 fit only once this reached Redis
    (await admitted_soon(second, principal, 5, 10)).settle(15)
    await refused(first, principal, 5, 1)
    await first.admit(principal, 2, 3)  # exactly 1000
    assert len(replicas.usage.reads) == 1


async def test_keys_of_a_tenant_and_its_keys_share_one_hash_tag(replicas, redis_url) -> None:
    limiter = replicas.start()
    limits = Limits(max_requests_per_minute=5, max_tokens_per_minute=500, max_concurrent=3, max_tokens_per_month=900)
    running = await limiter.admit(caller(limits, limits), 10, 10)
    with redis.Redis.from_url(redis_url) as client:
        keys = [key.decode() for key in client.scan_iter("*")]
    assert len(keys) == 12  # six per level: requests, tokens, their amounts and total, leases, the month's budget
    assert all(f"{{tenant:{TENANT_ID}}}" in key for key in keys)
    assert len({key_slot(key.encode()) for key in keys}) == 1
    assert sum(f"key:{KEY_A}" in key for key in keys) == 6
    running.settle(15)


async def test_while_redis_is_down_rate_and_concurrency_fail_open_and_the_budget_closed(own_redis) -> None:
    own_redis.stop()
    replicas = Replicas(own_redis.url, FakeUsage())
    limiter = replicas.start()
    try:
        rate = caller(Limits(max_requests_per_minute=1, max_concurrent=1))
        for _ in range(3):  # over both limits, unchecked
            (await limiter.admit(rate, 1, 1)).settle(2)
        assert limiter.headers(rate)["x-ratelimit-remaining-requests"] == "1"  # nothing seen, nothing shown
        with pytest.raises(ServiceUnavailableError) as caught:
            await limiter.admit(caller(Limits(max_tokens_per_month=10**6), tenant_id=uuid.uuid4()), 1, 1)
        assert caught.value.status == 503 and "budget" in caught.value.message and "Redis" in caught.value.message
        assert replicas.errors("rate", "open") == 3 and replicas.errors("concurrency", "open") == 3
        assert replicas.errors("budget", "closed") == 1 and replicas.errors("rate", "closed") == 0
    finally:
        await replicas.close()


async def test_policies_are_per_limit_and_redis_coming_back_is_used_again(own_redis) -> None:
    replicas = Replicas(own_redis.url, FakeUsage())
    limiter = replicas.start(FailurePolicy(rate_open=False, concurrency_open=True, budget_open=True))
    try:
        principal = caller(Limits(max_requests_per_minute=2))
        await limiter.admit(principal, 1, 1)
        own_redis.stop()
        with pytest.raises(ServiceUnavailableError):
            await limiter.admit(principal, 1, 1)
        (await limiter.admit(caller(Limits(max_concurrent=1, max_tokens_per_month=1)), 5, 5)).settle(10)
        assert replicas.errors("rate", "closed") == 1
        assert replicas.errors("concurrency", "open") == 1 and replicas.errors("budget", "open") == 1
        own_redis.start()  # empty again: the request before the outage is forgotten
        await _eventually(lambda: limiter.admit(principal, 1, 1))
        await limiter.admit(principal, 1, 1)
        assert "Limit 2, Used 2" in (await refused(limiter, principal)).message  # checked in Redis again
    finally:
        await replicas.close()


async def test_a_settle_redis_does_not_take_is_counted_as_lost(own_redis) -> None:
    replicas = Replicas(own_redis.url, FakeUsage())
    limiter = replicas.start()
    try:
        admission = await limiter.admit(caller(Limits(max_concurrent=4)), 1, 1)
        own_redis.stop()
        admission.settle(2)
        deadline = time.monotonic() + SETTLE_WAIT_S
        while replicas.errors("concurrency", "lost") == 0:
            assert time.monotonic() < deadline, "the lost settle was not counted"
            await asyncio.sleep(0.01)
        assert replicas.errors("concurrency", "lost") == 1
    finally:
        await replicas.close()


async def test_closing_gives_up_on_settles_a_frozen_redis_does_not_answer(own_redis, monkeypatch) -> None:
    monkeypatch.setattr(redis_store, "CLOSE_WAIT_S", 0.2)  # the client's own timeout is 2 s (Replicas.start)
    replicas = Replicas(own_redis.url, FakeUsage())
    limiter = replicas.start()
    admission = await limiter.admit(caller(Limits(max_concurrent=4)), 1, 1)
    own_redis.freeze()
    try:
        admission.settle(2)
        started = time.monotonic()
        await replicas.close()
        closed_in = time.monotonic() - started
    finally:
        own_redis.thaw()
    assert closed_in < 1.0, f"close waited {closed_in:.2f} s for a Redis that does not answer"
    assert replicas.errors("concurrency", "lost") == 1  # the cancelled settle is counted, its lease lapses


async def test_the_settings_pick_the_store_and_the_policies(redis_url) -> None:
    settings = Settings.from_env({"LORAPLEX_REDIS_URL": redis_url, "LORAPLEX_REDIS_FAIL_CONCURRENCY": "closed"})
    assert failure_policy(settings) == FailurePolicy(rate_open=True, concurrency_open=False, budget_open=False)
    with pytest.raises(SettingsError, match="LORAPLEX_REDIS_FAIL_BUDGET"):
        Settings.from_env({"LORAPLEX_REDIS_FAIL_BUDGET": "ajar"})
    errors = GatewayMetrics().limit_backend_errors
    with redis.Redis.from_url(redis_url) as client:
        for environ, num_keys in (({}, 0), ({"LORAPLEX_REDIS_URL": redis_url}, 4)):
            client.flushall()
            async with open_limiter(Settings.from_env(environ), FakeUsage(), errors) as limiter:
                (await limiter.admit(caller(Limits(max_requests_per_minute=5)), 1, 1)).settle(2)
            assert len(list(client.scan_iter("*"))) == num_keys  # requests, tokens and their amounts and total


async def _eventually(attempt: Callable[[], object], timeout_s: float = 5.0) -> None:
    """Retry ``attempt`` (a coroutine function) until it stops raising ServiceUnavailableError."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await attempt()
            return
        except ServiceUnavailableError:
            assert time.monotonic() < deadline, "Redis was not used again after it came back"
            await asyncio.sleep(RETRY_S)
