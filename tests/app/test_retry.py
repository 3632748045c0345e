"""The one backoff the gateway retries with: capped, exponential, jittered, reset by a success."""

import asyncio
import random
import time

import pytest

from app.retry import Backoff


def test_waits_double_up_to_the_cap_each_between_half_and_all_of_its_ceiling() -> None:
    backoff = Backoff(0.1, 1.0, random.Random(7))
    ceilings = [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    for ceiling in ceilings:
        assert backoff.ceiling_s() == pytest.approx(ceiling)
        delay = backoff.next_delay_s()
        assert ceiling / 2 <= delay <= ceiling
    assert backoff.num_failures == len(ceilings)


def test_a_success_starts_the_backoff_over() -> None:
    backoff = Backoff(0.1, 5.0, random.Random(1))
    for _ in range(6):
        backoff.next_delay_s()
    backoff.reset()
    assert backoff.ceiling_s() == pytest.approx(0.1) and backoff.next_delay_s() <= 0.1


def test_replicas_that_failed_together_do_not_retry_in_lockstep() -> None:
    """Ten replicas losing the database at once: their waits spread over the jitter band instead of coinciding."""
    replicas = [Backoff(0.2, 5.0, random.Random(seed)) for seed in range(10)]
    for _ in range(4):
        delays = [replica.next_delay_s() for replica in replicas]
        assert len({round(delay, 6) for delay in delays}) == len(delays)
        assert max(delays) - min(delays) > 0.1 * max(delays)


def test_many_failures_stay_at_the_cap() -> None:
    backoff = Backoff(0.1, 2.0)
    delays = [backoff.next_delay_s() for _ in range(2000)]
    assert max(delays) <= 2.0 and min(delays[10:]) >= 1.0


def test_wait_sleeps_the_drawn_delay() -> None:
    backoff = Backoff(0.05, 0.05, random.Random(3))
    started = time.perf_counter()
    slept = asyncio.run(backoff.wait())
    assert 0.025 <= slept <= 0.05 and time.perf_counter() - started >= slept * 0.9


@pytest.mark.parametrize(("initial_s", "max_s"), [(0.0, 1.0), (-1.0, 1.0), (2.0, 1.0)])
def test_a_backoff_that_could_not_back_off_is_refused(initial_s: float, max_s: float) -> None:
    with pytest.raises(ValueError, match="0 < initial_s <= max_s"):
        Backoff(initial_s, max_s)
