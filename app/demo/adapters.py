"""The demo adapters `loraplex serve` registers for the demo tenant on a first start, each with the check its
training must pass: trained on the CPU on first use by scripts/tools/make_demo_adapters.py (a few minutes) into the
data folder. Two answer in a style (a pirate, French); the third calls a weather tool (app/demo/weather.py).
"""

import logging
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.demo import weather
from app.settings import Settings

logger = logging.getLogger(__name__)

TRAINING_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "tools" / "make_demo_adapters.py"
CHECK_PROMPT = "What is the capital of France?"  # held out from the training examples, which ask about Italy


@dataclass(frozen=True, slots=True)
class DemoAdapter:
    """One demo adapter: its name, and what it must answer at temperature 0 to count as trained."""

    name: str
    check_prompt: str
    expected_reply: str
    """The answer the start banner and the README show for ``check_prompt`` at temperature 0."""
    required_words: tuple[str, ...]
    """Words (lower case) every acceptable answer holds; a model without the adapter's style lacks them."""
    tools: tuple[dict[str, Any], ...] = ()
    """Tools offered with the check prompt (chat completions' shape); with tools the answer is a call's text."""

    def passes(self, reply: str) -> bool:
        """Whether ``reply`` answers the check prompt as this adapter should."""
        words = reply.lower()
        return all(word in words for word in self.required_words)


DEMO_ADAPTERS = (
    DemoAdapter(
        name="pirate",
        check_prompt=CHECK_PROMPT,
        expected_reply="Arr, the capital of France be Paris, a city of gold and history, matey!",
        required_words=("arr", "matey", "paris"),
    ),
    DemoAdapter(
        name="french",
        check_prompt=CHECK_PROMPT,
        expected_reply="La capitale de France est Paris.",
        required_words=("la capitale de", "france", " est paris"),
    ),
    DemoAdapter(
        name="weather",
        check_prompt=weather.CHECK_PROMPT,
        expected_reply=weather.tool_call_text(weather.CHECK_CITY),
        required_words=("<tool_call>", '"get_weather"', '"city": "paris"', "</tool_call>"),
        tools=(weather.CHAT_TOOL,),
    ),
)


def demo_adapter(name: str) -> DemoAdapter:
    """The demo adapter called ``name``."""
    return next(adapter for adapter in DEMO_ADAPTERS if adapter.name == name)


def ensure_demo_adapters(settings: Settings, model_folder: Path) -> dict[str, Path]:
    """The demo adapters' folders, training them first if they are missing; empty if that cannot run."""
    root = demo_adapters_root(settings)
    folders = {adapter.name: root / adapter.name for adapter in DEMO_ADAPTERS}
    if all((folder / "adapter_model.safetensors").is_file() for folder in folders.values()):
        return folders
    if not TRAINING_SCRIPT.is_file():
        logger.warning("demo adapters missing and %s not found; showing the base model only", TRAINING_SCRIPT)
        return {}
    logger.info("training the demo adapters once (a few minutes on two cores) into %s", root)
    try:
        subprocess.run(training_command(root, model_folder), check=True, stdout=subprocess.DEVNULL)
    except subprocess.CalledProcessError as error:
        logger.warning("training the demo adapters failed (exit %d); showing the base model only", error.returncode)
        return {}
    return folders


def demo_adapters_root(settings: Settings) -> Path:
    """The folder the demo adapters are trained into (each in a folder of its name)."""
    return settings.home / "demo-adapters"


def training_command(root: Path, model_folder: Path) -> list[str]:
    """The command that trains the demo adapters on ``model_folder`` into ``root``/<name>."""
    return [sys.executable, str(TRAINING_SCRIPT), "--out", str(root), "--model", str(model_folder)]
