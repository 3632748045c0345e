"""Real PEFT adapters for tests, with non-zero random B so they change the output."""

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

B_STD = 0.2  # PEFT starts B at zero; a visible delta needs it filled


def make_peft_adapter(base: Path, out: Path, seed: int, **lora_kwargs) -> Path:
    """Save a PEFT LoRA adapter for ``base`` into ``out`` with random A and B (fixed by ``seed``)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora_kwargs.setdefault("lora_alpha", 16)
    peft_model = get_peft_model(model, LoraConfig(**lora_kwargs))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, B_STD)
    peft_model.save_pretrained(out)
    return out


def load_peft_model(base: Path, adapter_folders: dict[str, Path]) -> PeftModel:
    """``base`` in fp32 with every adapter loaded under its name, in eval mode (the reference of parity tests)."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    names = list(adapter_folders)
    peft_model = PeftModel.from_pretrained(model, adapter_folders[names[0]], adapter_name=names[0])
    for name in names[1:]:
        peft_model.load_adapter(adapter_folders[name], adapter_name=name)
    return peft_model.eval()
