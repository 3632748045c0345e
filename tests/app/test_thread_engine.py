"""The engine on a thread of this process (``LORAPLEX_ENGINE=thread``): what its start can get wrong.

What it shares with the process engine as a client is tested on both (``on_both_engines``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from app.engine_clients.thread import LocalEngineClient
from engine import EngineConfig, SamplingParams
from engine.errors import ConfigError
from tests.engine.engine_threads import default_model_config, record_engine_threads

pytestmark = pytest.mark.anyio

START_WAIT_S = 120.0


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
