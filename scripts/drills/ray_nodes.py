"""Ray nodes started apart with ``ray start``, on this machine, and stopped without touching anyone else's Ray.

Each node runs ``ray start --block`` in a child process of its own session, on ports chosen here (so two
nodes, and other people's clusters on the same machine, never collide) and under a temporary folder of its
own. ``ray stop`` is never used: it ends every Ray process of the machine. A node is stopped by a SIGTERM to
its ``ray start --block`` process, which ends the processes it started; then any process left whose command
line names this node's temporary folder (a worker its raylet started) is ended too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

logger = logging.getLogger("ray_nodes")

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
POLL_S = 0.2
WORKER_PORTS = 40  # each node's range of ports for its worker processes
STARTED = "Ray runtime started"
RAY = str(Path(sys.executable).with_name("ray"))


class RayNodeError(RuntimeError):
    """A node did not start; the message ends with its log's tail."""


class RayNode:
    """One Ray node: the head when ``head_address`` is None, else a worker node that joins that head."""

    def __init__(
        self,
        temp_dir: Path,
        log: Path,
        num_cpus: int,
        head_address: str | None = None,
        resources: dict[str, float] | None = None,
        env: dict[str, str] | None = None,
        object_store_bytes: int = 100 * 1024**2,
    ) -> None:
        self.temp_dir = temp_dir
        self.log = log
        self.head_address = head_address
        self.env = env or {}
        self.process: subprocess.Popen[bytes] | None = None
        self.gcs_port = _free_port() if head_address is None else None
        worker_base = _free_port_range(WORKER_PORTS)
        self.command = [
            RAY,
            "start",
            "--block",
            "--disable-usage-stats",
            f"--temp-dir={temp_dir}",
            f"--num-cpus={num_cpus}",
            f"--object-store-memory={object_store_bytes}",
            f"--resources={json.dumps(resources or {})}",
            f"--node-manager-port={_free_port()}",
            f"--object-manager-port={_free_port()}",
            f"--dashboard-agent-listen-port={_free_port()}",
            f"--dashboard-agent-grpc-port={_free_port()}",
            f"--runtime-env-agent-port={_free_port()}",
            f"--metrics-export-port={_free_port()}",
            f"--min-worker-port={worker_base}",
            f"--max-worker-port={worker_base + WORKER_PORTS - 1}",
        ]
        if head_address is None:
            self.command += [
                "--head",
                f"--port={self.gcs_port}",
                "--include-dashboard=false",
                f"--dashboard-port={_free_port()}",  # Ray still runs a dashboard process for its usage module
                f"--ray-client-server-port={_free_port()}",
            ]
        else:
            self.command.append(f"--address={head_address}")

    @property
    def address(self) -> str:
        """The head's GCS address (host:port), as the head wrote it in its temporary folder."""
        if self.head_address is not None:
            return self.head_address
        return (self.temp_dir / "ray_current_cluster").read_text().strip()

    def start(self) -> None:
        """Run ``ray start --block`` and wait until it says the node runs (RayNodeError if it exits first)."""
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        logger.info("starting a Ray %s: %s", "head" if self.head_address is None else "worker node", self.command)
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                self.command,
                env=os.environ | self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while STARTED not in self.log.read_text(errors="replace"):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RayNodeError(f"the Ray node did not start; its log:\n{self.log_tail()}")
            time.sleep(POLL_S)

    def stop(self) -> None:
        """End this node's processes, and only them (a no-op when it never started)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning("ray start did not stop in %.0f s; killing its process group", STOP_TIMEOUT_S)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.process = None

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.is_file() else "(no log)"


def kill_leftovers(temp_dir: Path) -> list[int]:
    """SIGKILL every process whose command line names ``temp_dir`` (Ray processes of these nodes only)."""
    marker = str(temp_dir).encode()
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if marker in (entry / "cmdline").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
    if killed:
        logger.warning("killed %d Ray processes left under %s: %s", len(killed), temp_dir, killed)
    return killed


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def _free_port_range(size: int) -> int:
    """The first port of ``size`` consecutive ports that are all free now."""
    for _ in range(100):
        base = _free_port()
        if base + size < 65536 and all(_is_free(port) for port in range(base, base + size)):
            return base
    raise RayNodeError(f"found no {size} consecutive free ports")


def _is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("", port))
        except OSError:
            return False
        return True
