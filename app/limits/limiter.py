"""The limiter: lets a request in under its tenant's limits and its key's, or refuses it with a 429.

Two levels, both enforced: the tenant's limits hold across all its keys, and a key's own limits (when
set) narrow them for that key. Each level that has any limit has its own state in the limiter's store
(store.py: in this process by default, memory_store.py; in Redis, shared by the gateway's replicas,
with ``LORAPLEX_REDIS_URL``, redis_store.py):

- requests and tokens a minute: sliding one-minute windows, so no more than the limit passes in any 60
  seconds. A request is charged one request, and its prompt plus ``max_tokens`` in tokens, when it is
  admitted; when it ends, its token charge is lowered to what it used (prompt plus completion).
- concurrency: a slot from admission until the run ends, however it ends (the run's ``finally`` settles).
- the monthly budget: tokens used this calendar month (UTC) = the sum in ``usage_events``, read once
  (budget.py), + what was settled since + what running requests reserved. A request whose reservation
  does not fit gets 429 ``insufficient_quota``.

A request that could never pass, whatever the wait (prompt plus ``max_tokens`` above the tokens-a-minute
limit, a limit of 0), gets a 429 that says so, without ``Retry-After`` and with ``x-should-retry: false``.

This module holds what both stores share: which levels apply, the refusal chosen and its message, and
the headers. The store only looks, and charges when every level has room, atomically.

Limits come with the caller's key from the authenticator, whose cache lives at most a second: a changed
limit holds within a second. Nothing here touches the database on the request path except the first
budget read of a level in a month.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from app.keys.authenticator import Principal
from app.limits.budget import month_bounds
from app.limits.store import Ask, LimitStore, Month, Seen, Settle
from app.web.errors import ApiError, InsufficientQuotaError, RateLimitError

CONCURRENCY_RETRY_S = 1.0  # a slot frees when a running request ends, which nobody can foresee: look again soon
MS_PER_S = 1000


def utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True, slots=True)
class _Level:
    """A level with the limits that apply to it now, and how messages name it."""

    ask: Ask
    who: str


@dataclass(frozen=True, slots=True)
class _Refusal:
    error: ApiError
    never_passes: bool = False


class Admission:
    """A request let in: it holds a slot on each level, and its token reservation, until :meth:`settle`."""

    __slots__ = ("_settle", "num_reserved")

    def __init__(self, settle: Settle | None, num_reserved: int) -> None:
        self._settle = settle
        self.num_reserved = num_reserved
        """Tokens reserved: the prompt plus ``max_tokens``."""

    def settle(self, num_tokens_used: int) -> None:
        """Replace the reservation with the tokens used (prompt plus completion) and free the slots; once."""
        settle, self._settle = self._settle, None
        if settle is not None:
            settle(num_tokens_used)


class Limiter:
    """Admits requests under their tenant's and key's limits, with its state in ``store``; see the module docstring.

    ``calendar`` (an aware datetime) says which month the budget counts; tests pass their own to move time
    without sleeping (and a store on their own clock).
    """

    def __init__(self, store: LimitStore, *, calendar: Callable[[], datetime] = utc_now) -> None:
        self._store = store
        self._calendar = calendar

    async def admit(self, principal: Principal, num_prompt_tokens: int, max_tokens: int) -> Admission:
        """Let the request in and reserve its tokens, or raise RateLimitError / InsufficientQuotaError (429).

        Raises ServiceUnavailableError (503) when a budget must be read and the database does not answer,
        or when the store cannot be reached and a limit's policy is to refuse then.
        """
        num_tokens = num_prompt_tokens + max_tokens
        levels = self._levels(principal)
        if not levels:
            return Admission(None, num_tokens)
        now = self._calendar()
        month = Month(*month_bounds(now), now)
        seen, settle = await self._store.take([level.ask for level in levels], num_tokens, month)
        if settle is not None:
            return Admission(settle, num_tokens)
        refusals = [
            refusal
            for level, level_seen in zip(levels, seen, strict=True)
            for refusal in _check(level, level_seen, month, num_prompt_tokens, max_tokens)
        ]
        raise _first(refusals)

    def headers(self, principal: Principal) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers for the caller now: requests' and tokens', each where a level limits it.

        Where both levels limit a dimension, the headers show the one with the fewest left (the next to trip).
        ``reset`` is the time until that window is empty again, as OpenAI defines it ("resets to its initial state").
        """
        levels = self._levels(principal)
        if not levels:
            return {}
        views = [self._store.view(level.ask) for level in levels]
        headers: dict[str, str] = {}
        for dimension in ("requests", "tokens"):
            shown: tuple[int, float, int] | None = None  # (remaining, -reset, limit): the smallest is shown
            for level, view in zip(levels, views, strict=True):
                limits = level.ask.limits
                if dimension == "requests":
                    limit, num_used, reset_s = limits.max_requests_per_minute, view.num_requests, view.requests_reset_s
                else:
                    limit, num_used, reset_s = limits.max_tokens_per_minute, view.num_tokens, view.tokens_reset_s
                if limit is None:
                    continue
                candidate = (max(0, limit - num_used), -reset_s, limit)
                shown = candidate if shown is None else min(shown, candidate)
            if shown is not None:
                remaining, minus_reset, limit = shown
                headers[f"x-ratelimit-limit-{dimension}"] = str(limit)
                headers[f"x-ratelimit-remaining-{dimension}"] = str(remaining)
                headers[f"x-ratelimit-reset-{dimension}"] = duration_text(-minus_reset)
        return headers

    async def close(self) -> None:
        """Stop the store's background work and let go of its connections."""
        await self._store.close()

    def _levels(self, principal: Principal) -> list[_Level]:
        levels = []
        if principal.tenant_limits:
            ask = Ask(principal.tenant_id, None, principal.tenant_limits)
            levels.append(_Level(ask, f"tenant `{principal.tenant_name}`"))
        if principal.key_limits:
            levels.append(_Level(Ask(principal.tenant_id, principal.key_id, principal.key_limits), "this API key"))
        return levels


def _check(level: _Level, seen: Seen, month: Month, num_prompt_tokens: int, max_tokens: int) -> list[_Refusal]:
    """Why ``level``, as it was ``seen``, could not take the request (nothing when it could)."""
    limits, who = level.ask.limits, level.who
    num_tokens = num_prompt_tokens + max_tokens
    refusals = []
    limit, num_used = limits.max_tokens_per_month, seen.num_month_used
    if limit is not None and num_used is not None and num_used + num_tokens > limit:
        message = (
            f"You exceeded your current quota: {who} has used {num_used} of its {limit} tokens for "
            f"{month.start:%B %Y} (UTC), and this request reserves {num_tokens} more "
            f"({num_prompt_tokens} in the prompt, {max_tokens} for `max_tokens`). The budget renews on "
            f"{month.end:%Y-%m-%d} at 00:00 "
            "UTC; send a smaller `max_tokens`, or ask your administrator to raise the budget."
        )
        wait_s = (month.end - month.now).total_seconds()
        refusals.append(_Refusal(InsufficientQuotaError(message, retry_after_s=wait_s)))
    if (limit := limits.max_concurrent) is not None and seen.num_running >= limit:
        if limit == 0:
            message = f"The concurrency limit of {who} is 0, so no request can run; ask your administrator."
            refusals.append(_Refusal(RateLimitError(message, retry_after_s=None), never_passes=True))
        else:
            message = (
                f"Concurrency limit reached for {who}: Limit {limit}, Running {seen.num_running}. Please try "
                "again when one of them has finished."
            )
            refusals.append(_Refusal(RateLimitError(message, retry_after_s=CONCURRENCY_RETRY_S)))
    if (limit := limits.max_requests_per_minute) is not None:
        wait_s = seen.requests_wait_s
        if math.isinf(wait_s):
            message = f"The requests per min (RPM) limit of {who} is 0, so no request can pass; ask your administrator."
            refusals.append(_Refusal(RateLimitError(message, retry_after_s=None), never_passes=True))
        elif wait_s > 0:
            message = (
                f"Rate limit reached for {who} on requests per min (RPM): Limit {limit}, Used "
                f"{seen.num_requests}, Requested 1. Please try again in {duration_text(wait_s)}."
            )
            refusals.append(_Refusal(RateLimitError(message, retry_after_s=wait_s)))
    if (limit := limits.max_tokens_per_minute) is not None:
        wait_s = seen.tokens_wait_s
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
                f"Rate limit reached for {who} on tokens per min (TPM): Limit {limit}, Used {seen.num_tokens}, "
                f"Requested {num_tokens}. Please try again in {duration_text(wait_s)}. A request reserves its "
                "prompt plus `max_tokens` until it ends; a smaller `max_tokens` reserves less."
            )
            refusals.append(_Refusal(RateLimitError(message, retry_after_s=wait_s, kind="tokens")))
    return refusals


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
