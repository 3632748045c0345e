"""A two-step smoke run of scripts/tools/make_demo_adapters.py on a tiny model: it writes loadable PEFT folders.

The run starts the script where `loraplex serve` starts it on a first start (app/demo/adapters.py).
"""

import json
import subprocess
import sys
from pathlib import Path

from app.demo.adapters import TRAINING_SCRIPT
from engine.adapters.lora_adapter import load_lora_adapter
from engine.config import ModelConfig
from tests.engine.tiny_models import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
# ChatML, as the default model renders it; the tiny tokenizer has no chat template of its own.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_smoke_run_writes_two_loadable_adapters_and_answers(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "tiny", "llama")
    tokenizer_config = model / "tokenizer_config.json"
    settings = json.loads(tokenizer_config.read_text())
    tokenizer_config.write_text(json.dumps({**settings, "chat_template": CHAT_TEMPLATE}))
    out = tmp_path / "adapters"

    result = subprocess.run(
        [
            sys.executable,
            str(TRAINING_SCRIPT),
            "--model",
            str(model),
            "--out",
            str(out),
            "--steps",
            "2",
            "--max-new-tokens",
            "4",
            "--no-check",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith(("base:", "pirate:", "french:", "weather:"))] == [
        "base",
        "pirate",
        "french",
        "weather",
    ]
    config = ModelConfig.from_folder(model)
    pirate, french = load_lora_adapter(out / "pirate", config), load_lora_adapter(out / "french", config)
    assert (
        pirate.ranks
        == french.ranks
        == {m: 8 for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}
    )
    assert pirate.digest != french.digest
    # Two AdamW steps moved B away from PEFT's zero init, so each adapter changes the model.
    assert all(weights.b.abs().max() > 0 for layer in pirate.layers for weights in layer.values())
