"""n choices and several prompts on the real default model: indices, streams, usage, the one usage row, limits."""

from __future__ import annotations

import json

import pytest

from tests.app.gateway_fixtures import chat_body, gateway_client, make_tenant, sse_events, usage_rows
from tests.app.test_limits_http import set_tenant

pytestmark = [pytest.mark.anyio, pytest.mark.default_model]

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PROMPTS = ["The capital of France is", "1, 2, 3,", "Once upon a time"]


def _chunks(text: str) -> list[dict]:
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


async def test_n_3_streamed_chat_carries_each_choice_index(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        body = chat_body(
            default_engine.model_name,
            "Tell me a story.",
            n=3,
            temperature=1.0,
            seed=11,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
        response = await client.post(CHAT, json=body, headers=acme.headers)
        assert response.status_code == 200, response.text
        chunks = _chunks(response.text)
        usage = chunks[-1]["usage"]
        texts, finishes, roles = {0: "", 1: "", 2: ""}, {}, {}
        for chunk in chunks[:-1]:
            (choice,) = chunk["choices"]
            index = choice["index"]
            if "role" in choice["delta"]:
                assert index not in roles and index not in finishes and texts[index] == ""  # the choice's first
                roles[index] = choice["delta"]["role"]
            texts[index] += choice["delta"].get("content", "")
            if choice["finish_reason"] is not None:
                assert index not in finishes
                finishes[index] = choice["finish_reason"]
        assert roles == {0: "assistant", 1: "assistant", 2: "assistant"}
        assert set(finishes) == {0, 1, 2} and set(finishes.values()) <= {"stop", "length"}
        assert len(set(texts.values())) > 1  # sampled: seeds 11, 12, 13 give different answers

        whole = await client.post(CHAT, json={**body, "stream": False, "stream_options": None}, headers=acme.headers)
        data = whole.json()
        assert [c["index"] for c in data["choices"]] == [0, 1, 2]
        assert {c["index"]: c["message"]["content"] for c in data["choices"]} == texts  # the same seeds, the same
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")
        assert [data["usage"][key] for key in counts] == [usage[key] for key in counts]  # cached: the second hits
        num_prompt = len(default_engine.encode_chat([{"role": "user", "content": "Tell me a story."}]))
        assert usage["prompt_tokens"] == num_prompt  # the prompt once, however many choices
        rows = await usage_rows(gateway)
        assert len(rows) == 2 and rows[0].prompt_tokens == num_prompt
        assert rows[0].completion_tokens == usage["completion_tokens"]


async def test_several_prompts_each_get_what_they_get_alone(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        model = default_engine.model_name
        alone = []
        for prompt in PROMPTS:
            body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0}
            alone.append((await client.post(COMPLETIONS, json=body, headers=acme.headers)).json())

        body = {"model": model, "prompt": PROMPTS, "max_tokens": 6, "temperature": 0, "n": 2}
        together = await client.post(COMPLETIONS, json=body, headers=acme.headers)
        assert together.status_code == 200, together.text
        choices = together.json()["choices"]
        assert [c["index"] for c in choices] == list(range(6))
        for choice in choices:  # prompt-major, then n
            assert choice["text"] == alone[choice["index"] // 2]["choices"][0]["text"]

        ids = [default_engine.encode_prompt(prompt) for prompt in PROMPTS]
        streamed = await client.post(
            COMPLETIONS,
            json={**body, "prompt": ids, "stream": True, "stream_options": {"include_usage": True}},
            headers=acme.headers,
        )
        chunks = _chunks(streamed.text)
        texts: dict[int, str] = {}
        for chunk in chunks[:-1]:
            (choice,) = chunk["choices"]
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        assert texts == {c["index"]: c["text"] for c in choices}

        usage = together.json()["usage"]
        assert chunks[-1]["usage"]["prompt_tokens"] == usage["prompt_tokens"] == sum(len(i) for i in ids)
        assert usage["completion_tokens"] == 2 * sum(a["usage"]["completion_tokens"] for a in alone)
        rows = await usage_rows(gateway)
        assert len(rows) == 5  # one a request: three alone, two together
        row = rows[3]
        assert row.request_id == together.headers["x-request-id"]
        assert (row.prompt_tokens, row.completion_tokens) == (usage["prompt_tokens"], usage["completion_tokens"])
        assert row.status == "ok" and row.finish_reason in ("stop", "length")


async def test_limits_reserve_the_prompts_and_n_times_max_tokens(gateway_settings, default_engine) -> None:
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        acme = await make_tenant(gateway, "acme")
        await set_tenant(gateway, acme.tenant_id, tpm_limit=100)
        body = {"model": default_engine.model_name, "prompt": "One, two,", "max_tokens": 30, "temperature": 0}
        assert (await client.post(COMPLETIONS, json=body, headers=acme.headers)).status_code == 200
        refused = await client.post(COMPLETIONS, json={**body, "n": 4}, headers=acme.headers)  # 4 + 4 x 30 > 100
        assert refused.status_code == 429, refused.text
        assert refused.headers.get("x-should-retry") == "false"  # the request alone is over the limit
        refused = await client.post(COMPLETIONS, json={**body, "prompt": ["One, two,"] * 4}, headers=acme.headers)
        assert refused.status_code == 429, refused.text
