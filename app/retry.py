"""How the gateway waits before trying again: capped exponential backoff with jitter.

The wait after the n-th failure in a row is drawn uniformly from ``[ceiling / 2, ceiling]``, where the
ceiling is ``initial_s * 2**n`` capped at ``max_s``. The random half keeps replicas that lost the same
database at the same moment from retrying in lockstep (each retry wave would otherwise hit it at once);
the fixed half keeps the backoff a backoff. A success resets the count.
"""

import asyncio
import random

JITTER_FRACTION = 0.5  # the share of each wait that is random: waits fall in [ceiling * (1 - this), ceiling]


class Backoff:
    """The waits between tries of one thing that keeps failing; :meth:`reset` once it worked."""

    def __init__(self, initial_s: float, max_s: float, rng: random.Random | None = None) -> None:
        if not 0 < initial_s <= max_s:
            raise ValueError(f"backoff needs 0 < initial_s <= max_s, got {initial_s} and {max_s}")
        self.initial_s = initial_s
        self.max_s = max_s
        self._rng = rng if rng is not None else random.Random()
        self._num_failures = 0

    @property
    def num_failures(self) -> int:
        """Failures in a row since the last reset."""
        return self._num_failures

    def ceiling_s(self) -> float:
        """The longest the next wait can be: ``initial_s`` doubled per failure so far, capped at ``max_s``."""
        return min(self.max_s, self.initial_s * 2.0 ** min(self._num_failures, 64))

    def next_delay_s(self) -> float:
        """The wait after one more failure: a draw in ``[ceiling / 2, ceiling]``; counts the failure."""
        ceiling_s = self.ceiling_s()
        self._num_failures += 1
        return ceiling_s * (1.0 - JITTER_FRACTION * self._rng.random())

    async def wait(self) -> float:
        """Sleep for :meth:`next_delay_s`; the seconds slept."""
        delay_s = self.next_delay_s()
        await asyncio.sleep(delay_s)
        return delay_s

    def reset(self) -> None:
        """It worked: the next failure starts again from ``initial_s``."""
        self._num_failures = 0
