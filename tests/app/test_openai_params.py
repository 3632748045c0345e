"""The request parameters of both OpenAI routes: every value out of range, or asking for what is not offered, is a
400 naming the parameter (and its range); the parameters whose values ask for nothing missing are accepted."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from tests.app.gateway_fixtures import chat_body, gateway_client, make_tenant, usage_rows

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MANY_BIASES = {str(token): 1 for token in range(301)}

# (extra fields, the param the 400 names, words its message must hold)
BOTH_ROUTES = [
    ({"n": 0}, "n", "[1, 16]"),
    ({"n": 17}, "n", "[1, 16]"),
    ({"best_of": 3}, "best_of", "equal to `n`"),
    ({"use_beam_search": True}, "use_beam_search", "not offered"),
    ({"temperature": 3.5}, "temperature", "[0, 2]"),
    ({"top_p": 0}, "top_p", "(0, 1]"),
    ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
    ({"frequency_penalty": -3}, "frequency_penalty", "[-2, 2]"),
    ({"repetition_penalty": 0}, "repetition_penalty", "(0, 100]"),
    ({"repetition_penalty": 101}, "repetition_penalty", "(0, 100]"),
    ({"min_p": 1.5}, "min_p", "[0, 1]"),
    ({"top_k": -2}, "top_k", "-1 or 0"),
    ({"min_tokens": 9}, "min_tokens", "[0, 8]"),
    ({"min_tokens": -1}, "min_tokens", "at least 0"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"999999999": 1}}, "logit_bias", "[0, 49152)"),
    ({"logit_bias": {"9" * 5000: 1}}, "logit_bias", "token ids"),
    ({"logit_bias": MANY_BIASES}, "logit_bias", "300"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids", "[0, 49152)"),
    ({"bogus": 1}, "bogus", "Unsupported parameter"),
]
CHAT_ONLY = [
    ({"top_logprobs": 2}, "top_logprobs", "`logprobs` is true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ({"store": True}, "store", "not supported"),
    ({"service_tier": "flex"}, "service_tier", "not offered"),
    ({"modalities": ["text", "audio"]}, "modalities", "Only text"),
    ({"audio": {"voice": "alloy", "format": "mp3"}}, "audio", "not supported"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction", "not supported"),
    ({"reasoning_effort": "high"}, "reasoning_effort", "does not reason"),
    ({"verbosity": "low"}, "verbosity", "not supported"),
    ({"web_search_options": {}}, "web_search_options", "not offered"),
    ({"prompt_cache_retention": "24h"}, "prompt_cache_retention", "in-memory"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs `json_schema`"),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        "tool_choice",
        "not among `tools`",
    ),
    ({"tool_choice": "required"}, "tool_choice", "needs `tools`"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "needs `tools`"),
    ({"functions": [{"name": "f"}]}, "functions", "send them as `tools`"),
    ({"function_call": {"name": "f"}}, "function_call", "send `tool_choice`"),
    ({"max_tokens": 0}, "max_tokens", "at least 1"),
]
COMPLETIONS_ONLY = [
    ({"logprobs": 21}, "logprobs", "[0, 20]"),
    ({"prompt_logprobs": 21}, "prompt_logprobs", "[0, 20]"),
    ({"suffix": "and so on"}, "suffix", "not supported"),
    ({"max_tokens": 0}, "max_tokens", "0 with `echo`"),
    ({"prompt": ["one", [1, 2]]}, "prompt", "not a mix"),
    ({"prompt": ["one"] * 65}, "prompt", "at most 64"),
    ({"prompt": [[1, 10**9]]}, "prompt", "[0, 49152)"),
]


def _completion_body(model: str, **extra: object) -> dict[str, object]:
    return {"model": model, "prompt": "One, two,", "max_tokens": 8, "temperature": 0, **extra}


async def _refused(
    client: httpx.AsyncClient, headers: dict[str, str], path: str, body: dict[str, object], param: str, words: str
) -> None:
    response = await client.post(path, json=body, headers=headers)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert words in error["message"], error["message"]
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(("extra", "param", "words"), BOTH_ROUTES + CHAT_ONLY)
async def test_chat_refuses_out_of_range_and_unoffered_values_naming_them(
    gateway_settings, default_engine, extra, param, words
) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        body = chat_body(default_engine.model_name, **extra)
        await _refused(client, acme.headers, CHAT, body, param, words)
        assert await usage_rows(gateway) == []  # refused before the engine: nothing to bill


@pytest.mark.parametrize(("extra", "param", "words"), BOTH_ROUTES + COMPLETIONS_ONLY)
async def test_completions_refuse_out_of_range_and_unoffered_values_naming_them(
    gateway_settings, default_engine, extra, param, words
) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        body = _completion_body(default_engine.model_name, **extra)
        await _refused(client, acme.headers, COMPLETIONS, body, param, words)
        assert await usage_rows(gateway) == []


async def test_the_caps_on_n_and_prompts_are_settings(gateway_settings, default_engine) -> None:
    settings = dataclasses.replace(gateway_settings, max_n=2, max_prompts=3)
    async with gateway_client(settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        model = default_engine.model_name
        await _refused(client, acme.headers, CHAT, chat_body(model, n=3), "n", "[1, 2]")
        body = _completion_body(model, prompt=["a", "b", "c", "d"])
        await _refused(client, acme.headers, COMPLETIONS, body, "prompt", "at most 3")


async def test_chat_accepts_every_parameter_whose_value_asks_for_nothing_missing(
    gateway_settings, default_engine
) -> None:
    no_ops = {
        "store": False,
        "metadata": {"team": "search"},
        "service_tier": "auto",
        "modalities": ["text"],
        "user": "user-1",
        "safety_identifier": "hash-1",
        "prompt_cache_key": "faq",
        "prompt_cache_retention": "in_memory",
        "audio": None,
        "prediction": None,
        "reasoning_effort": None,
        "verbosity": None,
        "web_search_options": None,
        "response_format": {"type": "text"},
        "tools": [],
        "tool_choice": "none",
        "parallel_tool_calls": True,
        "functions": None,
        "function_call": None,
        "frequency_penalty": 0,
        "presence_penalty": 0,
        "logit_bias": {},
        "n": 1,
        "best_of": 1,
        "use_beam_search": False,
        "top_k": -1,
        "min_p": 0,
        "repetition_penalty": 1,
        "min_tokens": 0,
        "stop_token_ids": [],
        "ignore_eos": False,
        "logprobs": False,
        "seed": 3,
        "stream": False,
        "max_completion_tokens": 4,
    }
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        plain = await client.post(CHAT, json=chat_body(default_engine.model_name, max_tokens=4), headers=acme.headers)
        response = await client.post(CHAT, json=chat_body(default_engine.model_name, **no_ops), headers=acme.headers)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["logprobs"] is None
        assert choice["message"]["content"] == plain.json()["choices"][0]["message"]["content"]  # greedy, unchanged


async def test_completions_accept_every_parameter_whose_value_asks_for_nothing_missing(
    gateway_settings, default_engine
) -> None:
    no_ops = {
        "suffix": "",
        "echo": False,
        "best_of": 1,
        "n": 1,
        "frequency_penalty": 0,
        "presence_penalty": 0,
        "logit_bias": None,
        "user": "user-1",
        "stream_options": None,
        "seed": None,
    }
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        model = default_engine.model_name
        plain = await client.post(COMPLETIONS, json=_completion_body(model), headers=acme.headers)
        response = await client.post(COMPLETIONS, json=_completion_body(model, **no_ops), headers=acme.headers)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
        assert response.json()["choices"][0]["logprobs"] is None
        assert "prompt_logprobs" not in response.json()["choices"][0]
        streamed = await client.post(
            COMPLETIONS,
            json=_completion_body(
                model, stream=True, stream_options={"include_usage": True, "include_obfuscation": True}
            ),
            headers=acme.headers,
        )
        assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")


async def test_sampling_parameters_change_what_is_generated(gateway_settings, default_engine) -> None:
    """logit_bias, stop_token_ids, min_tokens and penalties reach the engine (greedy decoding shows each)."""
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        model = default_engine.model_name
        body = _completion_body(model, prompt="1, 2, 3, 4,", max_tokens=6)
        plain = (await client.post(COMPLETIONS, json=body, headers=acme.headers)).json()["choices"][0]
        forced_id = default_engine.encode_prompt(" banana")[0]
        biased = await client.post(
            COMPLETIONS, json={**body, "logit_bias": {str(forced_id): 100}, "max_tokens": 2}, headers=acme.headers
        )
        assert biased.status_code == 200, biased.text
        assert biased.json()["choices"][0]["text"] == default_engine.decode([forced_id, forced_id])
        first_id = default_engine.encode_prompt(plain["text"])[0]
        stopped = await client.post(COMPLETIONS, json={**body, "stop_token_ids": [first_id]}, headers=acme.headers)
        assert stopped.json()["choices"][0]["finish_reason"] == "stop"
        assert stopped.json()["usage"]["completion_tokens"] == 1
        penalized = await client.post(COMPLETIONS, json={**body, "frequency_penalty": 2.0}, headers=acme.headers)
        assert penalized.status_code == 200
        repeated = await client.post(COMPLETIONS, json={**body, "repetition_penalty": 100}, headers=acme.headers)
        assert repeated.json()["choices"][0]["text"] != plain["text"]
