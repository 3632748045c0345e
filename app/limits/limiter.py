"""The limiter: lets a request in under its tenant's limits and its key's, or refuses it with a 429.

Two levels, both enforced: the tenant's limits hold across all its keys, and a key's own limits (when
set) narrow them for that key. Each level that has any limit has its own state here:

- requests and tokens a minute: sliding one-minute windows (window.py), so no more than the limit passes
  in any 60 seconds. A request is charged one request, and its prompt plus ``max_tokens`` in tokens, when
  it is admitted; when it ends, its token charge is lowered to what it used (prompt plus completion).
- concurrency: a slot from admission until the run ends, however it ends (the run's ``finally`` settles).
- the monthly budget: tokens used this calendar month (UTC) = the sum in ``usage_events``, read once
  (budget.py), + what this process settled since + what its running requests reserved. A request whose
  reservation does not fit gets 429 ``insufficient_quota``.

A request that could never pass, whatever the wait (prompt plus ``max_tokens`` above the tokens-a-minute
limit, a limit of 0), gets a 429 that says so, without ``Retry-After`` and with ``x-should-retry: false``.

Limits come with the caller's key from the authenticator, whose cache lives at most a second: a changed
limit holds within a second. The state lives in this process: several gateway replicas would each let a
tenant have its full rate and concurrency (divide the limits by the number of replicas), and each would
see the others' budget use only when it next reads ``usage_events`` (at its start, or a new month).

Nothing here touches the database on the request path except the first budget read of a level in a month.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial

from app.errors import ApiError, InsufficientQuotaError, RateLimitError
from app.keys.authenticator import Principal
from app.limits.budget import MonthUsage, UsageLoader, month_bounds
from app.limits.limits import Limits
from app.limits.window import Charge, SlidingWindow

CONCURRENCY_RETRY_S = 1.0  # a slot frees when a running request ends, which nobody can foresee: look again soon
MS_PER_S = 1000


def utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass(slots=True)
class _LevelState:
    """What one tenant or key has going on in this process."""

    requests: SlidingWindow = field(default_factory=SlidingWindow)
    tokens: SlidingWindow = field(default_factory=SlidingWindow)
    num_running: int = 0
    month: MonthUsage | None = None


@dataclass(frozen=True, slots=True)
class _Level:
    """A level's state with the limits that apply to it now, and how messages name it."""

    state: _LevelState
    limits: Limits
    tenant_id: uuid.UUID
    key_id: uuid.UUID | None  # None for the tenant level
    who: str


@dataclass(frozen=True, slots=True)
class _Hold:
    state: _LevelState
    tokens: Charge
    month: MonthUsage | None


@dataclass(frozen=True, slots=True)
class _Refusal:
    error: ApiError
    never_passes: bool = False


class Admission:
    """A request let in: it holds a slot on each level, and its token reservation, until :meth:`settle`."""

    __slots__ = ("_holds", "_settled", "num_reserved")

    def __init__(self, holds: list[_Hold], num_reserved: int) -> None:
        self._holds = holds
        self._settled = False
        self.num_reserved = num_reserved
        """Tokens reserved: the prompt plus ``max_tokens``."""

    def settle(self, num_tokens_used: int) -> None:
        """Replace the reservation with the tokens used (prompt plus completion) and free the slots; once."""
        if self._settled:
            return
        self._settled = True
        for hold in self._holds:
            hold.state.num_running -= 1
            hold.state.tokens.lower(hold.tokens, num_tokens_used)
            if hold.month is not None:
                hold.month.num_reserved -= self.num_reserved
                hold.month.num_settled += num_tokens_used


class Limiter:
    """Admits requests under their tenant's and key's limits; see the module docstring.

    ``clock`` (seconds, monotonic) times the minute windows; ``calendar`` (an aware datetime) says which month
    the budget counts. Tests pass their own to move time without sleeping.
    """

    def __init__(
        self,
        load_usage: UsageLoader,
        *,
        clock: Callable[[], float] = time.monotonic,
        calendar: Callable[[], datetime] = utc_now,
    ) -> None:
        self._load_usage = load_usage
        self._clock = clock
        self._calendar = calendar
        self._tenants: dict[uuid.UUID, _LevelState] = {}
        self._keys: dict[uuid.UUID, _LevelState] = {}
        self._loading: dict[tuple[uuid.UUID, uuid.UUID | None, datetime], asyncio.Task[int]] = {}

    async def admit(self, principal: Principal, num_prompt_tokens: int, max_tokens: int) -> Admission:
        """Let the request in and reserve its tokens, or raise RateLimitError / InsufficientQuotaError (429).

        Raises ServiceUnavailableError (503) when a budget must be read and the database does not answer.
        """
        levels = self._levels(principal)
        if not levels:
            return Admission([], num_prompt_tokens + max_tokens)
        await self._read_months(levels)
        now = self._clock()
        num_tokens = num_prompt_tokens + max_tokens
        refusals = [refusal for level in levels for refusal in self._check(level, now, num_prompt_tokens, max_tokens)]
        if refusals:
            raise _first(refusals)
        holds = []
        for level in levels:
            state = level.state
            state.requests.charge(now, 1)
            state.num_running += 1
            month = state.month if level.limits.max_tokens_per_month is not None else None
            if month is not None:
                month.num_reserved += num_tokens
            holds.append(_Hold(state, state.tokens.charge(now, num_tokens), month))
        return Admission(holds, num_tokens)

    def headers(self, principal: Principal) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers for the caller now: requests' and tokens', each where a level limits it.

        Where both levels limit a dimension, the headers show the one with the fewest left (the next to trip).
        ``reset`` is the time until that window is empty again, as OpenAI defines it ("resets to its initial state").
        """
        levels = self._levels(principal)
        if not levels:
            return {}
        now = self._clock()
        headers: dict[str, str] = {}
        for dimension in ("requests", "tokens"):
            shown: tuple[int, float, int] | None = None  # (remaining, -reset, limit): the smallest is shown
            for level in levels:
                limits = level.limits
                limit = limits.max_requests_per_minute if dimension == "requests" else limits.max_tokens_per_minute
                if limit is None:
                    continue
                window = level.state.requests if dimension == "requests" else level.state.tokens
                window.prune(now)
                candidate = (max(0, limit - window.total), -window.reset_s(now), limit)
                shown = candidate if shown is None else min(shown, candidate)
            if shown is not None:
                remaining, minus_reset, limit = shown
                headers[f"x-ratelimit-limit-{dimension}"] = str(limit)
                headers[f"x-ratelimit-remaining-{dimension}"] = str(remaining)
                headers[f"x-ratelimit-reset-{dimension}"] = duration_text(-minus_reset)
        return headers

    def _levels(self, principal: Principal) -> list[_Level]:
        levels = []
        if principal.tenant_limits:
            state = _state_of(self._tenants, principal.tenant_id)
            who = f"tenant `{principal.tenant_name}`"
            levels.append(_Level(state, principal.tenant_limits, principal.tenant_id, None, who))
        if principal.key_limits:
            state = _state_of(self._keys, principal.key_id)
            levels.append(_Level(state, principal.key_limits, principal.tenant_id, principal.key_id, "this API key"))
        return levels

    async def _read_months(self, levels: Iterable[_Level]) -> None:
        """Make each budgeted level's month usage current, reading ``usage_events`` where it is not."""
        start, end = month_bounds(self._calendar())
        for level in levels:
            state = level.state
            if level.limits.max_tokens_per_month is None:
                state.month = None  # not counted while unlimited: a budget set later reads the table again
                continue
            if state.month is not None and state.month.start == start:
                continue
            num_recorded = await self._shared_load(level.tenant_id, level.key_id, start, end)
            if state.month is None or state.month.start != start:  # a request that waited with us may have set it
                state.month = MonthUsage(start, num_recorded)

    async def _shared_load(self, tenant_id: uuid.UUID, key_id: uuid.UUID | None, start: datetime, end: datetime) -> int:
        """One query for all the requests that need the same month's usage at once."""
        load_id = (tenant_id, key_id, start)
        task = self._loading.get(load_id)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._load_usage(tenant_id, key_id, start, end))
            self._loading[load_id] = task
            task.add_done_callback(partial(self._forget_load, load_id))
        # Shielded: a request that goes away does not cancel the query the others await.
        return await asyncio.shield(task)

    def _forget_load(self, load_id: tuple[uuid.UUID, uuid.UUID | None, datetime], task: asyncio.Task[int]) -> None:
        self._loading.pop(load_id, None)
        if not task.cancelled():
            task.exception()  # marks it retrieved: every waiter may have gone away

    def _check(self, level: _Level, now: float, num_prompt_tokens: int, max_tokens: int) -> list[_Refusal]:
        """Why ``level`` cannot take the request now (nothing when it can)."""
        limits, state, who = level.limits, level.state, level.who
        num_tokens = num_prompt_tokens + max_tokens
        refusals = []
        state.requests.prune(now)
        state.tokens.prune(now)
        if (limit := limits.max_tokens_per_month) is not None and state.month is not None:
            num_used = state.month.num_used
            if num_used + num_tokens > limit:
                _, end = month_bounds(self._calendar())
                message = (
                    f"You exceeded your current quota: {who} has used {num_used} of its {limit} tokens for "
                    f"{state.month.start:%B %Y} (UTC), and this request reserves {num_tokens} more "
                    f"({num_prompt_tokens} in the prompt, {max_tokens} for `max_tokens`). The budget renews on "
                    f"{end:%Y-%m-%d} at 00:00 "
                    "UTC; send a smaller `max_tokens`, or ask your administrator to raise the budget."
                )
                wait_s = (end - self._calendar()).total_seconds()
                refusals.append(_Refusal(InsufficientQuotaError(message, retry_after_s=wait_s)))
        if (limit := limits.max_concurrent) is not None and state.num_running >= limit:
            if limit == 0:
                message = f"The concurrency limit of {who} is 0, so no request can run; ask your administrator."
                refusals.append(_Refusal(RateLimitError(message, retry_after_s=None), never_passes=True))
            else:
                message = (
                    f"Concurrency limit reached for {who}: Limit {limit}, Running {state.num_running}. Please try "
                    "again when one of them has finished."
                )
                refusals.append(_Refusal(RateLimitError(message, retry_after_s=CONCURRENCY_RETRY_S)))
        if (limit := limits.max_requests_per_minute) is not None:
            wait_s = state.requests.wait_s(now, 1, limit)
            if math.isinf(wait_s):
                message = (
                    f"The requests per min (RPM) limit of {who} is 0, so no request can pass; ask your administrator."
                )
                refusals.append(_Refusal(RateLimitError(message, retry_after_s=None), never_passes=True))
            elif wait_s > 0:
                message = (
                    f"Rate limit reached for {who} on requests per min (RPM): Limit {limit}, Used "
                    f"{state.requests.total}, Requested 1. Please try again in {duration_text(wait_s)}."
                )
                refusals.append(_Refusal(RateLimitError(message, retry_after_s=wait_s)))
        if (limit := limits.max_tokens_per_minute) is not None:
            wait_s = state.tokens.wait_s(now, num_tokens, limit)
            if math.isinf(wait_s):
                message = (
                    f"Request too large for {who} on tokens per min (TPM): Limit {limit}, Requested {num_tokens} "
                    f"({num_prompt_tokens} in the prompt, {max_tokens} for `max_tokens`), so it can never pass. "
                    "Lower `max_tokens` (left out, it is all the room the context leaves) or shorten the prompt, or "
                    "ask your administrator to raise the limit."
                )
                error = RateLimitError(message, retry_after_s=None, kind="tokens")
                refusals.append(_Refusal(error, never_passes=True))
            elif wait_s > 0:
                message = (
                    f"Rate limit reached for {who} on tokens per min (TPM): Limit {limit}, Used {state.tokens.total}, "
                    f"Requested {num_tokens}. Please try again in {duration_text(wait_s)}. A request reserves its "
                    "prompt plus `max_tokens` until it ends; a smaller `max_tokens` reserves less."
                )
                refusals.append(_Refusal(RateLimitError(message, retry_after_s=wait_s, kind="tokens")))
        return refusals


def _state_of(states: dict[uuid.UUID, _LevelState], level_id: uuid.UUID) -> _LevelState:
    state = states.get(level_id)
    if state is None:
        state = states[level_id] = _LevelState()
    return state


def _first(refusals: list[_Refusal]) -> ApiError:
    """The refusal to answer with: one that no wait cures, else a spent budget, else the longest wait."""
    for refusal in refusals:
        if refusal.never_passes:
            return refusal.error
    for refusal in refusals:
        if isinstance(refusal.error, InsufficientQuotaError):
            return refusal.error
    return max((refusal.error for refusal in refusals), key=lambda error: error.retry_after_s or 0.0)


def duration_text(seconds: float) -> str:
    """A duration as OpenAI's headers write it: ``250ms``, ``6s``, ``8.64s``, ``1m0s`` (rounded up to the ms)."""
    num_ms = max(0, math.ceil(seconds * MS_PER_S - 1e-6))  # the epsilon keeps 6.0 s from reading 6.001 s
    if num_ms == 0:
        return "0s"
    if num_ms < MS_PER_S:
        return f"{num_ms}ms"
    minutes, rest_ms = divmod(num_ms, 60 * MS_PER_S)
    seconds_text = f"{rest_ms / MS_PER_S:.3f}".rstrip("0").rstrip(".")
    return f"{minutes}m{seconds_text}s" if minutes else f"{seconds_text}s"
