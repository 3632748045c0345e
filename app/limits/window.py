"""A sliding one-minute window: what was charged in the last 60 seconds, exactly.

The one idea: a log of charges (time, amount), oldest first, and their running total. A charge counts
while ``now < at + WINDOW_S`` and drops off the front after that, so at most ``limit`` passes in *any*
60 seconds (a fixed window lets up to twice the limit through around its edge). The log holds one entry
per admitted request of the last minute, which the requests-per-minute limit itself bounds.

A charge may be lowered later (a token reservation settled with the actual usage) while it is in the
window; once it has dropped off, lowering it changes nothing.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

WINDOW_S = 60.0  # "per minute"


@dataclass(slots=True)
class Charge:
    """One admission's share of a window."""

    at: float
    amount: int
    in_window: bool = True


class SlidingWindow:
    """Amounts charged in the last minute; every method takes the current time ``now`` (seconds)."""

    __slots__ = ("_charges", "total")

    def __init__(self) -> None:
        self._charges: deque[Charge] = deque()
        self.total = 0
        """The sum of the amounts in the window, as of the last :meth:`prune`."""

    def prune(self, now: float) -> None:
        """Drop the charges made a minute or more before ``now``."""
        charges = self._charges
        while charges and charges[0].at + WINDOW_S <= now:
            charge = charges.popleft()
            charge.in_window = False
            self.total -= charge.amount

    def charge(self, now: float, amount: int) -> Charge:
        charge = Charge(now, amount)
        self._charges.append(charge)
        self.total += amount
        return charge

    def lower(self, charge: Charge, amount: int) -> None:
        """Make ``charge`` ``amount`` (no more than it was) if it is still in the window."""
        if charge.in_window and amount < charge.amount:
            self.total -= charge.amount - amount
            charge.amount = amount

    def wait_s(self, now: float, amount: int, limit: int) -> float:
        """Seconds until ``amount`` more fits under ``limit``: 0 if it fits now, infinity if it never can."""
        excess = self.total + amount - limit
        if excess <= 0:
            return 0.0
        for charge in self._charges:  # oldest first: the order in which they drop off
            excess -= charge.amount
            if excess <= 0:
                return charge.at + WINDOW_S - now
        return math.inf

    def reset_s(self, now: float) -> float:
        """Seconds until the window is empty again (its newest charge drops off); 0 when it is empty."""
        return self._charges[-1].at + WINDOW_S - now if self._charges else 0.0
