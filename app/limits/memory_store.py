"""The limits' state in this process: the default store, and the behaviour the Redis store matches.

Each level that has any limit has its own state here: two sliding minute windows (window.py), the number
of its requests running, and its month's usage (budget.py: read once from ``usage_events``, then kept
current). Checking and charging happen without an ``await`` in between, which is what makes them atomic
in one event loop.

Several gateway replicas each keep their own: each lets a tenant have its full rate and concurrency, and
sees the others' budget use only when it next reads ``usage_events`` (at its start, or in a new month).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from app.limits.budget import MonthUsage, UsageLoader, UsageReads
from app.limits.store import Ask, Month, Seen, Settle, WindowView, has_room
from app.limits.window import Charge, SlidingWindow


@dataclass(slots=True)
class _LevelState:
    """What one tenant or key has going on in this process."""

    requests: SlidingWindow = field(default_factory=SlidingWindow)
    tokens: SlidingWindow = field(default_factory=SlidingWindow)
    num_running: int = 0
    month: MonthUsage | None = None


@dataclass(frozen=True, slots=True)
class _Hold:
    state: _LevelState
    tokens: Charge
    month: MonthUsage | None


class _Admitted:
    """The settle function of one admission: frees its slots and settles its tokens, once."""

    __slots__ = ("_holds", "_num_reserved", "_settled")

    def __init__(self, holds: list[_Hold], num_reserved: int) -> None:
        self._holds = holds
        self._num_reserved = num_reserved
        self._settled = False

    def __call__(self, num_tokens_used: int) -> None:
        if self._settled:
            return
        self._settled = True
        for hold in self._holds:
            hold.state.num_running -= 1
            hold.state.tokens.lower(hold.tokens, num_tokens_used)
            if hold.month is not None:
                hold.month.num_reserved -= self._num_reserved
                hold.month.num_settled += num_tokens_used


class MemoryStore:
    """The limits' state of this process; ``clock`` (seconds, monotonic) times the minute windows.

    Tests pass their own clock to move time without sleeping.
    """

    def __init__(self, load_usage: UsageLoader, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._reads = UsageReads(load_usage)
        self._clock = clock
        self._states: dict[tuple[uuid.UUID, uuid.UUID | None], _LevelState] = {}

    async def take(self, asks: Sequence[Ask], num_tokens: int, month: Month) -> tuple[list[Seen], Settle | None]:
        states = [self._state_of(ask) for ask in asks]
        await self._read_months(asks, states, month)
        now = self._clock()
        seen = [_seen(ask, state, now, num_tokens) for ask, state in zip(asks, states, strict=True)]
        if not all(has_room(ask.limits, level, num_tokens) for ask, level in zip(asks, seen, strict=True)):
            return seen, None
        holds = []
        for ask, state in zip(asks, states, strict=True):
            state.requests.charge(now, 1)
            state.num_running += 1
            month_usage = state.month if ask.limits.max_tokens_per_month is not None else None
            if month_usage is not None:
                month_usage.num_reserved += num_tokens
            holds.append(_Hold(state, state.tokens.charge(now, num_tokens), month_usage))
        return seen, _Admitted(holds, num_tokens)

    def view(self, ask: Ask) -> WindowView:
        state = self._state_of(ask)
        now = self._clock()
        state.requests.prune(now)
        state.tokens.prune(now)
        return WindowView(
            state.requests.total, state.requests.reset_s(now), state.tokens.total, state.tokens.reset_s(now)
        )

    async def close(self) -> None:
        """Nothing runs in the background and nothing is connected."""

    def _state_of(self, ask: Ask) -> _LevelState:
        state = self._states.get(ask.level_id)
        if state is None:
            state = self._states[ask.level_id] = _LevelState()
        return state

    async def _read_months(self, asks: Iterable[Ask], states: Iterable[_LevelState], month: Month) -> None:
        """Make each budgeted level's month usage current, reading ``usage_events`` where it is not."""
        for ask, state in zip(asks, states, strict=True):
            if ask.limits.max_tokens_per_month is None:
                state.month = None  # not counted while unlimited: a budget set later reads the table again
                continue
            if state.month is not None and state.month.start == month.start:
                continue
            num_recorded = await self._reads.read(ask.tenant_id, ask.key_id, month.start, month.end)
            if state.month is None or state.month.start != month.start:  # a request that waited may have set it
                state.month = MonthUsage(month.start, num_recorded)


def _seen(ask: Ask, state: _LevelState, now: float, num_tokens: int) -> Seen:
    limits = ask.limits
    state.requests.prune(now)
    state.tokens.prune(now)
    rpm, tpm = limits.max_requests_per_minute, limits.max_tokens_per_minute
    return Seen(
        num_requests=state.requests.total,
        requests_wait_s=0.0 if rpm is None else state.requests.wait_s(now, 1, rpm),
        num_tokens=state.tokens.total,
        tokens_wait_s=0.0 if tpm is None else state.tokens.wait_s(now, num_tokens, tpm),
        num_running=state.num_running,
        num_month_used=None if state.month is None else state.month.num_used,
    )
