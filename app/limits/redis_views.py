"""The minute windows as this replica last saw them in Redis: what the ``x-ratelimit-*`` headers show.

The headers are written without waiting (the routes ask for them synchronously, and a round trip per
answer for advisory numbers would cost more than they are worth), so they come from the last reply of
Redis about each level (an admission, refused or not, or a settle), aged by the time since: a window
whose newest charge has left it reads empty; otherwise the counts are those of the reply. A settle
lowers the tokens here at once, before Redis answers, so that an answer sent right after its run ends
shows what the run used, as the in-process limiter does. Another replica's requests since the last
reply are not in the headers; the limits themselves are always checked in Redis.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from app.limits.store import WindowView
from app.limits.window import WINDOW_S

LevelId = tuple[uuid.UUID, uuid.UUID | None]
EMPTY = WindowView(0, 0.0, 0, 0.0)


@dataclass(slots=True)
class Observed:
    """One level's windows in one reply of Redis."""

    at: float
    """Redis's time of the reply (seconds)."""
    local_at: float
    """This process's monotonic time when the reply was read."""
    num_requests: int
    newest_request_at: float | None
    num_tokens: int
    newest_token_at: float | None


class SeenWindows:
    """The last reply about each level; ``clock`` (seconds), when given, is the time Redis's replies are in."""

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self._clock = clock
        self._observed: dict[LevelId, Observed] = {}

    def observe(self, level_id: LevelId, observed: Observed) -> None:
        """Keep ``observed`` unless a later reply about the level came first."""
        current = self._observed.get(level_id)
        if current is None or current.at <= observed.at:
            self._observed[level_id] = observed

    def lower_tokens(self, level_id: LevelId, charged_at: float, num_tokens: int) -> None:
        """Take ``num_tokens`` off a charge made at ``charged_at``, if the last reply counts it and it is still in."""
        observed = self._observed.get(level_id)
        if observed is None or observed.at < charged_at or charged_at + WINDOW_S <= self._now(observed):
            return
        observed.num_tokens = max(0, observed.num_tokens - num_tokens)

    def view(self, level_id: LevelId) -> WindowView:
        observed = self._observed.get(level_id)
        if observed is None:
            return EMPTY
        now = self._now(observed)
        requests_reset_s = _reset_s(observed.newest_request_at, now)
        tokens_reset_s = _reset_s(observed.newest_token_at, now)
        return WindowView(
            observed.num_requests if requests_reset_s > 0 else 0,
            requests_reset_s,
            observed.num_tokens if tokens_reset_s > 0 else 0,
            tokens_reset_s,
        )

    def _now(self, observed: Observed) -> float:
        """Redis's time now, as far as this process can tell."""
        if self._clock is not None:
            return self._clock()
        return observed.at + (time.monotonic() - observed.local_at)


def _reset_s(newest_at: float | None, now: float) -> float:
    return 0.0 if newest_at is None else max(0.0, newest_at + WINDOW_S - now)
