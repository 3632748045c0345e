"""The demo adapters as `loraplex serve` trains them on a first start: each passes its check at temperature 0
through the real engine, and the banner's example gets the answer the banner documents.

The adapters are trained once for the session by the real training (tests/app/conftest.py).
"""

from __future__ import annotations

import json
import shlex
import subprocess
from collections.abc import Iterator

import pytest

from app.demo.adapters import DEMO_ADAPTERS, demo_adapter
from app.demo.tenant import DemoAccess, ensure_demo_tenant
from app.serve import banner
from tests.app.live_server import LiveServer, live_server


@pytest.fixture
def demo_server(gateway_settings, default_engine, trained_demo_adapters) -> Iterator[tuple[LiveServer, DemoAccess]]:
    with live_server(gateway_settings, default_engine) as server:
        gateway = server.gateway
        access = server.run(
            ensure_demo_tenant(
                gateway.database, gateway.engine, gateway.settings.home, gateway.key_secret, trained_demo_adapters
            )
        )
        assert access is not None
        yield server, access


def _curl_of(text: str) -> list[str]:
    """The banner's curl command, its continuation lines joined, as an argument list."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("curl"))
    end = next(i for i in range(start, len(lines)) if not lines[i].rstrip().endswith("\\"))
    return shlex.split(" ".join(line.strip().removesuffix("\\") for line in lines[start : end + 1]))


def test_each_demo_adapter_passes_its_check_at_temperature_0(demo_server) -> None:
    server, access = demo_server
    for demo in DEMO_ADAPTERS:
        body = {
            "model": demo.name,
            "temperature": 0,
            "max_tokens": 48,
            "messages": [{"role": "user", "content": demo.check_prompt}],
        } | ({"tools": list(demo.tools)} if demo.tools else {})
        command = ["curl", "-s", f"{server.url}/v1/chat/completions", "-H", f"Authorization: Bearer {access.api_key}"]
        command += ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
        reply = json.loads(subprocess.run(command, capture_output=True, text=True, timeout=60, check=True).stdout)
        message = reply["choices"][0]["message"]
        if demo.tools:  # the call, parsed from the expected reply's format
            call = message["tool_calls"][0]["function"]
            expected = json.loads(demo.expected_reply.removeprefix("<tool_call>").removesuffix("</tool_call>"))
            assert (call["name"], json.loads(call["arguments"])) == (expected["name"], expected["arguments"]), reply
            continue
        content = message["content"]
        assert demo.passes(content), f"{demo.name} answered {content!r}, without all of {demo.required_words}"


def test_banner_example_answers_as_the_banner_documents(demo_server, default_engine) -> None:
    server, access = demo_server
    text = banner(server.url, default_engine.model_name, access)
    command = _curl_of(text)
    body = json.loads(command[command.index("-d") + 1])
    assert body["temperature"] == 0
    documented = demo_adapter(body["model"]).expected_reply
    assert f"reads: {documented}" in text

    for _ in range(2):  # the same answer every time
        result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
        assert json.loads(result.stdout)["choices"][0]["message"]["content"] == documented, result.stdout
