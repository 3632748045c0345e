"""The engine on a thread of this process (``LORAPLEX_ENGINE=thread``): what its start can get wrong.

What it shares with the process engine as a client is tested on both (``on_both_engines``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from app.engine_clients.thread import LocalEngineClient
from engine import EngineConfig, RequestOutput, SamplingParams
from engine.errors import ConfigError, EngineDeadError
from tests.engine.engine_threads import default_model_config, record_engine_threads
from tests.engine.tiny_models import make_tiny_model

pytestmark = pytest.mark.anyio

START_WAIT_S = 120.0
POOL_BYTES = 8 * 1024**2  # a few pages: the tiny model needs no more


@pytest.mark.default_model
async def test_the_step_thread_builds_the_engine_it_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """libgomp's pool is per thread: stepping on another thread than the builder's is slower (engine_build.py)."""
    threads = record_engine_threads(monkeypatch)
    client = LocalEngineClient(default_model_config(), "default")
    await asyncio.wait_for(client.start(), START_WAIT_S)
    engine = client.engine.engine
    try:
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        ids = client.encode_prompt("The capital of France is")
        outputs = [output async for output in client.generate(ids, params, "threads", None)]
        assert len(outputs[-1].token_ids) == 8 and outputs[-1].request_finished
    finally:
        await client.stop()
    threads.check_stepped_where_built(engine)


async def test_an_engine_that_cannot_start_says_why(tmp_path: Path) -> None:
    client = LocalEngineClient(EngineConfig(model=str(tmp_path)), "nothing")
    with pytest.raises(ConfigError, match=r"config\.json"):
        await asyncio.wait_for(client.start(), START_WAIT_S)
    assert not client.is_ready()


async def test_a_dead_step_loop_turns_the_client_not_ready(tmp_path: Path) -> None:
    """``/ready`` asks ``is_ready()``: after the step loop died it must answer 503, as with the process engine."""
    client = LocalEngineClient(
        EngineConfig(model=str(make_tiny_model(tmp_path, "llama")), pool_bytes=POOL_BYTES), "tiny"
    )
    await asyncio.wait_for(client.start(), START_WAIT_S)
    try:
        assert client.is_ready()

        def broken_step() -> list[RequestOutput]:
            raise RuntimeError("a fault in the step")

        client.engine.engine.step = broken_step
        with pytest.raises(EngineDeadError, match="a fault in the step"):
            async for _ in client.generate([5, 6, 7], SamplingParams(max_tokens=3), "doomed", None):
                pass
        assert not client.is_ready()
    finally:
        await client.stop()
