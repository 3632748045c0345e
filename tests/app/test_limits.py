"""The limiter alone, on a fake clock: each limit trips at its count and frees at its time, reservations settle.

Every test that takes ``limiter`` runs twice: on the in-process store and on the Redis store (a real
redis-server, its scripts given the fake time), so the two cannot behave differently. No sleeps: the
minute windows read ``FakeTime.now`` and the budget's month reads ``FakeTime.utc``. The budget's recorded
usage comes from an in-memory loader standing in for ``usage_events`` (test_limits_http.py reads the real
table). test_limits_redis.py has what only Redis does: replicas sharing it, leases, outages.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta

import pytest

from app.adapters.resolver import ResolvedModel
from app.keys.authenticator import Principal
from app.limits.backend_failure import BackendFailures, FailurePolicy
from app.limits.factory import redis_client
from app.limits.limiter import Admission, Limiter, duration_text
from app.limits.limits import NO_LIMITS, Limits
from app.limits.memory_store import MemoryStore
from app.limits.redis_store import RedisStore
from app.limits.store import LimitStore
from app.observability.metrics import GatewayMetrics
from app.openai.chat.runs import Run, Submission, metered_outputs
from app.usage.records import UsageRecord
from app.web.errors import InsufficientQuotaError, RateLimitError
from engine import RequestOutput, SamplingParams
from engine.errors import RequestError

pytestmark = pytest.mark.anyio

TENANT_ID = uuid.UUID("11111111-1111-4111-8111-111111111111")
KEY_A = uuid.UUID("22222222-2222-4222-8222-222222222222")
KEY_B = uuid.UUID("33333333-3333-4333-8333-333333333333")
NOVEMBER = datetime(2026, 11, 20, 12, 0, tzinfo=UTC)
DECEMBER_1 = datetime(2026, 12, 1, tzinfo=UTC)
TEST_REDIS_TIMEOUT_S = 2.0  # the gateway's 100 ms would turn a busy test machine's pause into a failure


class FakeTime:
    """The limiter's two clocks, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0  # monotonic seconds; any start will do
        self.utc = NOVEMBER

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.utc += timedelta(seconds=seconds)


class FakeUsage:
    """``usage_events`` as the loader sees it: tokens per (tenant, key or None); every read is logged."""

    def __init__(self, recorded: dict[tuple[uuid.UUID, uuid.UUID | None], int] | None = None) -> None:
        self.recorded = recorded or {}
        self.reads: list[tuple[uuid.UUID, uuid.UUID | None, datetime, datetime]] = []

    async def __call__(self, tenant_id: uuid.UUID, key_id: uuid.UUID | None, start: datetime, end: datetime) -> int:
        self.reads.append((tenant_id, key_id, start, end))
        await asyncio.sleep(0)  # a real read yields to the loop
        return self.recorded.get((tenant_id, key_id), 0)


@pytest.fixture
def clock() -> FakeTime:
    return FakeTime()


@pytest.fixture
def usage() -> FakeUsage:
    return FakeUsage()


def redis_store(url: str, usage: FakeUsage, clock: Callable[[], float] | None = None, **kwargs: float) -> RedisStore:
    """A Redis store with the default failure policy, on ``clock`` (None: Redis's own)."""
    client = redis_client(url, TEST_REDIS_TIMEOUT_S)
    return RedisStore(client, usage, BackendFailures(FailurePolicy()), clock=clock, **kwargs)


@pytest.fixture(params=["memory", "redis"])
async def limiter(request: pytest.FixtureRequest, clock: FakeTime, usage: FakeUsage) -> AsyncIterator[Limiter]:
    """The limiter on each store in turn, both on the fake clock."""
    store: LimitStore
    if request.param == "memory":
        store = MemoryStore(usage, clock=lambda: clock.now)
    else:
        store = redis_store(request.getfixturevalue("redis_url"), usage, lambda: clock.now)
    limiter = Limiter(store, calendar=lambda: clock.utc)
    yield limiter
    await limiter.close()


def caller(
    tenant: Limits = NO_LIMITS, key: Limits = NO_LIMITS, key_id: uuid.UUID = KEY_A, tenant_id: uuid.UUID = TENANT_ID
) -> Principal:
    return Principal(
        key_id=key_id,
        tenant_id=tenant_id,
        tenant_name="acme",
        scopes=frozenset({"inference"}),
        tenant_limits=tenant,
        key_limits=key,
    )


async def refused(limiter: Limiter, principal: Principal, num_prompt: int = 1, max_tokens: int = 1):
    with pytest.raises((RateLimitError, InsufficientQuotaError)) as caught:
        await limiter.admit(principal, num_prompt, max_tokens)
    return caught.value


# Requests a minute ----------------------------------------------------------------------------------------------


async def test_rpm_trips_at_the_limit_and_each_request_frees_its_slot_a_minute_later(limiter, clock) -> None:
    principal = caller(Limits(max_requests_per_minute=3))
    for _ in range(3):
        await limiter.admit(principal, 5, 5)
        clock.advance(10)  # at 0, 10 and 20 s
    error = await refused(limiter, principal)  # at 30 s
    assert (error.status, error.type, error.code) == (429, "requests", "rate_limit_exceeded")
    assert error.retry_after_s == pytest.approx(30.0)  # the first request leaves the window at 60 s
    assert "requests per min (RPM): Limit 3, Used 3" in error.message and "try again in 30s" in error.message
    assert error.response_headers()["Retry-After"] == "30"
    assert error.response_headers()["retry-after-ms"] == "30000"
    clock.advance(29.999)
    await refused(limiter, principal)
    clock.advance(0.001)  # exactly a minute after the first
    await limiter.admit(principal, 5, 5)
    error = await refused(limiter, principal)  # the second leaves at 70 s
    assert error.retry_after_s == pytest.approx(10.0)
    clock.advance(10)
    await limiter.admit(principal, 5, 5)


async def test_the_window_slides_so_no_minute_ever_holds_more_than_the_limit(limiter, clock) -> None:
    principal = caller(Limits(max_requests_per_minute=2))
    clock.advance(59)
    await limiter.admit(principal, 1, 1)
    await limiter.admit(principal, 1, 1)
    clock.advance(2)  # a fixed window would have reset here; these two are still within the last minute
    await refused(limiter, principal)
    clock.advance(57.999)
    await refused(limiter, principal)
    clock.advance(0.001)  # a minute after those two
    await limiter.admit(principal, 1, 1)


async def test_an_rpm_of_zero_refuses_without_a_retry_time(limiter) -> None:
    error = await refused(limiter, caller(Limits(max_requests_per_minute=0)))
    assert error.retry_after_s is None and "is 0" in error.message
    assert error.response_headers() == {"x-should-retry": "false"}


# Tokens a minute ------------------------------------------------------------------------------------------------


async def test_tpm_reserves_prompt_plus_max_tokens_and_settles_to_the_tokens_used(limiter, clock) -> None:
    principal = caller(Limits(max_tokens_per_minute=100))
    first = await limiter.admit(principal, 10, 50)  # reserves 60
    assert first.num_reserved == 60
    assert limiter.headers(principal)["x-ratelimit-remaining-tokens"] == "40"
    clock.advance(5)
    error = await refused(limiter, principal, 10, 50)  # 60 + 60 > 100
    assert (error.type, error.code) == ("tokens", "rate_limit_exceeded")
    assert error.retry_after_s == pytest.approx(55.0)
    assert "Limit 100, Used 60, Requested 60" in error.message
    first.settle(10 + 12)  # the prompt and 12 generated tokens
    assert limiter.headers(principal)["x-ratelimit-remaining-tokens"] == "78"
    second = await limiter.admit(principal, 10, 50)
    second.settle(10 + 50)
    first.settle(10)  # a second settle changes nothing
    assert limiter.headers(principal)["x-ratelimit-remaining-tokens"] == "18"
    await limiter.admit(principal, 8, 10)
    await refused(limiter, principal, 1, 1)
    clock.advance(55)  # the first request's 22 tokens leave the window
    await limiter.admit(principal, 10, 10)


async def test_a_request_larger_than_the_tpm_limit_can_never_pass(limiter) -> None:
    principal = caller(Limits(max_tokens_per_minute=100))
    error = await refused(limiter, principal, 60, 41)
    assert (error.status, error.type, error.code, error.retry_after_s) == (429, "tokens", "rate_limit_exceeded", None)
    assert "Request too large" in error.message and "Requested 101" in error.message
    assert "never pass" in error.message and "`max_tokens`" in error.message
    assert error.response_headers() == {"x-should-retry": "false"}
    await limiter.admit(principal, 60, 40)  # exactly the limit fits


async def test_settling_a_charge_that_left_the_window_changes_nothing(limiter, clock) -> None:
    principal = caller(Limits(max_tokens_per_minute=100))
    long_run = await limiter.admit(principal, 20, 80)
    clock.advance(61)
    fresh = await limiter.admit(principal, 20, 80)  # the long run's reservation has left the window
    long_run.settle(30)
    assert limiter.headers(principal)["x-ratelimit-remaining-tokens"] == "0"
    fresh.settle(40)
    assert limiter.headers(principal)["x-ratelimit-remaining-tokens"] == "60"


# Concurrency ----------------------------------------------------------------------------------------------------


async def test_a_concurrency_slot_is_held_until_the_run_settles(limiter) -> None:
    principal = caller(Limits(max_concurrent=2))
    first = await limiter.admit(principal, 1, 1)
    await limiter.admit(principal, 1, 1)
    error = await refused(limiter, principal)
    assert (error.type, error.code, error.retry_after_s) == ("requests", "rate_limit_exceeded", 1.0)
    assert "Limit 2, Running 2" in error.message
    first.settle(2)
    first.settle(2)  # released once, however often it is settled
    await limiter.admit(principal, 1, 1)
    await refused(limiter, principal)


class FakeEngine:
    """Yields one output of two tokens, then waits for ``go`` and fails (or waits for ever, to be cancelled)."""

    model_name = "fake"

    def __init__(self, then: str) -> None:
        self.then = then
        self.go = asyncio.Event()

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, *args: object, **kwargs: object
    ) -> AsyncIterator[RequestOutput]:
        yield RequestOutput(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            token_ids=[7, 8],
            text="ab",
            delta_token_ids=[7, 8],
            delta_text="ab",
            finish_reason=None,
            num_cached_tokens=0,
            ttft_s=0.01,
        )
        await self.go.wait()
        if self.then == "fail":
            raise RequestError("the engine failed the request")
        await asyncio.Event().wait()  # never finishes on its own


class FakeWriter:
    """Keeps the records; each is durable at once (the future UsageWriter.record hands back, already done)."""

    def __init__(self) -> None:
        self.records: list[UsageRecord] = []

    def record(self, record: UsageRecord) -> concurrent.futures.Future[None]:
        self.records.append(record)
        durable: concurrent.futures.Future[None] = concurrent.futures.Future()
        durable.set_result(None)
        return durable


def run_of(admission: Admission, principal: Principal) -> Run:
    params = SamplingParams(max_tokens=20)
    submissions = (Submission("req-1", [1, 2, 3], params),)
    return Run("req-1", "completions", principal, ResolvedModel("fake"), submissions, admission)


@pytest.mark.parametrize("then", ["fail", "cancel"])
async def test_the_run_frees_its_slot_and_settles_its_tokens_when_it_fails_or_is_cancelled(limiter, then) -> None:
    principal = caller(Limits(max_concurrent=1, max_tokens_per_minute=100))
    admission = await limiter.admit(principal, 3, 20)
    writer, engine = FakeWriter(), FakeEngine(then)
    outputs = metered_outputs(run_of(admission, principal), engine, writer, GatewayMetrics())  # type: ignore[arg-type]

    async def consume() -> None:
        async for _ in outputs:
            pass

    task = asyncio.ensure_future(consume())
    await asyncio.sleep(0.01)
    await refused(limiter, principal)  # the slot is taken while it runs
    engine.go.set()
    if then == "cancel":
        task.cancel()
    with pytest.raises(RequestError if then == "fail" else asyncio.CancelledError):
        await task
    (record,) = writer.records
    assert record.status == ("error" if then == "fail" else "cancelled")
    assert limiter.headers(principal)["x-ratelimit-remaining-tokens"] == str(100 - 3 - 2)  # settled to the usage row
    (await limiter.admit(principal, 1, 1)).settle(2)  # the slot is free again


# Both levels ----------------------------------------------------------------------------------------------------


async def test_a_key_limit_narrows_the_tenant_and_the_tenant_limit_spans_its_keys(limiter) -> None:
    tenant = Limits(max_requests_per_minute=5)
    narrow = caller(tenant, Limits(max_requests_per_minute=2), KEY_A)
    other = caller(tenant, NO_LIMITS, KEY_B)
    await limiter.admit(narrow, 1, 1)
    await limiter.admit(narrow, 1, 1)
    error = await refused(limiter, narrow)
    assert "this API key" in error.message and "Limit 2" in error.message
    for _ in range(3):
        await limiter.admit(other, 1, 1)
    error = await refused(limiter, other)
    assert "tenant `acme`" in error.message and "Limit 5, Used 5" in error.message
    wide = caller(tenant, Limits(max_requests_per_minute=50), KEY_A)  # a key limit never widens the tenant's
    assert "tenant `acme`" in (await refused(limiter, wide)).message


async def test_a_refused_request_reserves_nothing_on_either_level(limiter) -> None:
    principal = caller(Limits(max_requests_per_minute=10), Limits(max_concurrent=1))
    held = await limiter.admit(principal, 1, 1)
    for _ in range(3):
        await refused(limiter, principal)  # refused by the key's concurrency: the tenant's RPM is not charged
    assert limiter.headers(principal)["x-ratelimit-remaining-requests"] == "9"
    held.settle(2)


# Monthly budget -------------------------------------------------------------------------------------------------


async def test_the_budget_counts_recorded_usage_settled_tokens_and_reservations(limiter, clock, usage) -> None:
    usage.recorded[(TENANT_ID, None)] = 900
    principal = caller(Limits(max_tokens_per_month=1000))
    running = await limiter.admit(principal, 50, 40)  # 900 + 90
    error = await refused(limiter, principal, 5, 10)  # 990 + 15 > 1000
    assert (error.status, error.type, error.code) == (429, "insufficient_quota", "insufficient_quota")
    assert error.retry_after_s == pytest.approx((DECEMBER_1 - NOVEMBER).total_seconds())
    assert "used 990 of its 1000 tokens for November 2026" in error.message and "2026-12-01" in error.message
    headers = error.response_headers()
    assert headers["Retry-After"] == str(int((DECEMBER_1 - NOVEMBER).total_seconds()))
    assert headers["x-should-retry"] == "false"
    running.settle(50 + 30)  # 980 used
    (await limiter.admit(principal, 5, 10)).settle(15)  # 995
    await limiter.admit(principal, 2, 3)  # exactly 1000
    await refused(limiter, principal, 1, 1)
    assert usage.reads == [(TENANT_ID, None, datetime(2026, 11, 1, tzinfo=UTC), DECEMBER_1)]  # read once


async def test_concurrent_first_requests_share_one_budget_read(limiter, usage) -> None:
    principal = caller(Limits(max_tokens_per_month=100))
    results = await asyncio.gather(
        *(limiter.admit(principal, 10, 10) for _ in range(6)), return_exceptions=True
    )  # 5 × 20 fit, the sixth does not
    assert sum(isinstance(result, Admission) for result in results) == 5
    assert sum(isinstance(result, InsufficientQuotaError) for result in results) == 1
    assert len(usage.reads) == 1


async def test_the_budget_renews_with_the_month(limiter, clock, usage) -> None:
    usage.recorded[(TENANT_ID, None)] = 100
    principal = caller(Limits(max_tokens_per_month=100))
    await refused(limiter, principal)
    clock.utc = DECEMBER_1 + timedelta(seconds=1)
    usage.recorded[(TENANT_ID, None)] = 0
    (await limiter.admit(principal, 50, 50)).settle(60)
    await refused(limiter, principal, 20, 30)  # 60 + 50 > 100: December's own usage counts
    assert [read[2] for read in usage.reads] == [datetime(2026, 11, 1, tzinfo=UTC), DECEMBER_1]


async def test_a_key_budget_reads_the_keys_own_usage(limiter, usage) -> None:
    usage.recorded[(TENANT_ID, None)] = 10
    usage.recorded[(TENANT_ID, KEY_A)] = 95
    principal = caller(Limits(max_tokens_per_month=1000), Limits(max_tokens_per_month=100))
    error = await refused(limiter, principal, 3, 3)
    assert isinstance(error, InsufficientQuotaError) and "this API key has used 95" in error.message
    assert {(read[0], read[1]) for read in usage.reads} == {(TENANT_ID, None), (TENANT_ID, KEY_A)}
    await limiter.admit(caller(Limits(max_tokens_per_month=1000), key_id=KEY_B), 3, 3)


async def test_no_limits_no_reads_no_headers(limiter, usage) -> None:
    principal = caller()
    for _ in range(100):
        (await limiter.admit(principal, 1000, 1000)).settle(2000)
    assert limiter.headers(principal) == {} and usage.reads == []


# Headers --------------------------------------------------------------------------------------------------------


async def test_headers_show_the_level_nearest_its_limit_and_only_the_limited_dimensions(limiter, clock) -> None:
    principal = caller(Limits(max_requests_per_minute=10), Limits(max_requests_per_minute=3))
    assert limiter.headers(principal) == {
        "x-ratelimit-limit-requests": "3",
        "x-ratelimit-remaining-requests": "3",
        "x-ratelimit-reset-requests": "0s",
    }
    await limiter.admit(principal, 1, 1)
    clock.advance(15)
    assert limiter.headers(principal) == {
        "x-ratelimit-limit-requests": "3",
        "x-ratelimit-remaining-requests": "2",
        "x-ratelimit-reset-requests": "45s",
    }
    tokens_only = caller(Limits(max_tokens_per_minute=1000), key_id=KEY_B, tenant_id=uuid.uuid4())
    await limiter.admit(tokens_only, 100, 150)
    clock.advance(0.75)
    assert limiter.headers(tokens_only) == {
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "750",
        "x-ratelimit-reset-tokens": "59.25s",
    }


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.0, "0s"), (0.25, "250ms"), (0.0004, "1ms"), (6.0, "6s"), (8.64, "8.64s"), (60.0, "1m0s"), (90.5, "1m30.5s")],
)
def test_durations_read_as_openais_headers_write_them(seconds: float, text: str) -> None:
    assert duration_text(seconds) == text
