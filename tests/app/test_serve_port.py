"""`loraplex serve` on a port another process holds: one line that names the port, before anything is created."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.model_store import resolve_model


@pytest.fixture
def held_port() -> Iterator[int]:
    """A loopback port another process (this one) listens on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def _serve(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    command = [str(Path(sys.executable).parent / "loraplex"), "serve", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)


def _fresh_env(home: Path, data_home: Path, **extra: str) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith(("LORAPLEX_", "DATABASE_URL"))}
    # The local model folder, so even a server that started would not pull anything into the fresh home.
    return {**env, "LORAPLEX_HOME": str(home), "LORAPLEX_MODEL": str(resolve_model("default", data_home)), **extra}


@pytest.mark.parametrize("by_env", [False, True], ids=["--port", "LORAPLEX_PORT"])
def test_taken_port_fails_fast_with_one_line_and_creates_nothing(
    held_port: int, data_home: Path, tmp_path: Path, by_env: bool
) -> None:
    home = tmp_path / "home"
    env = _fresh_env(home, data_home, **({"LORAPLEX_PORT": str(held_port)} if by_env else {}))

    result = _serve([] if by_env else ["--port", str(held_port)], env)

    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # the error alone: no model loaded, no database started
    assert str(held_port) in lines[0] and "in use" in lines[0]
    assert "--port" in lines[0] and "LORAPLEX_PORT" in lines[0]
    assert result.stdout == ""  # no banner, no key
    assert not home.exists()  # no key secret, no demo key, no database, no demo adapters


def test_unknown_host_fails_with_one_line(data_home: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    result = _serve(["--host", "no-such-host.invalid"], _fresh_env(home, data_home))

    assert result.returncode != 0
    assert len(result.stderr.strip().splitlines()) == 1 and "no-such-host.invalid" in result.stderr, result.stderr
    assert "--host" in result.stderr
    assert not home.exists()
