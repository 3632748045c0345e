"""The OpenAI Agents SDK against a live server on the default model and the weather demo adapter: on its chat
completions model and on its Responses model, the agent calls ``get_weather`` with valid arguments, gets the
result and answers with it; the start banner's Agents SDK example runs as printed and does the same.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import TypeVar

import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

from app.demo.tenant import DemoAccess
from app.demo.weather import AGENT_MAX_TOKENS, CHECK_CITY, CHECK_PROMPT, CHECK_RESULT, TOOL_DESCRIPTION
from app.serve import AGENTS_EXAMPLE_BEGIN, AGENTS_EXAMPLE_END, banner
from tests.app.gateway_fixtures import TenantKey, make_tenant
from tests.app.live_server import LiveServer, live_server

pytestmark = pytest.mark.default_model

WEATHER_ADAPTER = "weather"


@pytest.fixture
def weather_server(gateway_settings, default_engine, trained_demo_adapters) -> Iterator[tuple[LiveServer, TenantKey]]:
    with live_server(gateway_settings, default_engine) as server:
        folder = trained_demo_adapters[WEATHER_ADAPTER]
        tenant = server.run(make_tenant(server.gateway, "agents", adapters={WEATHER_ADAPTER: folder}))
        yield server, tenant


def _agent(model: OpenAIChatCompletionsModel | OpenAIResponsesModel, calls: list[str]) -> Agent:
    @function_tool(description_override=TOOL_DESCRIPTION)
    def get_weather(city: str) -> str:
        calls.append(city)
        return CHECK_RESULT

    return Agent(
        name="weather",
        tools=[get_weather],
        model=model,
        model_settings=ModelSettings(temperature=0, max_tokens=AGENT_MAX_TOKENS),
    )


T = TypeVar("T")


async def _closing(client: openai.AsyncOpenAI, run: Awaitable[T]) -> T:
    """``run``'s result, the client closed on the loop its connections belong to (left to the garbage
    collector, it closes them after that loop is gone, and the error lands in whichever test runs then)."""
    try:
        return await run
    finally:
        await client.close()


def test_the_agents_sdk_runs_a_tool_loop_on_both_its_models(weather_server) -> None:
    server, tenant = weather_server
    set_tracing_disabled(True)
    for kind, chained in (
        (OpenAIChatCompletionsModel, False),
        (OpenAIResponsesModel, False),
        (OpenAIResponsesModel, True),  # the second turn continues the stored first
    ):
        # A client per run: its connections belong to the event loop that asyncio.run closes at the end.
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=tenant.key, max_retries=0)
        model = kind(WEATHER_ADAPTER, client)
        calls: list[str] = []
        run = Runner.run(_agent(model, calls), CHECK_PROMPT, max_turns=3, auto_previous_response_id=chained)
        result = asyncio.run(_closing(client, run))
        what = (type(model).__name__, chained, result.final_output)
        assert calls == [CHECK_CITY], what  # called once, with its one argument valid
        assert CHECK_RESULT in result.final_output, what
        if chained:
            assert result.last_response_id is not None


def test_the_banner_example_runs_as_printed(weather_server, tmp_path: Path) -> None:
    server, tenant = weather_server
    text = banner(server.url, "SmolLM2-135M-Instruct", DemoAccess(api_key=tenant.key, adapters=(WEATHER_ADAPTER,)))
    example = text[text.index(AGENTS_EXAMPLE_BEGIN) : text.index(AGENTS_EXAMPLE_END)]
    program = tmp_path / "agent.py"
    program.write_text(example)
    result = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() in text, result.stdout  # what the banner says it prints
