"""What the limits do while their shared store (Redis) cannot be reached: fail open or closed, per limit.

Each of the three kinds of limit has its own policy (``LORAPLEX_REDIS_FAIL_RATE``, ``_CONCURRENCY``,
``_BUDGET``). Open lets the request pass that check; closed refuses it with a 503 that says why. The
defaults are open for the rate limits and concurrency (a Redis outage should not take the service down,
and for a while each request simply goes unthrottled) and closed for the budget (tokens past a budget
are money the tenant did not agree to spend).

Every outcome is counted (``loraplex_limit_backend_errors_total{limit, outcome}``) and logged, but the
log says so at most once per LOG_EVERY_S with the number of failures since, not once per request.
After a failure the store is not asked again for RETRY_AFTER_S: while it is away, requests get the
policy's answer at once instead of each waiting for a connection timeout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import Counter

from app.limits.limits import Limits
from app.web.errors import ServiceUnavailableError

logger = logging.getLogger(__name__)

RATE, CONCURRENCY, BUDGET = "rate", "concurrency", "budget"
KINDS = (RATE, CONCURRENCY, BUDGET)
OPEN, CLOSED, LOST = "open", "closed", "lost"
"""Outcomes: a request let through a check; a request refused (503); an update after admission (a settle,
a lease renewal) that did not reach the store."""
LOG_EVERY_S = 10.0  # an outage logs a line every 10 s, whatever the request rate
RETRY_AFTER_S = 1.0  # a store that failed is asked again after this long; an outage costs no timeout per request


@dataclass(frozen=True, slots=True)
class FailurePolicy:
    """Which limits let requests through while the store is away (True: fail open)."""

    rate_open: bool = True
    """Requests and tokens a minute."""
    concurrency_open: bool = True
    budget_open: bool = False

    def is_open(self, kind: str) -> bool:
        return {RATE: self.rate_open, CONCURRENCY: self.concurrency_open, BUDGET: self.budget_open}[kind]


def kinds_of(limits: Limits) -> set[str]:
    """The kinds of limit a level has."""
    kinds = set()
    if limits.max_requests_per_minute is not None or limits.max_tokens_per_minute is not None:
        kinds.add(RATE)
    if limits.max_concurrent is not None:
        kinds.add(CONCURRENCY)
    if limits.max_tokens_per_month is not None:
        kinds.add(BUDGET)
    return kinds


class BackendFailures:
    """Applies the policy to a failed store call, counts it, logs it (throttled), and backs off for a while."""

    def __init__(self, policy: FailurePolicy, errors: Counter | None = None, *, retry_after_s: float = RETRY_AFTER_S):
        self.policy = policy
        self._errors = errors
        self._retry_after_s = retry_after_s
        self._down_until = 0.0  # monotonic seconds
        self._last_error = ""
        self._logged_at = -LOG_EVERY_S
        self._num_unlogged = 0

    @property
    def is_down(self) -> bool:
        """Whether the store failed less than ``retry_after_s`` ago (then it is not asked)."""
        return time.monotonic() < self._down_until

    def failed(self, error: BaseException) -> None:
        """Note a failed call: the store is left alone for a while."""
        self._down_until = time.monotonic() + self._retry_after_s
        self._last_error = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__

    def admit_anyway(self, kinds: Iterable[str]) -> None:
        """The policy's answer to a request the store could not check: return to let it in, or raise a 503."""
        kinds = sorted(set(kinds))
        closed = [kind for kind in kinds if not self.policy.is_open(kind)]
        for kind in kinds:
            self._count(kind, CLOSED if closed else OPEN)
        verdict = f"refused ({', '.join(closed)} fail closed)" if closed else "let in (they fail open)"
        self._log(f"could not check a request's {', '.join(kinds)} limits in Redis; it was {verdict}")
        if closed:
            raise ServiceUnavailableError(
                f"The {' and '.join(closed)} limits of this request could not be checked because the limits store "
                "(Redis) is unavailable; retry in a few seconds."
            )

    def lost(self, what: str, kinds: Iterable[str]) -> None:
        """Count and log an update after admission (``what``: "settle", "lease renewal") that Redis did not take."""
        for kind in sorted(set(kinds)):
            self._count(kind, LOST)
        self._log(f"a {what} did not reach Redis")

    def _count(self, kind: str, outcome: str) -> None:
        if self._errors is not None:
            self._errors.labels(kind, outcome).inc()

    def _log(self, text: str) -> None:
        now = time.monotonic()
        if now - self._logged_at < LOG_EVERY_S:
            self._num_unlogged += 1
            return
        since = f"; {self._num_unlogged} more failures since the last report" if self._num_unlogged else ""
        logger.warning("%s (%s)%s", text, self._last_error, since)
        self._logged_at, self._num_unlogged = now, 0
