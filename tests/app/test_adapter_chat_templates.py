"""An adapter's own chat template and tool-call format: taken at upload, used by requests on it, refused when bad.

The call test serves the default model, whose format is hermes, and uploads an adapter with the pythonic
format and a template that renders tools in it; a ``logit_bias`` on ``[`` (the token that opens a pythonic
call list) pushes the model to open a call, which only the adapter reads as one.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select

from app.admin.adapters.upload import MAX_CHAT_FILE_BYTES
from app.db.tables import Adapter, AdapterFile, AuditLog
from app.keys.service import Scope
from app.tool_calls.templates import MAX_TEMPLATE_CHARS, ChatTemplate
from tests.app.gateway_fixtures import gateway_client, make_tenant
from tests.app.live_server import live_server
from tests.app.test_admin_adapters import adapter_files, adapters_url
from tests.app.test_tool_calls_auto import ASK, CALL_BIAS, PYTHONIC_TEMPLATE

pytestmark = [pytest.mark.anyio, pytest.mark.default_model]

CHAT = "/v1/chat/completions"
TEMPLATE, TOKENIZER_CONFIG = "chat_template.jinja", "tokenizer_config.json"


def _template_part(part: str, content: bytes) -> tuple[str, tuple[str, bytes, str]]:
    return part, (part, content, "application/octet-stream")


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# A tool without arguments keeps the call a few tokens long: constrained decoding costs per token on the CPU.
NOW = {
    "type": "function",
    "function": {"name": "now", "description": "The time now.", "parameters": {"type": "object", "properties": {}}},
}


def _ask(model: str) -> dict[str, object]:
    return {
        "model": model,
        "messages": ASK,
        "tools": [NOW],
        "parallel_tool_calls": False,
        "logit_bias": CALL_BIAS,
        "max_tokens": 12,
        "temperature": 0,
    }


async def pythonic_adapter(client, gateway, folder: Path, template: str):
    """An admin, tenant acme, and acme's adapter "agent" from ``folder`` with ``template`` and the pythonic format."""
    admin = await make_tenant(gateway, "admin", scopes=(Scope.ADMIN,))
    acme = await make_tenant(gateway, "acme")
    files = [*adapter_files(folder), _template_part(TEMPLATE, template.encode())]
    uploaded = await client.post(
        adapters_url(acme.tenant_id),
        data={"name": "agent", "tool_call_format": "pythonic"},
        files=files,
        headers=admin.headers,
    )
    assert uploaded.status_code == 201, uploaded.text
    return admin, acme, uploaded.json()


async def test_an_adapters_template_and_format_serve_its_requests_and_the_base_keeps_its_own(
    gateway_settings, default_engine, tenant_adapters
):
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin, acme, adapter = await pythonic_adapter(client, gateway, tenant_adapters["alpha"], PYTHONIC_TEMPLATE)
        assert adapter["tool_call_format"] == "pythonic"
        assert adapter["chat_template_sha256"] == _sha256(PYTHONIC_TEMPLATE)
        shown = (await client.get(f"/admin/adapters/{adapter['id']}", headers=admin.headers)).json()
        assert (shown["tool_call_format"], shown["chat_template_sha256"]) == ("pythonic", _sha256(PYTHONIC_TEMPLATE))

        on_adapter = await client.post(CHAT, json=_ask("agent"), headers=acme.headers)
        assert on_adapter.status_code == 200, on_adapter.text
        (choice,) = on_adapter.json()["choices"]
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("now", {})
        # The prompt is the adapter's template's, not the base model's shipped one.
        rendered = ChatTemplate(PYTHONIC_TEMPLATE).render(ASK, [NOW])
        num_prompt_tokens = len(default_engine.encode_rendered(rendered))
        assert on_adapter.json()["usage"]["prompt_tokens"] == num_prompt_tokens
        # The Responses API renders requests on the adapter with its template too.
        responses_tool = {"type": "function", **NOW["function"]}
        response = await client.post(
            "/v1/responses",
            json={"model": "agent", "input": ASK, "tools": [responses_tool], "max_output_tokens": 1, "store": False},
            headers=acme.headers,
        )
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["input_tokens"] == num_prompt_tokens

        # The base model on the same server writes hermes calls: its "[" is text, never a call.
        on_base = await client.post(CHAT, json=_ask(default_engine.model_name), headers=acme.headers)
        assert on_base.status_code == 200, on_base.text
        (base_choice,) = on_base.json()["choices"]
        assert base_choice["finish_reason"] != "tool_calls" and not base_choice["message"].get("tool_calls")
        assert base_choice["message"]["content"].startswith("[")


async def test_an_adapters_template_writes_the_models_special_tokens(gateway_settings, default_engine, tenant_adapters):
    # A Llama- or Mistral-style template writes the BOS itself; the prompt holds it, encoded as the one special token.
    template = "{{ bos_token }}" + PYTHONIC_TEMPLATE
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        _, acme, _ = await pythonic_adapter(client, gateway, tenant_adapters["alpha"], template)
        asked = await client.post(
            CHAT, json={"model": "agent", "messages": ASK, "max_tokens": 1, "temperature": 0}, headers=acme.headers
        )
        assert asked.status_code == 200, asked.text
    special_tokens = default_engine.special_tokens()
    rendered = ChatTemplate(template).render(ASK, None, special_tokens=special_tokens)
    assert rendered.startswith(special_tokens["bos_token"])
    without_bos = default_engine.encode_rendered(ChatTemplate(PYTHONIC_TEMPLATE).render(ASK, None))
    assert (
        asked.json()["usage"]["prompt_tokens"] == len(default_engine.encode_rendered(rendered)) == len(without_bos) + 1
    )


NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"

# (case id, the form's extra fields, its extra parts, the part the 400 names, words the message must hold)
BAD_CHAT_PARTS = [
    ("unknown-format", {"tool_call_format": "xml"}, [], "tool_call_format", "hermes, llama3_json, mistral, pythonic"),
    (
        "format-without-template",  # the server's template writes hermes calls: the model would never call in `[`
        {"tool_call_format": "pythonic"},
        [],
        "tool_call_format",
        "does not write calls in the pythonic tool-call format",
    ),
    (
        "format-its-template-does-not-teach",
        {"tool_call_format": "pythonic"},
        [(TEMPLATE, ChatTemplate.shipped().source.encode())],
        TEMPLATE,
        "does not write calls in the pythonic tool-call format",
    ),
    (
        "template-teaching-another-format",  # without a format it keeps the server's hermes, which it never writes
        {},
        [(TEMPLATE, PYTHONIC_TEMPLATE.encode())],
        TEMPLATE,
        "without `tool_call_format` keeps: name the format it writes in `tool_call_format` (pythonic)",
    ),
    ("syntax-error", {}, [(TEMPLATE, b"{% for m in messages %}{{ m.content }}")], TEMPLATE, "not valid Jinja"),
    (
        "drops-the-tools",
        {},
        [(TEMPLATE, b"{% for m in messages %}{{ m.content }}{% endfor %}")],
        TEMPLATE,
        "does not render the tools",
    ),
    ("escapes-the-sandbox", {}, [(TEMPLATE, b"{{ messages.append(1) }}")], TEMPLATE, "sandbox"),
    ("runs-too-long", {}, [(TEMPLATE, NESTED_LOOPS.encode())], TEMPLATE, "ran longer than 1 s"),
    ("too-many-characters", {}, [(TEMPLATE, b"x" * (MAX_TEMPLATE_CHARS + 1))], TEMPLATE, str(MAX_TEMPLATE_CHARS)),
    ("too-many-bytes", {}, [(TEMPLATE, b"x" * (MAX_CHAT_FILE_BYTES[TEMPLATE] + 1))], TEMPLATE, "larger than 256 KiB"),
    ("not-utf8", {}, [(TEMPLATE, b"\xff\xfe{{ x }}")], TEMPLATE, "not UTF-8"),
    ("config-not-json", {}, [(TOKENIZER_CONFIG, b"{'chat_template':")], TOKENIZER_CONFIG, "not valid JSON"),
    ("config-without-template", {}, [(TOKENIZER_CONFIG, b'{"eos_token": "x"}')], TOKENIZER_CONFIG, 'no "chat_'),
    (
        "config-with-named-templates",
        {},
        [(TOKENIZER_CONFIG, json.dumps({"chat_template": [{"name": "default", "template": "x"}]}).encode())],
        TOKENIZER_CONFIG,
        "list of named chat templates",
    ),
]


async def _counts(gateway) -> tuple[int, int, int]:
    async with gateway.database.sessions() as session:
        return tuple(
            [
                await session.scalar(select(func.count()).select_from(table))
                for table in (Adapter, AdapterFile, AuditLog)
            ]
        )


def _store_entries(home: Path) -> list[str]:
    root = home / "adapters"
    return sorted(str(path.relative_to(root)) for path in root.rglob("*")) if root.exists() else []


async def test_bad_templates_and_formats_are_refused_and_nothing_is_stored(
    gateway_settings, default_engine, tenant_adapters
):
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin = await make_tenant(gateway, "admin", scopes=(Scope.ADMIN,))
        acme = await make_tenant(gateway, "acme")
        engine_names = set(default_engine.engine.engine.adapters.names())
        for case, fields, parts, param, words in BAD_CHAT_PARTS:
            files = [*adapter_files(tenant_adapters["alpha"]), *(_template_part(*part) for part in parts)]
            response = await client.post(
                adapters_url(acme.tenant_id), data={"name": "agent", **fields}, files=files, headers=admin.headers
            )
            assert response.status_code == 400, (case, response.text)
            error = response.json()["error"]
            assert error["param"] == param and words in error["message"], (case, error)
            assert _store_entries(gateway_settings.home) in ([], [".uploads"]), case
            assert await _counts(gateway) == (0, 0, 0), case
            assert set(default_engine.engine.engine.adapters.names()) == engine_names, case

        # A tokenizer_config.json's template is taken; the server's format (hermes, which this one writes) stands when
        # none is named.
        hermes_template = ChatTemplate.shipped().source
        config = {"eos_token": "<|im_end|>", "chat_template": hermes_template}
        files = [
            *adapter_files(tenant_adapters["alpha"]),
            _template_part(TOKENIZER_CONFIG, json.dumps(config).encode()),
        ]
        taken = await client.post(
            adapters_url(acme.tenant_id), data={"name": "agent"}, files=files, headers=admin.headers
        )
        assert taken.status_code == 201, taken.text
        adapter = taken.json()
        assert (adapter["tool_call_format"], adapter["chat_template_sha256"]) == (None, _sha256(hermes_template))
        async with gateway.database.sessions() as session:
            stored = await session.scalar(select(Adapter.chat_template).where(Adapter.id == uuid.UUID(adapter["id"])))
        assert stored == hermes_template


async def test_a_template_that_runs_too_long_on_one_conversation_is_a_400_on_that_request(
    gateway_settings, default_engine, tenant_adapters
):
    # The upload's samples never say "spin": the check passes, and the loop waits for a request that does.
    hidden = PYTHONIC_TEMPLATE + "{% if messages[-1].content == 'spin' %}" + NESTED_LOOPS + "{% endif %}"
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        _, acme, _ = await pythonic_adapter(client, gateway, tenant_adapters["alpha"], hidden)
        started = time.monotonic()
        spun = await client.post(
            CHAT,
            json={"model": "agent", "messages": [{"role": "user", "content": "spin"}], "max_tokens": 1},
            headers=acme.headers,
        )
        assert time.monotonic() - started < 5  # the 1 s budget, and a request's own cost on a shared machine
        assert spun.status_code == 400, spun.text
        assert "ran longer than 1 s" in spun.json()["error"]["message"]


# Renders that pass the upload's sample and meet their attack on a conversation that names it; each is refused
# by its bound (time or size) while the gateway goes on answering. Each would pass both bounds by far on any
# machine, so none depends on how fast this one is (the json one's output alone passes the size bound).
ATTACKS_BY_WORD = {
    "loops": NESTED_LOOPS,
    "unique": "{{ ((range(100000) | list) * 40) | unique | list | length }}",
    "frames": "{% macro f(n, s) %}{% if n > 0 %}{{ f(n - 1, s ~ 'x') }}{% endif %}{% endmacro %}"
    "{{ f(300, 'x' * 4000000) }}",
    "json": "{% set l = range(100000) | list %}{{ [" + ", ".join(["l"] * 16) + "] | tojson(indent=2) | length }}",
    "doubling": "{% macro d(s) %}{{ s }}{{ s }}{% endmacro %}{% set ns = namespace(s='x') %}"
    "{% for i in range(64) %}{% set ns.s = d(ns.s) %}{% endfor %}",
}
MAX_HEALTH_S = 1.0


def _poll_health(url: str, stop: threading.Event, latencies_s: list[float]) -> None:
    with httpx.Client(base_url=url, timeout=10) as http:
        while not stop.is_set():
            started = time.monotonic()
            assert http.get("/health").status_code == 200
            latencies_s.append(time.monotonic() - started)
            time.sleep(0.02)


def test_hostile_renders_are_refused_in_time_while_the_gateway_answers_health(
    gateway_settings, default_engine, tenant_adapters
):
    attacks = "".join(
        f"{{% if messages[-1].content == '{word}' %}}{source}{{% endif %}}" for word, source in ATTACKS_BY_WORD.items()
    )
    with live_server(gateway_settings, default_engine) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        admin = server.run(make_tenant(server.gateway, "admin", scopes=(Scope.ADMIN,)))
        acme = server.run(make_tenant(server.gateway, "acme"))
        files = [
            *adapter_files(tenant_adapters["alpha"]),
            _template_part(TEMPLATE, (PYTHONIC_TEMPLATE + attacks).encode()),
        ]
        uploaded = http.post(
            adapters_url(acme.tenant_id),
            data={"name": "agent", "tool_call_format": "pythonic"},
            files=files,
            headers=admin.headers,
        )
        assert uploaded.status_code == 201, uploaded.text
        stop, latencies_s = threading.Event(), []
        poller = threading.Thread(target=_poll_health, args=(server.url, stop, latencies_s), daemon=True)
        poller.start()
        try:
            for word in ATTACKS_BY_WORD:
                started = time.monotonic()
                refused = http.post(
                    CHAT,
                    json={"model": "agent", "messages": [{"role": "user", "content": word}], "max_tokens": 1},
                    headers=acme.headers,
                )
                assert time.monotonic() - started < 5  # the 1 s budget, and a request's own cost on a shared machine
                assert refused.status_code == 400, (word, refused.text)
                assert "chat template" in refused.json()["error"]["message"], word
        finally:
            stop.set()
            poller.join(timeout=10)
        assert latencies_s and max(latencies_s) < MAX_HEALTH_S, sorted(latencies_s)[-5:]
