"""The gateway's limiter, with its state where the settings say: in this process, or in Redis.

Without ``LORAPLEX_REDIS_URL`` the limits are per process, as they always were (memory_store.py). With
it, every replica shares one state (redis_store.py) and each limit has a policy for when Redis cannot
be reached (backend_failure.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from prometheus_client import Counter
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from app.limits.backend_failure import BackendFailures, FailurePolicy
from app.limits.budget import UsageLoader
from app.limits.limiter import Limiter
from app.limits.memory_store import MemoryStore
from app.limits.redis_store import RedisStore
from app.limits.store import LimitStore
from app.settings import Settings

# Redis answers a script in well under a millisecond; a connection or a reply that takes 250 ms means it is
# away (or overloaded), and the request gets the failure policy's answer instead. Not shorter: a pause of
# the gateway's own event loop (a busy machine, a garbage collection) must not read as an outage, which
# would refuse budgeted requests. After a failure the store is left alone for a second
# (backend_failure.RETRY_AFTER_S), so an outage costs one request a second this wait, not every request.
REDIS_TIMEOUT_S = 0.25


def redis_client(url: str, timeout_s: float = REDIS_TIMEOUT_S) -> Redis:
    """A client for the limits: short timeouts and no retries (the failure policy answers instead)."""
    return Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))


def failure_policy(settings: Settings) -> FailurePolicy:
    return FailurePolicy(
        rate_open=settings.redis_fail_rate == "open",
        concurrency_open=settings.redis_fail_concurrency == "open",
        budget_open=settings.redis_fail_budget == "open",
    )


@asynccontextmanager
async def open_limiter(settings: Settings, load_usage: UsageLoader, errors: Counter) -> AsyncIterator[Limiter]:
    """The limiter for ``settings``, closed on the way out; ``errors`` counts what Redis did not answer."""
    store: LimitStore
    if settings.redis_url is None:
        store = MemoryStore(load_usage)
    else:
        redis_store = RedisStore(
            redis_client(settings.redis_url), load_usage, BackendFailures(failure_policy(settings), errors)
        )
        await redis_store.ping()
        store = redis_store
    limiter = Limiter(store)
    try:
        yield limiter
    finally:
        await limiter.close()
