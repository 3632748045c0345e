"""Fairness between tenants (VTC): a deep queue cannot starve a shallow one, weights shift service,
an idle tenant banks no credit, and the policy changes who goes first, never what is generated."""

import asyncio
from collections import Counter
from pathlib import Path

import pytest

from engine import ConfigError, Engine, RequestOutput, SamplingParams
from engine.drivers.async_engine import AsyncEngine
from engine.memory.page_pool import OwnerKind
from engine.scheduling.scheduler import SchedulerOutput
from tests.engine.conftest import check_invariants, make_engine

A, B = "a", "b"
LONG = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PAGE_BYTES = 2 * 16 * 2 * 2 * 16 * 4  # the tiny model: layers x block_size x (K, V) x kv_heads x head_dim x fp32


class Driver:
    """Steps an engine, checking the pool and the step's limits after every step."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.num_steps = 0
        self.generated: Counter[str] = Counter()  # tokens generated per tenant
        self.finals: dict[str, RequestOutput] = {}
        self._tenant_of: dict[str, str] = {}
        self._last: SchedulerOutput | None = None
        schedule = engine.scheduler.schedule

        def recording_schedule() -> SchedulerOutput:
            self._last = schedule()
            return self._last

        engine.scheduler.schedule = recording_schedule

    def submit(self, tenant: str, prompts: list[list[int]], params: SamplingParams) -> list[str]:
        ids = [self.engine.add_request(prompt, params, tenant=tenant) for prompt in prompts]
        self._tenant_of.update(dict.fromkeys(ids, tenant))
        return ids

    def step(self) -> list[RequestOutput]:
        outputs = self.engine.step()
        check_invariants(self.engine, self._last)
        self.num_steps += 1
        for output in outputs:
            self.generated[self._tenant_of[output.request_id]] += len(output.delta_token_ids)
            if output.finished:
                self.finals[output.request_id] = output
        return outputs

    def run(self, num_steps: int) -> Counter[str]:
        """Tokens generated per tenant over the next ``num_steps`` steps."""
        before = Counter(self.generated)
        for _ in range(num_steps):
            self.step()
        return self.generated - before

    def steps_to_first_tokens(self, request_ids: list[str], max_steps: int = 1000) -> int:
        """Steps taken until every one of ``request_ids`` has generated a token."""
        waiting = set(request_ids)
        for num_steps in range(1, max_steps + 1):
            waiting -= {output.request_id for output in self.step()}
            if not waiting:
                return num_steps
        raise AssertionError(f"{len(waiting)} request(s) got no token in {max_steps} steps")

    def drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.step()
        assert self.engine.pool.stats().pages_by_owner[OwnerKind.KV.value] == 0, "pages leaked"


def _prompts(first_token: int, num: int, length: int) -> list[list[int]]:
    return [[first_token + i % 40] * length for i in range(num)]


def _flood_then_shallow(driver: Driver, num_a: int = 40, num_b: int = 2) -> int:
    """A queues ``num_a`` long requests and fills the batch; then B sends ``num_b`` short ones.

    Returns how many steps B waits for its first tokens.
    """
    driver.submit(A, _prompts(3, num_a, 24), LONG)
    driver.run(8)
    assert [seq.tenant for seq in driver.engine.scheduler.running] == [A] * driver.engine.config.max_num_seqs
    return driver.steps_to_first_tokens(driver.submit(B, _prompts(200, num_b, 8), SHORT))


def test_a_deep_queue_cannot_starve_a_shallow_one(tiny_llama: Path) -> None:
    fair = Driver(make_engine(tiny_llama, max_num_seqs=4, max_num_batched_tokens=64))
    fifo = Driver(make_engine(tiny_llama, max_num_seqs=4, max_num_batched_tokens=64, scheduling_policy="fifo"))
    # A holds all 4 slots with 36 more waiting: fairness gives B its share (2 slots) in the very next
    # step, preempting A's two most recent admissions; FIFO makes B wait for all of A's 40.
    assert _flood_then_shallow(fair) == 1
    assert fair.engine.stats().num_preemptions == 2
    assert _flood_then_shallow(fifo) > 250
    fair.drain()


def test_preemption_takes_no_more_than_the_share(tiny_llama: Path) -> None:
    driver = Driver(make_engine(tiny_llama, max_num_seqs=4, max_num_batched_tokens=64))
    driver.submit(A, _prompts(3, 40, 24), LONG)
    driver.run(8)
    b_ids = driver.submit(B, _prompts(200, 8, 8), SHORT)
    while not all(request_id in driver.finals for request_id in b_ids):
        driver.step()
        num_running = Counter(seq.tenant for seq in driver.engine.scheduler.running)
        assert num_running[B] <= 2, "B takes more than its half of the 4 slots while A waits"
    # Each of B's requests takes a slot from A at most once (the slots B frees go back to A between).
    assert 2 <= driver.engine.stats().num_preemptions <= len(b_ids)
    driver.drain()


@pytest.mark.parametrize("weight_b", [1.0, 2.0, 3.0])
def test_weights_shift_service_proportionally(tiny_llama: Path, weight_b: float) -> None:
    driver = Driver(make_engine(tiny_llama, max_num_seqs=8, max_num_batched_tokens=64))
    driver.engine.set_tenant_weight(B, weight_b)
    driver.submit(A, _prompts(3, 60, 16), LONG)
    driver.submit(B, _prompts(100, 60, 16), LONG)
    driver.run(30)
    served = driver.run(200)
    assert set(Counter(seq.tenant for seq in driver.engine.scheduler.admission)) == {A, B}, "both stayed saturated"
    assert served[B] / served[A] == pytest.approx(weight_b, rel=0.15)


def test_a_returning_tenant_banks_no_credit(tiny_llama: Path) -> None:
    driver = Driver(make_engine(tiny_llama, max_num_seqs=4, max_num_batched_tokens=64))
    driver.submit(A, _prompts(3, 80, 16), LONG)
    b_ids = driver.submit(B, _prompts(100, 2, 8), SHORT)
    while not all(request_id in driver.finals for request_id in b_ids):
        driver.step()
    driver.run(100)  # B idle, A served alone: A's counter runs far ahead of B's
    counters = driver.engine.stats().tenant_counters
    assert counters[A] > counters[B] + 500
    driver.submit(B, _prompts(100, 40, 16), LONG)
    assert driver.engine.stats().tenant_counters[B] == counters[A]  # lifted to the active tenants' lowest
    served = driver.run(60)
    # Had B kept its lead, it would take every slot A frees for ~100 steps; it shares them instead.
    assert served[A] / (served[A] + served[B]) == pytest.approx(0.5, abs=0.1)


def test_a_shallow_tenant_gets_in_when_pages_run_out(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, max_num_seqs=8, max_num_batched_tokens=64, pool_bytes=24 * PAGE_BYTES)
    driver = Driver(engine)
    driver.submit(A, _prompts(3, 20, 40), SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    driver.run(30)
    assert engine.pool.stats().pages_by_owner[OwnerKind.FREE.value] == 0
    assert engine.stats().num_preemptions > 0  # A's own sequences already preempt each other for pages
    assert driver.steps_to_first_tokens(driver.submit(B, _prompts(200, 2, 8), SHORT)) <= 3
    driver.drain()


def test_greedy_outputs_do_not_depend_on_the_policy(tiny_llama: Path) -> None:
    tokens = {}
    for policy in ("fair", "fifo"):
        driver = Driver(make_engine(tiny_llama, max_num_seqs=4, max_num_batched_tokens=64, scheduling_policy=policy))
        _flood_then_shallow(driver, num_a=12, num_b=3)
        driver.drain()
        tokens[policy] = {request_id: output.token_ids for request_id, output in driver.finals.items()}
        assert len(tokens[policy]) == 15
    assert tokens["fair"] == tokens["fifo"]


def test_policy_and_weights_are_validated(tiny_llama: Path) -> None:
    with pytest.raises(ConfigError, match="scheduling_policy"):
        make_engine(tiny_llama, scheduling_policy="lottery")
    engine = make_engine(tiny_llama)
    for weight in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="weight"):
            engine.set_tenant_weight(A, weight)
    assert engine.stats().scheduling_policy == "fair"


def test_the_async_engine_serves_tenants_with_their_weights(tiny_llama: Path) -> None:
    async def main() -> dict[str, float]:
        engine = AsyncEngine(make_engine(tiny_llama))
        engine.start()
        try:
            await engine.set_tenant_weight(B, 2.0)
            for tenant in (A, B):
                async for _ in engine.generate([5] * 10, SHORT, tenant=tenant):
                    pass
            return (await engine.call(Engine.stats)).tenant_counters
        finally:
            await engine.stop()

    counters = asyncio.run(main())
    # The same request is half the service for a tenant of weight 2 (A's counter started at 0, B's was
    # lifted to A's when A went idle).
    assert counters[A] == 10 + 2 * 4
    assert counters[B] == counters[A] + (10 + 2 * 4) / 2
