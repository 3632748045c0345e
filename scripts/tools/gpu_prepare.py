"""The ``prepare`` half of the GPU checks (scripts/tools/gpu_checks.py): what a CUDA machine without network needs.

It runs on a development machine (the project's environment, network access) in the checkout that is copied to
the CUDA machine: the wheels of what the checks import and the device image lacks (CARRIED_PACKAGES, at
requirements.lock's versions, for CPython 3.12 on manylinux x86-64) into ``.gpu/wheels``, the default model's
tokenizer files and config.json into ``.gpu/tokenizer`` (all bench_gpu needs of the model: its weights stay
behind), then the folder to carry, the command, and the size that travels. ``.gpu`` is ignored by git.
"""

import json
import logging
import re
import shutil
import subprocess
import sys
from pathlib import Path

logger = logging.getLogger("gpu_checks")

ROOT = Path(__file__).resolve().parents[2]
GPU_FOLDER = ".gpu"  # ignored by git (.gitignore): copied to the CUDA machine beside the tracked files
WHEELS = Path(GPU_FOLDER) / "wheels"
TOKENIZER = Path(GPU_FOLDER) / "tokenizer"
LOCK = ROOT / "requirements.lock"
# What the checks import that the device image lacks: app/settings.py's platformdirs. The image holds
# the rest (torch, triton, transformers, tokenizers, safetensors, peft, numpy, filelock, pytest); xgrammar,
# msgspec and the gateway's packages are imported only by code that no step reaches.
CARRIED_PACKAGES = ("platformdirs",)
# The device image's Python, and the platform tags pip matches exactly (any wheel of these runs there).
DEVICE_PYTHON = (3, 12)
DEVICE_PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
MAX_TRAVEL_MIB = 50  # the copy to the CUDA machine holds 64 MiB at most; this leaves a margin
DEVICE_COMMAND = "python3 -m scripts.tools.gpu_checks run"
DEVICE_TIMEOUT_S = 600  # the longest command the CUDA machine runs


def lock_pins() -> dict[str, str]:
    """requirements.lock's ``name==version`` lines, by normalized name."""
    pins = {}
    for line in LOCK.read_text().splitlines():
        name, sep, version = line.partition("==")
        if sep and not line.startswith((" ", "#")):
            pins[normalize(name)] = version.strip()
    return pins


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def prepare(root: Path) -> int:
    """Wheels and tokenizer files into ``root/.gpu``; prints what to carry, the command and the size."""
    wheels = download_wheels(root / WHEELS)
    wrong = [wheel.name for wheel in wheels if not runs_on_device(wheel.name)]
    if wrong:
        logger.error("not for CPython %d.%d on manylinux x86-64: %s", *DEVICE_PYTHON, ", ".join(wrong))
        return 1
    copied = copy_tokenizer(root / TOKENIZER)
    tree, carried = tree_bytes(root), folder_bytes(root / GPU_FOLDER)
    total_mib = (tree + carried) / 2**20
    out = sys.stdout
    out.write(f"prepared in {root}: {GPU_FOLDER} travels with this checkout\n")
    for wheel in wheels:
        out.write(f"  wheel {wheel.name}: {wheel.stat().st_size / 1024:.1f} KiB\n")
    out.write(f"  tokenizer {', '.join(copied)}: {folder_bytes(root / TOKENIZER) / 2**20:.2f} MiB\n")
    out.write(
        f"travels: working tree {tree / 2**20:.2f} MiB + {GPU_FOLDER} {carried / 2**20:.2f} MiB "
        f"= {total_mib:.2f} MiB (at most {MAX_TRAVEL_MIB} MiB)\n"
    )
    out.write(f"copy also (carry): {json.dumps([GPU_FOLDER])}; timeout_s {DEVICE_TIMEOUT_S}; command:\n")
    out.write(f"  {DEVICE_COMMAND}\n")
    if total_mib > MAX_TRAVEL_MIB:
        logger.error("%.1f MiB would travel, over %d MiB: carry less", total_mib, MAX_TRAVEL_MIB)
        return 1
    return 0


def download_wheels(folder: Path) -> list[Path]:
    """CARRIED_PACKAGES at the lock's versions, for the device's Python and platform, into a fresh ``folder``."""
    pins = lock_pins()
    requirements = [f"{name}=={pins[normalize(name)]}" for name in CARRIED_PACKAGES]
    shutil.rmtree(folder, ignore_errors=True)  # one version of each: two would stop the install
    folder.mkdir(parents=True)
    platforms = [arg for name in DEVICE_PLATFORMS for arg in ("--platform", name)]
    command = [
        sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
        "--only-binary=:all:", "--implementation", "cp", "--python-version", ".".join(map(str, DEVICE_PYTHON)),
        *platforms, "--dest", str(folder), *requirements,
    ]  # fmt: skip
    logger.info("downloading %s", " ".join(requirements))
    subprocess.run(command, check=True)
    return sorted(folder.glob("*.whl"))


def runs_on_device(wheel_name: str) -> bool:
    """Whether a wheel of this file name installs on the device's CPython on manylinux x86-64."""
    from packaging.tags import compatible_tags, cpython_tags
    from packaging.utils import parse_wheel_filename

    python = f"cp{DEVICE_PYTHON[0]}{DEVICE_PYTHON[1]}"
    supported = set(cpython_tags(DEVICE_PYTHON, [python, "abi3", "none"], DEVICE_PLATFORMS))
    supported |= set(compatible_tags(DEVICE_PYTHON, python, DEVICE_PLATFORMS))
    return bool(parse_wheel_filename(wheel_name)[3] & supported)


def copy_tokenizer(folder: Path) -> list[str]:
    """The configured model's tokenizer files and config.json (what bench_gpu reads of it) into ``folder``."""
    from app.model_store import resolve_model
    from app.settings import Settings
    from scripts.benchmarks.engine.bench_gpu import TOKENIZER_FILES

    settings = Settings.from_env()
    source = resolve_model(settings.model, settings.home)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    copied = []
    for name in ("config.json", *TOKENIZER_FILES):
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
            copied.append(name)
    return copied


def tree_bytes(root: Path) -> int:
    """The bytes of the files copied without being named: tracked, and untracked files git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout.decode()
    paths = {root / name for name in listed.split("\0") if name}
    return sum(path.stat().st_size for path in paths if path.is_file())


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
