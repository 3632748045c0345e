"""The demo adapters `loraplex serve` registers for the demo tenant on a first start: a pirate and a French
one, trained on the CPU on first use by scripts/make_demo_adapters.py (about a minute) into the data folder.
"""

import logging
import subprocess
import sys
from pathlib import Path

from app.settings import Settings

logger = logging.getLogger(__name__)

DEMO_ADAPTERS = ("pirate", "french")
TRAINING_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_demo_adapters.py"


def ensure_demo_adapters(settings: Settings, model_folder: Path) -> dict[str, Path]:
    """The demo adapters' folders, training them first if they are missing; empty if that cannot run."""
    root = settings.home / "demo-adapters"
    folders = {name: root / name for name in DEMO_ADAPTERS}
    if all((folder / "adapter_model.safetensors").is_file() for folder in folders.values()):
        return folders
    if not TRAINING_SCRIPT.is_file():
        logger.warning("demo adapters missing and %s not found; showing the base model only", TRAINING_SCRIPT)
        return {}
    logger.info("training the demo adapters once (about a minute on two cores) into %s", root)
    command = [sys.executable, str(TRAINING_SCRIPT), "--out", str(root), "--model", str(model_folder)]
    try:
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    except subprocess.CalledProcessError as error:
        logger.warning("training the demo adapters failed (exit %d); showing the base model only", error.returncode)
        return {}
    return folders
