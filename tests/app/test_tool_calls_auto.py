"""``tool_choice: auto`` on the real default model, through real clients: text or calls, whole or streamed.

The default model seldom decides to call a tool on its own, so the tests that need a call serve it with
the ``pythonic`` format (LORAPLEX_TOOL_CALL_FORMAT) and a template that renders tools and calls in it
(LORAPLEX_CHAT_TEMPLATE), and push it to open a call with a ``logit_bias`` on ``[``, the one token that
opens a pythonic call list: what follows is up to the model, within the structural tag (a tool's name,
then arguments valid against its schema).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import jsonschema
import openai
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import Field

from tests.app.gateway_fixtures import TenantKey, make_tenant
from tests.app.live_server import LiveServer, live_server

pytestmark = pytest.mark.default_model

OPEN_BRACKET = 75  # the default model's token "[": it opens a pythonic call list
CALL_BIAS = {str(OPEN_BRACKET): 40}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
        },
        "strict": True,
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 12}},
            "required": ["zone"],
        },
    },
}
# The libraries' tools take a bounded city, as WEATHER does: the bias on "[" holds inside a string too, so an
# unbounded one fills with "[" until max_tokens ends the call unclosed.
City = Annotated[str, Field(max_length=12)]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
PYTHONIC_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message.role + '\\n' -}}"
    "{%- if message.role == 'system' and tools -%}"
    "{{- 'Call functions as [name(arg=value)]. Functions:\\n' -}}"
    "{%- for t in tools -%}{{- (t | tojson) + '\\n' -}}{%- endfor -%}"
    "{%- endif -%}"
    "{{- message.content or '' -}}"
    "{%- for call in message.tool_calls or [] -%}"
    "{{- '[' + call.function.name + '(' -}}"
    "{%- for key, value in call.function.arguments.items() -%}"
    "{{- key + '=' + (value | tojson) + (', ' if not loop.last else '') -}}"
    "{%- endfor -%}{{- ')]' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
ASK = [
    {"role": "system", "content": "You are a weather assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
]


@pytest.fixture
def pythonic_server(gateway_settings, default_engine, tmp_path: Path) -> Iterator[LiveServer]:
    template = tmp_path / "pythonic.jinja"
    template.write_text(PYTHONIC_TEMPLATE)
    settings = dataclasses.replace(gateway_settings, tool_call_format="pythonic", chat_template=template)
    with live_server(settings, default_engine) as running:
        yield running


@pytest.fixture
def client(pythonic_server: LiveServer) -> openai.OpenAI:
    key = pythonic_server.run(make_tenant(pythonic_server.gateway, "acme"))
    return openai.OpenAI(base_url=f"{pythonic_server.url}/v1", api_key=key.key, max_retries=0)


def _check_call(call) -> None:
    assert call.id.startswith("call_") and call.type == "function"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_auto_answers_in_text_when_the_model_writes_text(server: LiveServer, acme: TenantKey, default_engine) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=acme.key, max_retries=0)
    reply = client.chat.completions.create(
        model=default_engine.model_name,
        messages=[{"role": "user", "content": "Tell me a joke."}],
        tools=[WEATHER, TIME],  # no tool_choice: OpenAI's default, auto
        max_tokens=12,
        temperature=0,
    )
    (choice,) = reply.choices
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_auto_calls_a_tool_in_the_models_format_and_parallel_false_holds_one(client, default_engine) -> None:
    reply = client.chat.completions.create(
        model=default_engine.model_name,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="auto",
        parallel_tool_calls=False,
        logit_bias=CALL_BIAS,
        max_tokens=40,
        temperature=0,
    )
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    _check_call(call)


def test_parallel_calls_and_a_call_cut_by_max_tokens(client, default_engine) -> None:
    reply = client.chat.completions.create(
        model=default_engine.model_name,
        messages=[*ASK[:1], {"role": "user", "content": "Weather in Paris and Rome, and the time in Tokyo?"}],
        tools=[WEATHER, TIME],
        logit_bias=CALL_BIAS,
        max_tokens=60,
        temperature=0.8,
        seed=1,
        n=3,
    )
    for choice in reply.choices:
        if choice.finish_reason == "tool_calls":
            assert choice.message.tool_calls
            for call in choice.message.tool_calls:
                _check_call(call)
        else:  # cut inside the list: no half call, the text as it was written
            assert choice.finish_reason == "length" and choice.message.tool_calls is None
            assert choice.message.content.startswith("[")
    assert any(len(choice.message.tool_calls or []) > 1 for choice in reply.choices), reply

    cut = client.chat.completions.create(
        model=default_engine.model_name, messages=ASK, tools=[WEATHER], logit_bias=CALL_BIAS, max_tokens=4
    )
    (choice,) = cut.choices
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content.startswith("[get")  # "[", "get", "_", "weather": the call cut short


def test_streamed_calls_are_reassembled_by_the_official_client(client, default_engine) -> None:
    with client.chat.completions.stream(
        model=default_engine.model_name,
        messages=ASK,
        tools=[WEATHER, TIME],
        parallel_tool_calls=False,
        logit_bias=CALL_BIAS,
        max_tokens=40,
        temperature=0,
    ) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    (choice,) = final.choices
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    _check_call(call)
    assert any(event.type == "tool_calls.function.arguments.delta" for event in events)
    done = [event for event in events if event.type == "tool_calls.function.arguments.done"]
    assert [event.arguments for event in done] == [call.function.arguments]


def test_langchain_bind_tools_and_a_tool_loop(pythonic_server: LiveServer, client, default_engine) -> None:
    @tool
    def get_weather(city: City) -> str:
        """The weather in a city."""
        return f"18 C and sunny in {city}"

    llm = ChatOpenAI(
        base_url=f"{pythonic_server.url}/v1",
        api_key=client.api_key,
        model=default_engine.model_name,
        max_tokens=30,
        temperature=0,
        logit_bias={OPEN_BRACKET: 40},
    )
    bound = llm.bind_tools([get_weather], parallel_tool_calls=False)
    messages = [HumanMessage("What is the weather in Paris?")]
    for streamed in (False, True):
        answer = bound.invoke(messages) if not streamed else _joined(bound.stream(messages))
        (call,) = answer.tool_calls
        assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str) and call["id"]
    result = get_weather.invoke(call)  # LangChain's tool loop: run the call, send its result back
    assert isinstance(result, ToolMessage)
    follow_up = llm.bind_tools([get_weather], tool_choice="none").invoke([*messages, answer, result])
    assert isinstance(follow_up, AIMessage) and follow_up.content and not follow_up.tool_calls


def _joined(chunks) -> AIMessage:
    total = None
    for chunk in chunks:
        total = chunk if total is None else total + chunk
    return total


def test_pydantic_ai_agent_runs_its_tool(pythonic_server: LiveServer, client, default_engine) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(
        default_engine.model_name, provider=OpenAIProvider(base_url=f"{pythonic_server.url}/v1", api_key=client.api_key)
    )
    seen: list[str] = []
    agent = Agent(model, model_settings={"max_tokens": 30, "temperature": 0, "logit_bias": {str(OPEN_BRACKET): 40}})

    @agent.tool_plain
    def get_weather(city: City) -> str:
        """The weather in a city."""
        seen.append(city)
        return "18 C"

    with pytest.raises(Exception) as raised:  # the bias makes every turn a call: the agent stops at its limit
        agent.run_sync("What is the weather in Paris?", usage_limits=_limits(3))
    assert seen, raised.value  # the tool ran with the arguments the model gave
    assert "limit" in str(raised.value).lower()


def _limits(num_requests: int):
    from pydantic_ai.usage import UsageLimits

    return UsageLimits(request_limit=num_requests)
