"""Loading PEFT LoRA folders: the folded tensors equal PEFT's own delta, and every bad adapter is refused by name."""

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from engine.adapters.lora_adapter import LoraAdapter, adapter_digest, load_lora_adapter
from engine.adapters.lora_config import PROJECTIONS
from engine.config import ModelConfig
from engine.errors import (
    AdapterError,
    AdapterFormatError,
    AdapterMismatchError,
    AdapterNotFoundError,
    UnsupportedAdapterError,
)

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
PEFT_MODULE = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.\w+\.(\w+)")


def make_adapter(folder: Path, base: LlamaConfig, seed: int = 0, **lora: object) -> PeftModel:
    """A PEFT LoRA on a random model built from ``base``, with random (non-zero) B, saved to ``folder``."""
    torch.manual_seed(seed)
    peft_model = get_peft_model(LlamaForCausalLM(base), LoraConfig(**lora))
    with torch.no_grad():
        for module in peft_model.modules():
            if isinstance(module, LoraLayer):
                module.lora_B["default"].weight.normal_(0.0, 0.5)
    peft_model.save_pretrained(folder)
    return peft_model


def peft_deltas(peft_model: PeftModel) -> dict[tuple[int, str], torch.Tensor]:
    """scaling * B @ A of every LoRA layer of ``peft_model``, by (layer, projection)."""
    deltas = {}
    for name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer):
            match = PEFT_MODULE.fullmatch(name)
            assert match, name
            b, a = module.lora_B["default"].weight, module.lora_A["default"].weight
            deltas[(int(match[1]), match[2])] = module.scaling["default"] * b @ a  # [out, in]
    return deltas


def loaded_deltas(adapter: LoraAdapter) -> dict[tuple[int, str], torch.Tensor]:
    return {(i, m): w.b @ w.a for i, layer in enumerate(adapter.layers) for m, w in layer.items()}


@pytest.fixture(scope="module")
def base_config(tiny_llama: Path) -> LlamaConfig:
    return LlamaConfig.from_pretrained(tiny_llama)


@pytest.fixture(scope="module")
def model(tiny_llama: Path) -> ModelConfig:
    return ModelConfig.from_folder(tiny_llama)


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory, base_config: LlamaConfig) -> Path:
    folder = tmp_path_factory.mktemp("good")
    make_adapter(folder, base_config, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    return folder


@pytest.mark.parametrize(
    ("lora", "modules", "ranks"),
    [
        pytest.param(dict(r=4, lora_alpha=8, target_modules=ATTENTION), ATTENTION, None, id="plain"),
        pytest.param(
            dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"]),
            ["q_proj", "v_proj", "down_proj"],
            None,
            id="rslora",
        ),
        pytest.param(
            dict(
                r=4,
                lora_alpha=8,
                target_modules="all-linear",
                rank_pattern={"q_proj": 2, "model.layers.1.mlp.down_proj": 16},
                alpha_pattern={"v_proj": 32, "layers.0.self_attn.o_proj": 3},
            ),
            list(PROJECTIONS),
            {"q_proj": 2, "down_proj": 16},
            id="patterns-all-linear",
        ),
        pytest.param(
            dict(r=3, lora_alpha=5, target_modules=r".*\.layers\.1\.(self_attn\.(q|k)_proj|mlp\.up_proj)"),
            ["q_proj", "k_proj", "up_proj"],
            None,
            id="regex",
        ),
        pytest.param(
            dict(r=2, lora_alpha=2, target_modules=["gate_proj", "o_proj"], layers_to_transform=[1]),
            ["o_proj", "gate_proj"],
            None,
            id="layers-to-transform",
        ),
    ],
)
def test_folded_tensors_equal_peft_delta(
    tmp_path: Path,
    base_config: LlamaConfig,
    model: ModelConfig,
    lora: dict,
    modules: list[str],
    ranks: dict[str, int] | None,
) -> None:
    peft_model = make_adapter(tmp_path, base_config, **lora)
    adapter = load_lora_adapter(tmp_path, model)

    expected = peft_deltas(peft_model)
    got = loaded_deltas(adapter)
    assert got.keys() == expected.keys()
    for key, delta in expected.items():
        torch.testing.assert_close(got[key], delta, rtol=1e-5, atol=1e-6, msg=f"delta of {key}")
    assert adapter.modules == tuple(modules)
    assert adapter.ranks == {m: (ranks or {}).get(m, lora["r"]) for m in modules}
    assert len(adapter.layers) == model.num_layers
    for layer in adapter.layers:
        for weights in layer.values():
            assert weights.a.dtype == weights.b.dtype == torch.float32
            assert weights.a.device.type == "cpu"


def test_regex_and_layer_filters_leave_other_layers_empty(
    tmp_path: Path, base_config: LlamaConfig, model: ModelConfig
) -> None:
    make_adapter(tmp_path, base_config, r=2, target_modules=r"model\.layers\.1\.self_attn\.v_proj")
    adapter = load_lora_adapter(tmp_path, model)
    assert adapter.layers[0] == {}
    assert list(adapter.layers[1]) == ["v_proj"]


def test_all_linear_shorthand_in_a_hand_written_config(tmp_path: Path, good: Path, model: ModelConfig) -> None:
    folder = copy(good, tmp_path)
    edit_config(folder, target_modules="all-linear")
    adapter = load_lora_adapter(folder, model)
    assert adapter.modules == ("q_proj", "v_proj", "down_proj")
    edit_config(folder, target_modules="ALL-LINEAR", exclude_modules=["v_proj"])
    with pytest.raises(AdapterFormatError, match=re.escape("v_proj, which adapter_config.json does not target")):
        load_lora_adapter(folder, model)


def test_default_adapter_name_infix_is_accepted(tmp_path: Path, good: Path, model: ModelConfig) -> None:
    folder = copy(good, tmp_path)
    tensors = load_file(folder / "adapter_model.safetensors")
    renamed = {k.replace(".weight", ".default.weight"): v for k, v in tensors.items()}
    save_file(renamed, folder / "adapter_model.safetensors")
    plain, infixed = load_lora_adapter(good, model), load_lora_adapter(folder, model)
    for key, delta in loaded_deltas(plain).items():
        torch.testing.assert_close(loaded_deltas(infixed)[key], delta, rtol=0, atol=0)


def test_digest_is_stable_and_follows_content(
    tmp_path: Path, good: Path, base_config: LlamaConfig, model: ModelConfig
) -> None:
    first = load_lora_adapter(good, model)
    config_bytes = (good / "adapter_config.json").read_bytes()
    weights_bytes = (good / "adapter_model.safetensors").read_bytes()
    assert first.digest == adapter_digest(config_bytes, weights_bytes)
    assert first.size_bytes == len(config_bytes) + len(weights_bytes)
    assert load_lora_adapter(copy(good, tmp_path / "moved"), model).digest == first.digest

    retrained = tmp_path / "retrained"
    make_adapter(retrained, base_config, seed=1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    assert load_lora_adapter(retrained, model).digest != first.digest
    rescaled = copy(good, tmp_path / "rescaled")
    edit_config(rescaled, lora_alpha=16)
    assert load_lora_adapter(rescaled, model).digest != first.digest


def copy(folder: Path, dest: Path) -> Path:
    return Path(shutil.copytree(folder, dest, dirs_exist_ok=True))


def edit_config(folder: Path, **changes: object) -> None:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def edit_tensors(folder: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    path = folder / "adapter_model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)


Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


def _truncate(folder: Path) -> None:
    path = folder / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _only_bin(folder: Path) -> None:
    (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")


def _nan(tensors: dict[str, torch.Tensor]) -> None:
    tensors[f"{Q0}.lora_B.weight"][3, 1] = float("nan")


def _rank_mismatch(tensors: dict[str, torch.Tensor]) -> None:
    tensors[f"{Q0}.lora_B.weight"] = torch.randn(64, 5)


def _embedding_tensor(tensors: dict[str, torch.Tensor]) -> None:
    tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.randn(4, 320)


def _untargeted_tensor(tensors: dict[str, torch.Tensor]) -> None:
    tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"] = torch.randn(4, 64)
    tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"] = torch.randn(32, 4)


def _lonely_a(tensors: dict[str, torch.Tensor]) -> None:
    del tensors[f"{Q0}.lora_B.weight"]


REJECTIONS = [
    pytest.param(lambda f: shutil.rmtree(f), AdapterNotFoundError, "does not exist", id="missing-folder"),
    pytest.param(
        lambda f: (f / "adapter_config.json").unlink(),
        AdapterNotFoundError,
        "no adapter_config.json",
        id="missing-config",
    ),
    pytest.param(
        lambda f: (f / "adapter_model.safetensors").unlink(),
        AdapterNotFoundError,
        "no adapter_model.safetensors",
        id="missing-weights",
    ),
    pytest.param(_only_bin, AdapterFormatError, "never unpickles", id="pickled-bin"),
    pytest.param(
        lambda f: (f / "adapter_config.json").write_text("{'r': 4,"),
        AdapterFormatError,
        "not valid JSON",
        id="invalid-json",
    ),
    pytest.param(
        lambda f: edit_config(f, peft_type="IA3"), UnsupportedAdapterError, "peft_type is 'IA3'", id="not-lora"
    ),
    pytest.param(lambda f: edit_config(f, use_dora=True), UnsupportedAdapterError, "DoRA", id="dora"),
    pytest.param(lambda f: edit_config(f, bias="all"), UnsupportedAdapterError, "bias='all'", id="bias"),
    pytest.param(
        lambda f: edit_config(f, modules_to_save=["lm_head"]),
        UnsupportedAdapterError,
        "modules_to_save",
        id="modules-to-save",
    ),
    pytest.param(
        lambda f: edit_config(f, target_modules=["q_proj", "v_proj", "down_proj", "lm_head"]),
        UnsupportedAdapterError,
        "lm_head",
        id="lm-head-target",
    ),
    pytest.param(
        lambda f: edit_tensors(f, _embedding_tensor), UnsupportedAdapterError, "embed_tokens", id="embedding-tensor"
    ),
    pytest.param(
        lambda f: edit_config(f, target_modules=["c_attn", "q_proj"]),
        AdapterMismatchError,
        "'c_attn' does not exist",
        id="unknown-target",
    ),
    pytest.param(
        lambda f: edit_config(f, target_modules=r".*\.attn\.c_proj"),
        AdapterMismatchError,
        "matches no module",
        id="regex-matches-nothing",
    ),
    pytest.param(
        lambda f: edit_config(f, r=8), AdapterFormatError, "rank 4 in the weights but 8", id="config-rank-mismatch"
    ),
    pytest.param(
        lambda f: edit_tensors(f, _rank_mismatch), AdapterFormatError, "lora_B of rank 5", id="a-b-rank-mismatch"
    ),
    pytest.param(lambda f: edit_tensors(f, _nan), AdapterFormatError, "NaN", id="nan"),
    pytest.param(
        lambda f: edit_tensors(f, _untargeted_tensor), AdapterFormatError, "does not target", id="untargeted-tensor"
    ),
    pytest.param(lambda f: edit_tensors(f, _lonely_a), AdapterFormatError, "has lora_A but no lora_B", id="missing-b"),
    pytest.param(_truncate, AdapterFormatError, "corrupt or truncated", id="truncated"),
]


@pytest.mark.parametrize(("spoil", "error", "message"), REJECTIONS)
def test_bad_adapters_are_refused_with_a_typed_error(
    tmp_path: Path,
    good: Path,
    model: ModelConfig,
    spoil: Callable[[Path], None],
    error: type[AdapterError],
    message: str,
) -> None:
    folder = copy(good, tmp_path / "adapter")
    spoil(folder)
    with pytest.raises(error, match=re.escape(message)):
        load_lora_adapter(folder, model)


def test_adapter_for_another_model_names_the_tensor(tmp_path: Path, model: ModelConfig) -> None:
    other = LlamaConfig(
        vocab_size=320,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    make_adapter(tmp_path, other, r=4, target_modules=["q_proj"])
    with pytest.raises(
        AdapterMismatchError, match=re.escape("model.layers.0.self_attn.q_proj has lora_A [4, 96]")
    ) as caught:
        load_lora_adapter(tmp_path, model)
    assert "must be [r, 64] and [64, r]" in str(caught.value)


def test_adapter_with_more_layers_is_refused(tmp_path: Path, model: ModelConfig) -> None:
    deeper = LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    make_adapter(tmp_path, deeper, r=2, target_modules=["v_proj"])
    with pytest.raises(AdapterMismatchError, match="layer 2 but the base model has 2 layers"):
        load_lora_adapter(tmp_path, model)


def test_rank_above_256_is_refused(tmp_path: Path, base_config: LlamaConfig, model: ModelConfig) -> None:
    make_adapter(tmp_path, base_config, r=257, target_modules=["v_proj"])
    with pytest.raises(UnsupportedAdapterError, match="rank 257; ranks 1 to 256"):
        load_lora_adapter(tmp_path, model)
