"""The gauges a Kubernetes router reads from /metrics, in vLLM's names and labels, one series per engine worker.

The Gateway API Inference Extension's endpoint picker and llm-d route a LoRA request to a replica whose
``vllm:lora_requests_info`` names the adapter among ``running_lora_adapters``, and weigh replicas by
``vllm:num_requests_waiting``, ``vllm:num_requests_running`` and ``vllm:kv_cache_usage_perc``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from sqlalchemy import select

from app.db.tables import Adapter
from app.engine_clients.interface import LOCAL_WORKER
from app.engine_clients.thread import LocalEngineClient
from app.observability.metrics import GatewayMetrics
from app.services import Gateway
from engine import EngineStats
from tests.app.gateway_fixtures import TenantKey, default_engine_config, gateway_client, make_tenant

WAIT_S = 30.0  # for the engine to admit a request, on a busy 2-core machine
POLL_S = 0.05
LONG_TOKENS = 400  # far more than the test needs a request to keep running (it is aborted)
LORA_INFO = "vllm:lora_requests_info"

Samples = dict[str, list[Sample]]


@pytest.fixture(scope="module")
def one_slot_engine(data_home: Path) -> Iterator[LocalEngineClient]:
    """The default model's engine with room for one running sequence, so that a second request waits."""
    config = dataclasses.replace(default_engine_config(data_home), max_num_seqs=1)
    client = LocalEngineClient(config, Path(config.model).name)
    asyncio.run(client.start())
    yield client
    asyncio.run(client.stop())


def _samples(text: str) -> Samples:
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def _value(samples: Samples, name: str) -> float:
    (sample,) = samples[name]
    assert sample.labels == {"worker": LOCAL_WORKER}, f"{name} is labelled {sample.labels}"
    return sample.value


async def _scrape_until(client: httpx.AsyncClient, ready: Callable[[Samples], bool]) -> Samples:
    deadline = time.monotonic() + WAIT_S
    while True:
        response = await client.get("/metrics")
        assert response.status_code == 200
        samples = _samples(response.text)
        if ready(samples):
            return samples
        assert time.monotonic() < deadline, f"the engine never got there: {response.text}"
        await asyncio.sleep(POLL_S)


async def _engine_names(gateway: Gateway, tenant: TenantKey) -> dict[str, str]:
    """The engine's name for each of the tenant's adapters (the router sees these names)."""
    async with gateway.database.sessions() as session:
        rows = (
            await session.execute(select(Adapter.name, Adapter.id).where(Adapter.tenant_id == tenant.tenant_id))
        ).all()
    return {name: str(adapter_id) for name, adapter_id in rows}


def _long_completion(model: str) -> dict[str, object]:
    return {"model": model, "prompt": "1, 2, 3, 4,", "max_tokens": LONG_TOKENS, "temperature": 0, "ignore_eos": True}


@pytest.mark.anyio
async def test_router_gauges_name_the_adapters_of_running_and_waiting_requests(
    gateway_settings, one_slot_engine, tenant_adapters
) -> None:
    async with gateway_client(gateway_settings, one_slot_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme", adapters=tenant_adapters)
        names = await _engine_names(gateway, acme)
        max_adapters = one_slot_engine.engine.engine.adapters.capacity()  # the label must say the engine's room
        post = client.post  # the two requests run in tasks while the test scrapes
        running = asyncio.create_task(post("/v1/completions", json=_long_completion("alpha"), headers=acme.headers))
        try:
            await _scrape_until(client, lambda s: _value(s, "vllm:num_requests_running") >= 1)
            waiting = asyncio.create_task(post("/v1/completions", json=_long_completion("beta"), headers=acme.headers))
            try:
                samples = await _scrape_until(client, lambda s: _value(s, "vllm:num_requests_waiting") >= 1)
            finally:
                one_slot_engine.abort_all()
                await waiting
        finally:
            one_slot_engine.abort_all()
            await running

    assert _value(samples, "vllm:num_requests_running") == 1
    assert _value(samples, "vllm:num_requests_waiting") == 1
    assert 0 < _value(samples, "vllm:kv_cache_usage_perc") <= 1
    (info,) = samples[LORA_INFO]
    assert info.labels == {
        "worker": LOCAL_WORKER,
        "running_lora_adapters": names["alpha"],
        "waiting_lora_adapters": names["beta"],
        "max_lora": str(max_adapters),
    }
    assert max_adapters >= 1
    assert abs(info.value - time.time()) < WAIT_S, "the value is the unix time of the update, as vLLM sets it"
    assert _value(samples, "loraplex_running_sequences") == 1 and _value(samples, "loraplex_queue_depth") == 1
    assert {sample.labels["worker"] for sample in samples["loraplex_pool_pages"]} == {LOCAL_WORKER}


def _stats(num_running: int, running: list[str], waiting: list[str]) -> EngineStats:
    return EngineStats(
        num_pages=100,
        block_size=16,
        page_bytes=4096,
        pages_by_owner={"free": 60, "kv": 25, "prefix_cache": 10, "adapter": 5},
        num_running=num_running,
        num_waiting=len(waiting),
        num_resident_adapters=len(running),
        num_preemptions=0,
        num_prompt_tokens=0,
        num_cached_prompt_tokens=0,
        num_generated_tokens=0,
        running_adapters=running,
        waiting_adapters=waiting,
        max_adapters=8,
        dtype="bfloat16",
        kv_dtype="bfloat16",
        weight_format="int8",
        precision_reason="measured here",
    )


def test_each_scrape_shows_only_the_workers_there_and_their_current_adapters() -> None:
    metrics = GatewayMetrics()
    metrics.render({"r1": _stats(2, ["a", "b"], []), "r2": _stats(1, ["c"], ["d", "e"])}, usage_pending=0)
    samples = _samples(metrics.render({"r1": _stats(1, ["b"], ["a"])}, usage_pending=0).decode())

    assert [s.labels for s in samples[LORA_INFO]] == [
        {"worker": "r1", "max_lora": "8", "waiting_lora_adapters": "a", "running_lora_adapters": "b"}
    ], "one series per worker: the gone worker's and the old label set are dropped"
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "loraplex_queue_depth"):
        assert [s.labels["worker"] for s in samples[name]] == ["r1"]
    assert [s.value for s in samples["vllm:kv_cache_usage_perc"]] == [0.25], "KV pages over all pages of the pool"
    assert {s.labels["worker"] for s in samples["loraplex_pool_pages"]} == {"r1"}

    (precision,) = samples["loraplex_precision_info"]
    assert precision.labels == {
        "worker": "r1",
        "dtype": "bfloat16",
        "activations": "float32",
        "kv": "bfloat16",
        "weights": "int8",
        "reason": "measured here",
    }

    stopped = _samples(metrics.render(None, usage_pending=3).decode())
    assert not stopped[LORA_INFO] and not stopped["loraplex_running_sequences"], "no engine, no engine series"
    assert stopped["loraplex_usage_records_pending"][0].value == 3
