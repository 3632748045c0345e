"""Mixed-adapter batches in the engine match PEFT's mixed-batch forward, logits and greedy tokens.

Four adapters with different ranks and target sets (one rsLoRA over all linear layers, one with
rank_pattern and alpha_pattern) and a row with no adapter, in one batch, on a tiny random Llama and on
the default model.
"""

from pathlib import Path

import pytest
import torch
from peft import PeftModel

from engine import SamplingParams
from tests.engine.conftest import make_engine, run_checked
from tests.engine.lora_helpers import load_peft_model, make_peft_adapter

ADAPTERS = {
    "plain": dict(r=8, target_modules=["q_proj", "v_proj"]),
    "rslora_all": dict(r=16, target_modules="all-linear", use_rslora=True),
    "patterns": dict(
        r=4,
        target_modules=["q_proj", "k_proj", "o_proj", "gate_proj", "down_proj"],
        rank_pattern={"layers.1.mlp.down_proj": 12},
        alpha_pattern={"o_proj": 40},
    ),
    "mlp_r2": dict(r=2, target_modules=["up_proj", "down_proj"], lora_alpha=4),
}
PROMPTS = [[5, 9, 11, 40, 7], [3] * 21, list(range(10, 47)), [100, 101, 102], [8, 8, 9, 9, 10, 10, 11]]
ROW_ADAPTERS = ["plain", "rslora_all", None, "patterns", "mlp_r2"]
MAX_TOKENS = 10
POOL_BYTES = 256 * 1024**2
REL_TOL = 1e-4  # of the row's largest logit: fp32 sums in another order differ by ~1e-6 of it per layer


@pytest.fixture(scope="module")
def adapter_folders(base_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_peft_adapter(base_folder, root / name, seed=i, **kwargs)
        for i, (name, kwargs) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def peft_model(base_folder: Path, adapter_folders: dict[str, Path]) -> PeftModel:
    return load_peft_model(base_folder, adapter_folders)


def _peft_last_logits(model: PeftModel, prompts: list[list[int]], adapters: list[str | None]) -> torch.Tensor:
    """One mixed-batch forward (left-padded), the logits of each row's last prompt token."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # [rows, width]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [rows, width]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [rows, width]
    names = [a if a is not None else "__base__" for a in adapters]
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, adapter_names=names)
    return out.logits[:, -1]  # [rows, vocab]


def test_mixed_batch_logits_match_peft(base_folder, adapter_folders, peft_model, kernels) -> None:
    engine = make_engine(base_folder, pool_bytes=POOL_BYTES, kernels=kernels)
    for name, folder in adapter_folders.items():
        engine.add_adapter(name, folder)
    captured = []
    forward = engine.model.forward

    def spy(batch, pool):
        logits = forward(batch, pool)
        captured.append({seq.request_id: row for seq, row in zip(batch.sampled_seqs, logits, strict=True)})
        return logits

    engine.model.forward = spy
    params = SamplingParams(max_tokens=1, temperature=0.0)
    ids = [engine.add_request(p, params, adapter=a) for p, a in zip(PROMPTS, ROW_ADAPTERS, strict=True)]
    run_checked(engine)
    ours = torch.stack([captured[0][i] for i in ids])  # [rows, vocab]
    theirs = _peft_last_logits(peft_model, PROMPTS, ROW_ADAPTERS)
    base = _peft_last_logits(peft_model, PROMPTS, [None] * len(PROMPTS))
    for row, adapter in enumerate(ROW_ADAPTERS):
        if adapter is not None:
            assert (theirs[row] - base[row]).abs().max() > 0.1, f"adapter {adapter} should change the logits"
    for row, adapter in enumerate(ROW_ADAPTERS):
        error = (ours[row] - theirs[row]).abs().max() / theirs[row].abs().max()
        assert error <= REL_TOL, f"row with adapter {adapter}: max error {error:.2e} of the largest logit"


def test_mixed_batch_greedy_tokens_match_peft(base_folder, adapter_folders, peft_model, kernels) -> None:
    engine = make_engine(base_folder, pool_bytes=POOL_BYTES, kernels=kernels)
    for name, folder in adapter_folders.items():
        engine.add_adapter(name, folder)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params, adapter=a) for p, a in zip(PROMPTS, ROW_ADAPTERS, strict=True)]
    finals = run_checked(engine)
    for request_id, prompt, adapter in zip(ids, PROMPTS, ROW_ADAPTERS, strict=True):
        prompt_ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = peft_model.generate(
                input_ids=prompt_ids,
                attention_mask=torch.ones_like(prompt_ids),
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=0,
                adapter_names=[adapter if adapter is not None else "__base__"],
            )
        assert finals[request_id].token_ids == ref[0, len(prompt) :].tolist(), f"row with adapter {adapter}"
