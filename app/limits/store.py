"""What the limiter asks of the place its state lives: one protocol, two stores.

The limiter (limiter.py) owns the decisions users see: which levels apply, the refusal messages, the
``Retry-After`` values and the ``x-ratelimit-*`` headers. A store owns the state and one operation that
must be atomic: look at every level of a request and, only when each has room, charge them all. The
rule "has room" is :func:`has_room` here; the Redis store runs the same rule inside its Lua script
(redis_scripts.py), and the limiter's tests run against both stores so the two cannot drift apart.

- memory_store.py: the state in this process (the default; each gateway replica enforces its own).
- redis_store.py: the state in Redis, shared by every replica (``LORAPLEX_REDIS_URL``).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from app.limits.limits import Limits

Settle = Callable[[int], None]
"""Ends an admission: takes the tokens the request used (prompt plus completion); called once."""


@dataclass(frozen=True, slots=True)
class Ask:
    """One level of a request: a tenant (``key_id`` None) or one of its keys, with its limits now."""

    tenant_id: uuid.UUID
    key_id: uuid.UUID | None
    limits: Limits

    @property
    def level_id(self) -> tuple[uuid.UUID, uuid.UUID | None]:
        return (self.tenant_id, self.key_id)


@dataclass(frozen=True, slots=True)
class Month:
    """The calendar month (UTC) a budget counts: ``[start, end)``, and the instant the request was seen."""

    start: datetime
    end: datetime
    now: datetime


@dataclass(frozen=True, slots=True)
class Seen:
    """One level as the store found it at admission, before charging anything (refusals quote it)."""

    num_requests: int
    """Requests charged in the last minute."""
    requests_wait_s: float
    """Seconds until one more request fits under the limit: 0 now (or no limit), infinity never."""
    num_tokens: int
    """Tokens charged in the last minute."""
    tokens_wait_s: float
    """Seconds until the request's tokens fit under the limit: 0 now (or no limit), infinity never."""
    num_running: int
    """Requests of this level running now (admitted and not settled)."""
    num_month_used: int | None
    """Tokens used and reserved this month; None when the level has no budget."""


NOTHING_SEEN = Seen(0, 0.0, 0, 0.0, 0, None)
"""What a level looks like when its store could not be asked and the limits let requests through."""


@dataclass(frozen=True, slots=True)
class WindowView:
    """One level's two minute windows now, for the headers."""

    num_requests: int
    requests_reset_s: float
    """Seconds until the requests window is empty again; 0 when it is."""
    num_tokens: int
    tokens_reset_s: float


def has_room(limits: Limits, seen: Seen, num_tokens: int) -> bool:
    """Whether a level can take a request of ``num_tokens`` (prompt plus ``max_tokens``) now."""
    budget, num_used = limits.max_tokens_per_month, seen.num_month_used
    if budget is not None and num_used is not None and num_used + num_tokens > budget:
        return False
    if limits.max_concurrent is not None and seen.num_running >= limits.max_concurrent:
        return False
    return seen.requests_wait_s == 0 and seen.tokens_wait_s == 0


class LimitStore(Protocol):
    """Where the limits' state lives; see the module docstring."""

    async def take(self, asks: Sequence[Ask], num_tokens: int, month: Month) -> tuple[list[Seen], Settle | None]:
        """Look at each level and, when every one has room, charge them all at once.

        Charging is one request and ``num_tokens`` in the minute windows, a concurrency slot, and
        ``num_tokens`` reserved in the month's budget (on levels that have one). Returns what each level
        looked like before, in ``asks``' order, and the settle function (None when something had no room:
        then nothing was charged anywhere). Raises ServiceUnavailableError (503) when a limit cannot be
        checked and its policy refuses in that case.
        """
        ...

    def view(self, ask: Ask) -> WindowView:
        """The level's minute windows now, as well as this store knows them without waiting."""
        ...

    async def close(self) -> None:
        """Stop background work and let go of connections."""
        ...
