"""Real client libraries against a live server: the official `openai` client with logprobs and n, LangChain's
`OpenAI` and `ChatOpenAI` (which send frequency_penalty, presence_penalty, n... with every call), LangChain's
`with_structured_output` (both methods) and LiteLLM's `response_format`."""

from __future__ import annotations

import os
from typing import Literal

import openai
import pytest
from langchain_openai import ChatOpenAI, OpenAI
from pydantic import BaseModel

from tests.app.gateway_fixtures import TenantKey, on_both_engines
from tests.app.live_server import LiveServer

pytestmark = pytest.mark.default_model

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@on_both_engines
def test_official_client_with_logprobs_and_n(server: LiveServer, acme: TenantKey, default_engine) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=acme.key, max_retries=0)
    model = default_engine.model_name
    reply = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=6, temperature=0.8, seed=3, n=2, logprobs=True, top_logprobs=2
    )
    assert [choice.index for choice in reply.choices] == [0, 1]
    for choice in reply.choices:
        assert choice.logprobs is not None and choice.logprobs.content
        assert all(len(entry.top_logprobs) == 2 and entry.bytes for entry in choice.logprobs.content)

    stream = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=6, temperature=0, n=2, logprobs=True, stream=True
    )
    texts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts[0] == texts[1] and texts[0]  # greedy: both choices alike

    completion = client.completions.create(
        model=model, prompt=["One, two,", "Red, green,"], max_tokens=3, temperature=0, logprobs=1, echo=True, n=2
    )
    assert [choice.index for choice in completion.choices] == [0, 1, 2, 3]
    assert completion.choices[2].text.startswith("Red, green,")
    assert completion.choices[0].logprobs.token_logprobs[0] is None
    num_prompt = sum(len(default_engine.encode_prompt(prompt)) for prompt in ("One, two,", "Red, green,"))
    num_listed = sum(len(choice.logprobs.tokens) for choice in completion.choices)  # each prompt's, then its own
    assert completion.usage.completion_tokens == num_listed - 2 * num_prompt
    assert completion.usage.prompt_tokens == num_prompt


def test_langchain_openai_and_chat_openai_invoke(server: LiveServer, acme: TenantKey, default_engine) -> None:
    llm = OpenAI(
        base_url=f"{server.url}/v1", api_key=acme.key, model=default_engine.model_name, max_tokens=8, temperature=0
    )
    assert llm.invoke("The capital of France is")
    chat = ChatOpenAI(
        base_url=f"{server.url}/v1",
        api_key=acme.key,
        model=default_engine.model_name,
        max_tokens=8,
        temperature=0,
        frequency_penalty=0,
        presence_penalty=0,
    )
    assert chat.invoke("What is the capital of France?").content
    assert "".join(chunk.content for chunk in chat.stream("Say hello."))


class Sky(BaseModel):
    """What colour the sky is."""

    colour: Literal["red", "green", "blue"]
    sure: bool


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(server: LiveServer, acme: TenantKey, default_engine, method: str) -> None:
    """LangChain's default sends response_format json_schema; function_calling sends tools with a named tool_choice."""
    chat = ChatOpenAI(
        model=default_engine.model_name, base_url=f"{server.url}/v1", api_key=acme.key, max_tokens=48, temperature=0
    )
    answer = chat.with_structured_output(Sky, method=method).invoke("What colour is the sky?")
    assert isinstance(answer, Sky) and answer.colour in {"red", "green", "blue"}


def test_litellm_response_format(server: LiveServer, acme: TenantKey, default_engine) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network: its bundled price list
    import litellm

    reply = litellm.completion(
        model=f"openai/{default_engine.model_name}",
        api_base=f"{server.url}/v1",
        api_key=acme.key,
        messages=[{"role": "user", "content": "What colour is the sky?"}],
        max_tokens=48,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "sky", "schema": Sky.model_json_schema()}},
    )
    assert Sky.model_validate_json(reply.choices[0].message.content).colour in {"red", "green", "blue"}
