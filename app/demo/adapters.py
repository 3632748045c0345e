"""What `loraplex serve` does until the HTTP gateway exists: run the engine on a few prompts.

It asks one question of the base model and of each demo adapter (a pirate and a French one, trained
on the CPU on first use by scripts/make_demo_adapters.py, about a minute), together with a handful of
other questions, all in one continuous batch, and prints the answers and the throughput.
"""

import logging
import subprocess
import sys
import time
from pathlib import Path

from app.model_store import resolve_model
from app.settings import Settings
from engine import Engine, EngineConfig, SamplingParams

logger = logging.getLogger(__name__)

ADAPTER_QUESTION = "What is the capital of France?"
DEMO_ADAPTERS = ("pirate", "french")
DEMO_QUESTIONS = (
    "Write a haiku about the sea.",
    "Explain in two sentences what a GPU is.",
    "Give me three tips for a good night's sleep.",
    "Translate 'good morning' into Spanish.",
)
DEMO_MAX_TOKENS = 64
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


def run_demo(settings: Settings) -> None:
    folder = resolve_model(settings.model, settings.home)
    adapters = ensure_demo_adapters(settings, folder)
    engine = Engine(EngineConfig(model=str(folder)))
    for name, path in adapters.items():
        engine.add_adapter(name, path)
    rows = [(ADAPTER_QUESTION, None), *((ADAPTER_QUESTION, name) for name in adapters)]
    rows += [(question, None) for question in DEMO_QUESTIONS]
    prompts = [
        engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        for question, _ in rows
    ]
    params = SamplingParams(max_tokens=DEMO_MAX_TOKENS, temperature=0.0)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params, adapters=[adapter for _, adapter in rows])
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(output.token_ids) for output in outputs)
    out = sys.stdout
    for (question, adapter), output in zip(rows, outputs, strict=True):
        out.write(f"\n> {question}   [{adapter or 'base model'}]\n{output.text.strip()}\n")
    out.write(
        f"\n{len(outputs)} requests ({len(adapters)} adapters and the base model) in one continuous batch: "
        f"{num_tokens} tokens in {elapsed:.2f} s ({num_tokens / elapsed:.1f} tokens/s)\n"
    )
    out.flush()
