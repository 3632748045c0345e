"""Logprobs, echo and prompt logprobs on the real default model, in OpenAI's shapes (and vLLM's), whole and streamed."""

from __future__ import annotations

import json
import math

import pytest

from tests.app.gateway_fixtures import chat_body, gateway_client, make_tenant, on_both_engines, sse_events

pytestmark = [pytest.mark.anyio, pytest.mark.default_model]

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PROMPT = "The capital of France is"


def _chunks(text: str) -> list[dict]:
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def _assert_chat_entries(entries: list[dict], num_top: int) -> None:
    for entry in entries:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["logprob"] <= 0 and all(0 <= byte < 256 for byte in entry["bytes"])
        assert bytes(entry["bytes"]).decode("utf-8", errors="replace") == entry["token"] or entry["token"].startswith(
            "bytes:"
        )
        tops = entry["top_logprobs"]
        assert len(tops) == num_top
        assert [top["logprob"] for top in tops] == sorted((top["logprob"] for top in tops), reverse=True)
        assert sum(math.exp(top["logprob"]) for top in tops) <= 1 + 1e-5 and tops[0]["bytes"]
        # greedy: the token taken is the likeliest one, with the same log-probability
        assert tops[0]["token"] == entry["token"] and math.isclose(tops[0]["logprob"], entry["logprob"], abs_tol=1e-5)


async def test_chat_logprobs_whole_and_streamed(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        body = chat_body(default_engine.model_name, logprobs=True, top_logprobs=3, max_tokens=6)
        response = await client.post(CHAT, json=body, headers=acme.headers)
        assert response.status_code == 200, response.text
        data = response.json()
        choice = data["choices"][0]
        entries = choice["logprobs"]["content"]
        assert len(entries) == data["usage"]["completion_tokens"]
        _assert_chat_entries(entries, 3)
        text = b"".join(bytes(entry["bytes"]) for entry in entries).decode()
        assert text.startswith(choice["message"]["content"])

        streamed = await client.post(CHAT, json={**body, "stream": True}, headers=acme.headers)
        chunks = _chunks(streamed.text)
        parts = [c["choices"][0]["logprobs"]["content"] for c in chunks if c["choices"][0]["logprobs"]]
        assert [entry for part in parts for entry in part] == entries
        assert all(c["choices"][0]["logprobs"] is None for c in chunks if not c["choices"][0]["delta"].get("content"))

        without = await client.post(
            CHAT, json=chat_body(default_engine.model_name, logprobs=True), headers=acme.headers
        )
        assert all(entry["top_logprobs"] == [] for entry in without.json()["choices"][0]["logprobs"]["content"])


async def test_completions_logprobs_whole_and_streamed(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        body = {"model": default_engine.model_name, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 2}
        response = await client.post(COMPLETIONS, json=body, headers=acme.headers)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        logprobs = choice["logprobs"]
        assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        tokens = logprobs["tokens"]
        assert len(tokens) == response.json()["usage"]["completion_tokens"]
        assert "".join(tokens).startswith(choice["text"])
        assert logprobs["text_offset"] == [len("".join(tokens[:i])) for i in range(len(tokens))]
        for token, logprob, tops in zip(tokens, logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True):
            assert tops[token] == logprob <= 0  # the dict holds the sampled token
            assert 1 <= len(tops) <= 3 and max(tops.values()) == logprob  # greedy: the likeliest

        streamed = await client.post(COMPLETIONS, json={**body, "stream": True}, headers=acme.headers)
        chunks = [c for c in _chunks(streamed.text) if c["choices"]]
        joined = {key: [v for c in chunks for v in c["choices"][0]["logprobs"][key]] for key in logprobs}
        assert joined == logprobs  # offsets run on across chunks
        assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]


async def test_lm_evaluation_harness_scoring_request(gateway_settings, default_engine) -> None:
    """What lm-evaluation-harness sends to score a continuation: the prompt's logprobs, echoed, then one token."""
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        ids = default_engine.encode_prompt(PROMPT + " Paris")
        body = {
            "model": default_engine.model_name,
            "prompt": [ids],
            "max_tokens": 1,
            "echo": True,
            "logprobs": 1,
            "temperature": 0,
        }
        response = await client.post(COMPLETIONS, json=body, headers=acme.headers)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        prompt_text = default_engine.decode(ids)
        assert choice["text"].startswith(prompt_text) and len(choice["text"]) > len(prompt_text)
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(ids) + 1
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert all(lp is not None and lp <= 0 for lp in logprobs["token_logprobs"][1:])
        assert "".join(logprobs["tokens"][: len(ids)]) == prompt_text
        assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"][len(ids)] == len(prompt_text)
        paris = logprobs["top_logprobs"][len(ids) - 1]
        assert paris[" Paris"] == logprobs["token_logprobs"][len(ids) - 1] and len(paris) <= 2
        usage = response.json()["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(ids), 1)

        # vLLM's prompt_logprobs gives the same numbers for the prompt, by token id
        scored = await client.post(
            COMPLETIONS, json={**body, "echo": False, "logprobs": None, "prompt_logprobs": 2}, headers=acme.headers
        )
        prompt_logprobs = scored.json()["choices"][0]["prompt_logprobs"]
        assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(ids)
        for token_id, echoed, position in zip(
            ids[1:], logprobs["token_logprobs"][1:], prompt_logprobs[1:], strict=False
        ):
            entry = position[str(token_id)]
            assert math.isclose(entry["logprob"], echoed, abs_tol=1e-4)
            assert entry["decoded_token"] == default_engine.decode([token_id])
            assert {1, 2} <= {e["rank"] for e in position.values()} and len(position) <= 3
            assert entry["rank"] is None or 1 <= entry["rank"] <= 2


@on_both_engines
async def test_echo_with_max_tokens_0_scores_the_prompt_only(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        body = {"model": default_engine.model_name, "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0}
        response = await client.post(COMPLETIONS, json=body, headers=acme.headers)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
        num_prompt = len(default_engine.encode_prompt(PROMPT))
        assert len(choice["logprobs"]["tokens"]) == num_prompt
        assert all(len(tops) == 1 for tops in choice["logprobs"]["top_logprobs"][1:])
        assert response.json()["usage"]["completion_tokens"] == 0

        plain = await client.post(COMPLETIONS, json={**body, "logprobs": None}, headers=acme.headers)
        assert plain.json()["choices"][0] | {"text": None} == {
            "index": 0,
            "text": None,
            "finish_reason": "length",
            "logprobs": None,
        }
        assert plain.json()["choices"][0]["text"] == PROMPT

        streamed = await client.post(COMPLETIONS, json={**body, "stream": True}, headers=acme.headers)
        chunks = [c for c in _chunks(streamed.text) if c["choices"]]
        assert len(chunks) == 1 and chunks[0]["choices"][0] == choice


async def test_streamed_echo_puts_the_prompt_first(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        body = {"model": default_engine.model_name, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "echo": True}
        whole = (await client.post(COMPLETIONS, json=body, headers=acme.headers)).json()["choices"][0]["text"]
        streamed = await client.post(COMPLETIONS, json={**body, "stream": True}, headers=acme.headers)
        chunks = [c for c in _chunks(streamed.text) if c["choices"]]
        assert chunks[0]["choices"][0]["text"].startswith(PROMPT)
        assert "".join(c["choices"][0]["text"] for c in chunks) == whole and whole.startswith(PROMPT)
