"""The management commands against a live server on loopback: a whole round trip, and their errors."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import click.testing
import httpx
import pytest

from app.cli.main import cli
from app.keys.secrets import KEY_PATTERN
from app.tool_calls.templates import ChatTemplate
from tests.app.gateway_fixtures import chat_body, make_tenant
from tests.app.live_server import LiveServer, free_port, live_server
from tests.app.test_tool_calls_auto import PYTHONIC_TEMPLATE

CHAT_TIMEOUT_S = 60.0  # a few tokens on the CPU, on a machine that may be busy
REVOCATION_WAIT_S = 5.0  # the authenticator caches a key's record for 1 s
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"

Loraplex = Callable[..., click.testing.Result]


@pytest.fixture(autouse=True)
def quiet_cli_logging(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI sends all logging to its stderr; the server runs in this process, so its lines would land there."""
    monkeypatch.setattr("app.cli.main.configure_logging", lambda **_: None)


@pytest.fixture
def server(gateway_settings, default_engine) -> Iterator[LiveServer]:
    with live_server(gateway_settings, default_engine) as running:
        yield running


@pytest.fixture
def admin_key(server: LiveServer) -> str:
    return server.run(make_tenant(server.gateway, "admin", scopes=("admin",))).key


def runner_for(url: str, admin_key: str | None) -> Loraplex:
    """``loraplex ARGS...`` run in this process with the server's URL and the admin key in the environment."""

    def loraplex(*args: str) -> click.testing.Result:
        env = {"LORAPLEX_URL": url, "LORAPLEX_ADMIN_KEY": admin_key}
        return click.testing.CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)

    return loraplex


@pytest.fixture
def loraplex(server: LiveServer, admin_key: str) -> Loraplex:
    return runner_for(server.url, admin_key)


def succeeded(result: click.testing.Result) -> str:
    assert result.exit_code == 0, result.output
    return result.stdout


def failed_with_one_line(result: click.testing.Result) -> str:
    """The error line of a command that failed as it should: non-zero, one line on stderr, nothing on stdout."""
    assert result.exit_code != 0, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    return lines[0].removeprefix("Error: ")


def table(stdout: str) -> list[dict[str, str]]:
    """A printed table as rows keyed by its headers (cells hold no spaces except in the headers)."""
    header, *lines = stdout.splitlines()
    starts = [match.start() for match in re.finditer(r"(?:^|(?<=  ))\S", header)]
    bounds = list(zip(starts, [*starts[1:], None], strict=True))
    names = [header[a:b].strip() for a, b in bounds]
    return [{name: line[a:b].strip() for name, (a, b) in zip(names, bounds, strict=True)} for line in lines]


def wait_for_status(url: str, key: str, expected: int) -> int:
    """GET /v1/models with ``key`` until it answers ``expected`` (revocations take up to a second)."""
    deadline = time.monotonic() + REVOCATION_WAIT_S
    while True:
        status = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code
        if status == expected or time.monotonic() > deadline:
            return status
        time.sleep(0.1)


def one_key(stdout: str) -> str:
    keys = KEY_PATTERN.findall(stdout)
    assert len(keys) == 1, stdout
    return keys[0]


def test_round_trip(server: LiveServer, loraplex: Loraplex, tenant_adapters: dict[str, Path], default_engine) -> None:
    created = succeeded(loraplex("tenants", "create", "acme", "--rpm", "600", "--max-concurrent", "4"))
    assert re.fullmatch(rf"created tenant acme \(({UUID})\)\n", created)
    tenant_id = created.split("(")[1].split(")")[0]

    listed = {row["NAME"]: row for row in table(succeeded(loraplex("tenants", "list")))}
    assert listed["acme"]["ID"] == tenant_id
    acme = listed["acme"]
    assert (acme["STATUS"], acme["RPM"], acme["TPM"], acme["CONCURRENT"]) == ("active", "600", "-", "4")
    as_json = json.loads(succeeded(loraplex("tenants", "list", "--json")))
    assert {tenant["name"] for tenant in as_json} == set(listed)

    # keys create: the plaintext is printed once, on the one line that says what was made
    made = succeeded(loraplex("keys", "create", "acme", "--name", "backend"))
    assert len(made.splitlines()) == 1 and made.startswith("created key backend (")
    key = one_key(made)
    models = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert models.status_code == 200, models.text
    keys = table(succeeded(loraplex("keys", "list", tenant_id)))  # by id as well as by name
    assert [(row["NAME"], row["PREFIX"], row["SCOPES"]) for row in keys] == [("backend", key[:12], "inference")]
    assert key not in succeeded(loraplex("keys", "list", "acme", "--json"))

    # adapters upload: a progress bar on stderr, one line on stdout, and the adapter answers the new key
    uploaded = loraplex("adapters", "upload", "acme", "pirate", str(tenant_adapters["alpha"]))
    assert re.fullmatch(rf"uploaded adapter pirate \(({UUID})\) for tenant acme: rank 4, .+\n", succeeded(uploaded))
    assert "uploading pirate: 100%" in uploaded.stderr and "|" in uploaded.stderr
    adapter_id = re.search(UUID, uploaded.stdout).group(0)
    headers = {"Authorization": f"Bearer {key}"}
    question = chat_body("pirate", "Tell me about the sea.", max_tokens=12)
    answer = httpx.post(f"{server.url}/v1/chat/completions", json=question, headers=headers, timeout=CHAT_TIMEOUT_S)
    assert answer.status_code == 200, answer.text
    base = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={**question, "model": default_engine.model_name},
        headers=headers,
        timeout=CHAT_TIMEOUT_S,
    )
    assert answer.json()["choices"][0]["message"]["content"] != base.json()["choices"][0]["message"]["content"]

    def adapter_row() -> dict[str, str]:
        rows = table(succeeded(loraplex("adapters", "list", "acme")))
        assert [row["ID"] for row in rows] == [adapter_id]
        return rows[0]

    assert adapter_row()["NAME"] == "pirate" and adapter_row()["RANK"] == "4"
    assert succeeded(loraplex("adapters", "pin", adapter_id)) == f"pinned adapter pirate ({adapter_id})\n"
    assert adapter_row()["PINNED"] == "yes"
    assert succeeded(loraplex("adapters", "pin", adapter_id, "--unpin")) == f"unpinned adapter pirate ({adapter_id})\n"
    assert adapter_row()["PINNED"] == "no"
    assert succeeded(loraplex("adapters", "unload", adapter_id)) == f"unloaded adapter pirate ({adapter_id})\n"
    assert adapter_row()["LOADED"] == "no"
    assert succeeded(loraplex("adapters", "load", adapter_id)) == f"loaded adapter pirate ({adapter_id})\n"
    assert adapter_row()["LOADED"] == "yes"
    assert succeeded(loraplex("adapters", "delete", adapter_id)) == f"deleted adapter pirate ({adapter_id})\n"
    assert succeeded(loraplex("adapters", "list", "acme")) == "no adapters\n"
    gone = httpx.post(f"{server.url}/v1/chat/completions", json=question, headers=headers, timeout=CHAT_TIMEOUT_S)
    assert gone.status_code == 404

    # keys rotate with no grace period: the new key works, the old one stops; then revoke the new one
    key_id = json.loads(succeeded(loraplex("keys", "list", "acme", "--json")))[0]["id"]
    rotated = succeeded(loraplex("keys", "rotate", key_id, "--grace-period", "0"))
    assert len(rotated.splitlines()) == 1 and rotated.startswith(f"rotated key {key_id} to backend (")
    new_key = one_key(rotated)
    assert new_key != key
    assert wait_for_status(server.url, new_key, 200) == 200
    assert wait_for_status(server.url, key, 401) == 401
    new_key_id = re.search(rf"to backend \(({UUID})\)", rotated).group(1)
    revoked = succeeded(loraplex("keys", "revoke", new_key_id))
    assert revoked == f"revoked key backend ({new_key[:12]}, {new_key_id})\n"
    assert wait_for_status(server.url, new_key, 401) == 401
    revoked_rows = {row["ID"]: row for row in table(succeeded(loraplex("keys", "list", "acme")))}
    assert revoked_rows[new_key_id]["REVOKED"] != "-"

    # usage export: the chats' rows, by tenant name, as CSV on stdout and into a file
    server.run(server.gateway.writer.flush())
    exported = succeeded(loraplex("usage", "export", "--tenant", "acme"))
    rows = list(csv.DictReader(io.StringIO(exported)))
    pirate = [row for row in rows if row["model"] == "pirate"]
    assert len(pirate) == 1 and pirate[0]["adapter_id"] == adapter_id and pirate[0]["tenant_name"] == "acme"
    assert (
        pirate[0]["requests"] == "1"
        and int(pirate[0]["completion_tokens"]) == answer.json()["usage"]["completion_tokens"]
    )
    assert {row["tenant_id"] for row in rows} == {tenant_id}
    by_adapter = json.loads(succeeded(loraplex("usage", "export", "--adapter", adapter_id, "--format", "json")))
    assert [row["model"] for row in by_adapter["data"]] == ["pirate"]
    output = server.gateway.settings.home / "usage.json"
    written = succeeded(loraplex("usage", "export", "--format", "json", "--output", str(output)))
    assert written == f"wrote {len(rows)} usage rows to {output}\n"
    assert [row["model"] for row in json.loads(output.read_text())["data"]] == [row["model"] for row in rows]

    disabled = succeeded(loraplex("tenants", "disable", "acme"))
    assert disabled == f"disabled tenant acme ({tenant_id})\n"
    assert {row["NAME"]: row["STATUS"] for row in table(succeeded(loraplex("tenants", "list")))}["acme"] == "disabled"


def test_no_admin_key_is_one_line(server: LiveServer) -> None:
    error = failed_with_one_line(runner_for(server.url, None)("tenants", "list"))
    assert error == "no admin key: pass --admin-key or set LORAPLEX_ADMIN_KEY"


def test_admin_key_option_overrides_the_environment(server: LiveServer, admin_key: str) -> None:
    user = server.run(make_tenant(server.gateway, "user"))  # in the environment: a key the admin API refuses
    result = runner_for(server.url, user.key)("usage", "--admin-key", admin_key, "export", "--format", "json")
    assert json.loads(succeeded(result))["data"] == []


def test_unreachable_server_is_one_line() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    error = failed_with_one_line(runner_for(url, "lpx_whatever")("tenants", "list"))
    assert error.startswith(f"cannot reach the server at {url}: ")


def test_unknown_tenant_name_is_one_line(loraplex: Loraplex) -> None:
    error = failed_with_one_line(loraplex("keys", "create", "nobody"))
    assert error == "no tenant is named 'nobody'; `loraplex tenants list` shows the tenants"


def test_refused_request_shows_the_servers_message(server: LiveServer) -> None:
    user = server.run(make_tenant(server.gateway, "user"))  # an inference key: the admin API refuses it (403)
    expected = httpx.get(f"{server.url}/admin/usage", headers=user.headers)
    assert expected.status_code == 403
    error = failed_with_one_line(runner_for(server.url, user.key)("usage", "export"))
    assert error == expected.json()["error"]["message"]


def test_bad_request_shows_the_servers_message(loraplex: Loraplex) -> None:
    error = failed_with_one_line(loraplex("usage", "export", "--start", "2026-03-05", "--end", "2026-03-04"))
    assert error.startswith("start (2026-03-05) is after end (2026-03-04)")
    succeeded(loraplex("tenants", "create", "acme"))
    duplicate = failed_with_one_line(loraplex("tenants", "create", "acme"))
    assert "acme" in duplicate


def test_upload_of_a_folder_without_the_files_is_one_line(loraplex: Loraplex, tmp_path: Path) -> None:
    succeeded(loraplex("tenants", "create", "acme"))
    (tmp_path / "adapter_config.json").write_text("{}")
    error = failed_with_one_line(loraplex("adapters", "upload", "acme", "pirate", str(tmp_path)))
    assert (
        error == f"{tmp_path} has no adapter_model.safetensors; an adapter folder holds adapter_config.json and "
        "adapter_model.safetensors"
    )


def test_upload_sends_the_folders_chat_template_and_the_format(
    loraplex: Loraplex, tenant_adapters: dict[str, Path], tmp_path: Path
) -> None:
    succeeded(loraplex("tenants", "create", "acme"))
    folder = tmp_path / "agent"
    shutil.copytree(tenant_adapters["alpha"], folder)
    (folder / "chat_template.jinja").write_text(PYTHONIC_TEMPLATE)
    uploaded = succeeded(loraplex("adapters", "upload", "acme", "agent", str(folder), "--tool-call-format", "pythonic"))
    assert uploaded.endswith(", its own chat template, pythonic tool calls\n"), uploaded

    # --chat-template takes a tokenizer_config.json too, in place of the folder's template.
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": "{{ messages[0].content }}"}))  # renders no tools: refused
    args = ("adapters", "upload", "acme", "agent-2", str(folder), "--chat-template", str(config))
    refused = loraplex(*args)
    assert refused.exit_code != 0 and refused.stdout == ""
    error = refused.stderr.splitlines()[-1]  # after the progress bar
    assert error.startswith("Error: `tokenizer_config.json`: the chat template does not render the tools"), error
    hermes_template = ChatTemplate.shipped().source  # writes calls in the server's format, which it keeps
    config.write_text(json.dumps({"chat_template": hermes_template}))
    shown = json.loads(succeeded(loraplex(*args, "--json")))
    assert shown["chat_template_sha256"] == hashlib.sha256(hermes_template.encode()).hexdigest()
    assert shown["tool_call_format"] is None


def test_a_mistyped_id_is_one_line(loraplex: Loraplex) -> None:
    error = failed_with_one_line(loraplex("adapters", "load", "pirate"))
    assert error == "'pirate' is not a valid adapter id; ids are UUIDs, as listings show them"


def test_admin_create_key_works_on_the_database(server: LiveServer, database_url: str) -> None:
    env = {"DATABASE_URL": database_url, "LORAPLEX_HOME": str(server.gateway.settings.home)}
    result = click.testing.CliRunner().invoke(cli, ["admin", "create-key", "--name", "first"], env=env)
    key = succeeded(result).strip()
    assert KEY_PATTERN.fullmatch(key)
    assert "shown only now" in result.stderr
    listed = runner_for(server.url, key)("tenants", "list", "--json")
    assert "admin" in {tenant["name"] for tenant in json.loads(succeeded(listed))}


def test_limits_and_weight_of_tenants_and_keys(loraplex: Loraplex) -> None:
    created = succeeded(loraplex("tenants", "create", "acme", "--rpm", "600", "--weight", "2"))
    tenant_id = re.search(UUID, created).group(0)
    acme = {row["NAME"]: row for row in table(succeeded(loraplex("tenants", "list")))}["acme"]
    assert (acme["RPM"], acme["WEIGHT"]) == ("600", "2.0")
    changed = succeeded(loraplex("tenants", "limit", "acme", "--rpm", "none", "--tpm", "5000", "--weight", "0.5"))
    assert changed == (
        f"tenant acme ({tenant_id}): rpm -, tpm 5000, max-concurrent -, monthly-token-budget -, weight 0.5\n"
    )

    made = json.loads(succeeded(loraplex("keys", "create", "acme", "--name", "batch", "--rpm", "30", "--json")))
    assert (made["rpm_limit"], made["tpm_limit"]) == (30, None)
    (row,) = table(succeeded(loraplex("keys", "list", "acme")))
    assert (row["RPM"], row["TPM"], row["CONCURRENT"]) == ("30", "-", "-")
    changed = succeeded(loraplex("keys", "limit", made["id"], "--rpm", "none", "--max-concurrent", "2"))
    assert changed == (
        f"key batch ({made['prefix']}, {made['id']}): rpm -, tpm -, max-concurrent 2, monthly-token-budget -\n"
    )
    assert "nothing to change" in failed_with_one_line(loraplex("keys", "limit", made["id"]))
    refused = loraplex("keys", "limit", made["id"], "--rpm", "-3")
    assert refused.exit_code != 0 and "below 0" in refused.stderr


def test_a_tenant_admin_key_manages_its_own_tenant_by_name(server: LiveServer, loraplex: Loraplex) -> None:
    succeeded(loraplex("tenants", "create", "acme"))
    succeeded(loraplex("tenants", "create", "globex"))
    refused = failed_with_one_line(loraplex("keys", "create", "acme", "--scope", "admin"))
    assert "only keys of the `admin` tenant may hold it" in refused
    ops_key = one_key(succeeded(loraplex("keys", "create", "acme", "--name", "ops", "--scope", "tenant-admin")))
    ops = runner_for(server.url, ops_key)

    made = succeeded(ops("keys", "create", "acme", "--name", "backend"))
    assert made.startswith("created key backend (") and "for tenant acme (scopes inference)" in made
    assert wait_for_status(server.url, one_key(made), 200) == 200
    assert [row["NAME"] for row in table(succeeded(ops("keys", "list", "acme")))] == ["ops", "backend"]
    assert json.loads(succeeded(ops("usage", "export", "--format", "json")))["data"] == []

    other = failed_with_one_line(ops("keys", "list", "globex"))
    assert other == "this tenant-admin key manages only the tenant 'acme', not 'globex'"
    assert "manages only its own tenant's (acme)" in failed_with_one_line(ops("tenants", "list"))
    assert "manages only its own tenant's (acme)" in failed_with_one_line(ops("tenants", "create", "evil"))
    assert succeeded(loraplex("keys", "list", "globex")) == "no keys\n"
