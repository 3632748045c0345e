"""The engine in a worker process: the thread engine's outputs exactly, a clean stop, and a worker that dies.

The behaviour both clients share (streaming, choices, aborts, adapters, errors, usage) is tested on both by
the tests marked ``on_both_engines``; these are what only a process can do, or get wrong.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid
from pathlib import Path

import httpx
import pytest

from app.engine_clients.interface import EngineClient
from app.engine_clients.process import ProcessEngineClient
from app.engine_clients.thread import LocalEngineClient
from app.settings import Settings
from engine import EngineConfig, GrammarConstraint, RequestOutput, SamplingParams
from engine.errors import ConfigError, EngineDeadError, RequestError, UnknownAdapterError
from engine.sampling.grammar import GrammarError
from tests.app.gateway_fixtures import make_tenant, start_process_engine, usage_rows
from tests.app.live_server import live_server
from tests.app.thread_ticks import cpu_ticks

pytestmark = pytest.mark.default_model

# Every feature whose totals cross as deltas: choices, logprobs, prompt logprobs, stop strings, a grammar.
REQUESTS = [
    SamplingParams(max_tokens=12, temperature=0.0, n=2, logprobs=3, stop=(" the",)),
    SamplingParams(max_tokens=6, temperature=0.7, seed=5, n=3, prompt_logprobs=2),
    SamplingParams(max_tokens=20, temperature=0.0, constraint=GrammarConstraint.choice(["yes", "no", "maybe"])),
]


def snapshot(output: RequestOutput) -> tuple:
    """An output as the gateway reads it when it arrives (its growing lists copied), its timing left out."""
    return (
        output.index,
        list(output.token_ids),
        output.text,
        list(output.delta_token_ids),
        output.delta_text,
        output.finish_reason,
        output.num_cached_tokens,
        output.request_finished,
        None if output.logprobs is None else list(output.logprobs),
        output.prompt_logprobs,
    )


async def _collect(engine: EngineClient, prompt_ids: list[int], params: SamplingParams) -> list[tuple]:
    request_id = f"parity-{uuid.uuid4().hex}"
    return [snapshot(output) async for output in engine.generate(prompt_ids, params, request_id, None)]


@pytest.mark.anyio
async def test_the_process_engine_streams_what_the_thread_engine_streams(
    thread_engine: LocalEngineClient, process_engine: ProcessEngineClient
) -> None:
    # A prompt neither engine has cached, so both count the same cached tokens.
    text = f"Write one word about the sea ({uuid.uuid4().hex[:8]}):"
    prompt = process_engine.encode_prompt(text)
    assert prompt == thread_engine.encode_prompt(text)
    for params in REQUESTS:
        assert await _collect(process_engine, prompt, params) == await _collect(thread_engine, prompt, params)


@pytest.mark.anyio
async def test_errors_keep_their_engine_classes(process_engine: ProcessEngineClient, tmp_path: Path) -> None:
    with pytest.raises(UnknownAdapterError):
        async for _ in process_engine.generate([1, 2], SamplingParams(max_tokens=2), "no-adapter", "nope"):
            pass
    with pytest.raises(RequestError, match="context"):
        async for _ in process_engine.generate([1] * 8, SamplingParams(max_tokens=10**6), "too-long", None):
            pass
    with pytest.raises(GrammarError):
        await process_engine.check_constraint(GrammarConstraint.regex("(unclosed"))
    with pytest.raises(UnknownAdapterError):
        await process_engine.remove_adapter("nope")
    assert process_engine.is_ready()


@pytest.mark.anyio
async def test_the_worker_steps_on_the_thread_that_built_the_engine(process_engine: ProcessEngineClient) -> None:
    """A step loop on a second thread gives libgomp a second pool and throttles its spin-wait (EngineWorker.run):
    the process's main thread, which built the engine, must do the stepping (its CPU time grows with the steps)."""
    main_thread = Path(f"/proc/{process_engine.pid}/task/{process_engine.pid}/stat")
    process = Path(f"/proc/{process_engine.pid}/stat")
    main_before, process_before = cpu_ticks(main_thread), cpu_ticks(process)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    outputs = [output async for output in process_engine.generate([1, 2, 3], params, "threads", None)]
    assert outputs[-1].request_finished
    main_spent, process_spent = cpu_ticks(main_thread) - main_before, cpu_ticks(process) - process_before
    assert process_spent > 0
    assert main_spent >= 0.3 * process_spent, (main_spent, process_spent)  # a reader-only main thread spends ~0


@pytest.mark.anyio
async def test_stop_ends_the_streams_in_flight_and_the_worker_process(data_home: Path) -> None:
    engine = await asyncio.to_thread(start_process_engine, data_home)
    process_id = engine.pid
    params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
    outputs = engine.generate([1, 2, 3, 4], params, "long", None)
    first = await anext(outputs)
    await engine.stop()
    rest = [output async for output in outputs]

    assert first.finish_reason is None
    assert rest[-1].finish_reason == "abort" and rest[-1].request_finished
    assert not engine.is_ready() and engine.pid is None
    with pytest.raises(ProcessLookupError):
        os.kill(process_id, 0)


@pytest.mark.anyio
async def test_an_engine_that_cannot_start_says_why(tmp_path: Path) -> None:
    engine = ProcessEngineClient(EngineConfig(model=str(tmp_path)), "nothing")
    with pytest.raises(ConfigError, match=r"config\.json"):
        await engine.start()
    assert not engine.is_ready() and engine.pid is None


def test_a_killed_worker_ends_its_streams_with_an_error_event_and_one_usage_row_each(
    gateway_settings: Settings, data_home: Path
) -> None:
    engine = start_process_engine(data_home)
    try:
        with live_server(gateway_settings, engine) as server:
            acme = server.run(make_tenant(server.gateway, "acme"))
            body = {
                "model": engine.model_name,
                "prompt": "1, 2, 3, 4,",
                "max_tokens": 500,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            with httpx.Client(base_url=server.url, timeout=60.0) as http:
                assert http.get("/ready").status_code == 200
                with http.stream("POST", "/v1/completions", json=body, headers=acme.headers) as response:
                    events = response.iter_lines()
                    first = next(line for line in events if line.startswith("data: "))
                    assert engine.pid is not None
                    os.kill(engine.pid, signal.SIGKILL)
                    rest = [line.removeprefix("data: ") for line in events if line.startswith("data: ")]
                ready = http.get("/ready")
                after = http.post("/v1/completions", json={**body, "stream": False}, headers=acme.headers)
            rows = server.run(usage_rows(server.gateway))
    finally:
        asyncio.run(engine.stop())

    assert json.loads(first.removeprefix("data: "))["choices"][0]["text"] is not None
    assert rest, "the stream ended without a word"
    error = json.loads(rest[-1])["error"]
    assert error["code"] == "service_unavailable" and "engine" in error["message"]
    assert "[DONE]" not in rest
    assert ready.status_code == 503 and ready.json()["checks"]["model"] is False
    assert after.status_code == 503
    assert [row.status for row in rows] == ["error"]
    assert not engine.is_ready()
    with pytest.raises(EngineDeadError):
        asyncio.run(engine.stats())
