"""First start: the demo tenant, its key and adapters, and a banner whose examples work as printed."""

from __future__ import annotations

import shlex
import subprocess

import openai
import pytest

from app.demo.tenant import ensure_demo_tenant
from app.serve import banner
from tests.app.live_server import live_server


def test_first_start_creates_a_working_demo_key_and_later_starts_reuse_it(
    gateway_settings, default_engine, tenant_adapters
) -> None:
    with live_server(gateway_settings, default_engine) as server:
        gateway = server.gateway
        demo_adapters = {"pirate": tenant_adapters["alpha"], "french": tenant_adapters["beta"]}
        first = server.run(
            ensure_demo_tenant(
                gateway.database, gateway.engine, gateway.settings.home, gateway.key_secret, demo_adapters
            )
        )
        again = server.run(
            ensure_demo_tenant(
                gateway.database, gateway.engine, gateway.settings.home, gateway.key_secret, demo_adapters
            )
        )
        assert first is not None and again == first  # created once; a later start prints the same key
        assert first.adapters == ("french", "pirate")
        assert (gateway.settings.home / "demo-key").stat().st_mode & 0o777 == 0o600

        text = banner(server.url, default_engine.model_name, first)
        curl = next(line for line in text.splitlines() if line.strip().startswith("curl"))
        command = " ".join(
            line.strip().removesuffix("\\") for line in text.splitlines()[text.splitlines().index(curl) :][:3]
        )
        result = subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=60, check=True)
        assert '"object":"chat.completion"' in result.stdout, result.stdout

        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=first.api_key, max_retries=0)
        reply = client.chat.completions.create(
            model="french", max_tokens=8, messages=[{"role": "user", "content": "What is the capital of France?"}]
        )
        assert reply.choices[0].message.content


@pytest.mark.parametrize("demo", [None])
def test_banner_without_demo_says_what_to_do(demo) -> None:
    text = banner("http://127.0.0.1:8000", "SmolLM2-135M-Instruct", demo)
    assert "http://127.0.0.1:8000/v1" in text and "docs/admin.md" in text
