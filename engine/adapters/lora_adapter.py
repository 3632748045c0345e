"""Load a PEFT LoRA folder into validated fp32 tensors, with the LoRA scale folded into B.

A PEFT folder holds ``adapter_config.json`` and ``adapter_model.safetensors``, whose tensors are named
``base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}[.{adapter name}].weight``. Everything that
could make the engine compute something other than what PEFT computes is rejected with a typed error; pickled
weights (``adapter_model.bin``) are never opened.
"""

import hashlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from engine.adapters.lora_config import (
    PARENT,
    PROJECTIONS,
    LoraConfig,
    module_key,
    parse_lora_config,
    projection_shapes,
)
from engine.config import ModelConfig
from engine.errors import AdapterFormatError, AdapterMismatchError, AdapterNotFoundError, UnsupportedAdapterError

logger = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_WEIGHTS_FILE = "adapter_model.bin"
MIN_RANK, MAX_RANK = 1, 256  # the ranks the pool layout and SGMV kernels are built and tested for
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
TENSOR_NAME = re.compile(
    r"base_model\.model\.(?P<key>model\.layers\.(?P<layer>\d+)\.(?P<parent>self_attn|mlp)\.(?P<module>\w+))"
    r"\.lora_(?P<side>[AB])(?:\.(?P<adapter>[\w-]+))?\.weight"
)


class LoraWeights(NamedTuple):
    """One projection's LoRA in one layer: delta_W = b @ a, the scale already in b."""

    a: torch.Tensor  # [rank, in_features], fp32
    b: torch.Tensor  # [out_features, rank], fp32, times lora_alpha / r (or / sqrt(r) with rsLoRA)


@dataclass(frozen=True, slots=True, eq=False)
class LoraAdapter:
    """A validated LoRA adapter in host memory, ready to be copied into the page pool."""

    digest: str
    """sha256 over the config and weight files' bytes (see ``adapter_digest``)."""
    size_bytes: int
    """Bytes of adapter_config.json plus adapter_model.safetensors."""
    modules: tuple[str, ...]
    """Projections that carry LoRA weights in at least one layer, in the order of ``PROJECTIONS``."""
    ranks: dict[str, int]
    """Per module in ``modules``: the largest rank over the layers."""
    layers: tuple[dict[str, LoraWeights], ...]
    """One dict per base model layer, keyed by projection; empty for layers the adapter leaves alone."""
    lora_alpha: float
    use_rslora: bool
    base_model_name_or_path: str | None

    @property
    def max_rank(self) -> int:
        return max(self.ranks.values())

    @property
    def num_params(self) -> int:
        return sum(w.a.numel() + w.b.numel() for layer in self.layers for w in layer.values())


def adapter_digest(config_bytes: bytes, weights_bytes: bytes) -> str:
    """The adapter's content digest: sha256 of len(config) as 8 little-endian bytes, the config, then the weights."""
    digest = hashlib.sha256(len(config_bytes).to_bytes(8, "little"))
    digest.update(config_bytes)
    digest.update(weights_bytes)
    return digest.hexdigest()


def load_lora_adapter(folder: Path, model: ModelConfig) -> LoraAdapter:
    """Read and validate the PEFT LoRA folder ``folder`` for the base model ``model``."""
    folder = Path(folder)
    if not folder.is_dir():
        raise AdapterNotFoundError(
            f"adapter folder {folder} does not exist; give the folder PEFT's save_pretrained wrote"
        )
    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config_path.is_file():
        raise AdapterNotFoundError(
            f"{folder} has no {CONFIG_FILE}; a PEFT LoRA folder holds {CONFIG_FILE} and {WEIGHTS_FILE}"
        )
    if not weights_path.is_file():
        if (folder / PICKLED_WEIGHTS_FILE).is_file():
            raise AdapterFormatError(
                f"{folder} holds {PICKLED_WEIGHTS_FILE}, pickled weights that the engine never unpickles; convert it "
                f"to {WEIGHTS_FILE} where you trust the file (safetensors.torch.save_file(torch.load(path, "
                "weights_only=True), ...)) or re-save with PEFT's save_pretrained(safe_serialization=True)"
            )
        raise AdapterNotFoundError(
            f"{folder} has no {WEIGHTS_FILE}; a PEFT LoRA folder holds {CONFIG_FILE} and {WEIGHTS_FILE}"
        )
    return parse_lora_adapter(config_path.read_bytes(), weights_path.read_bytes(), model, source=str(folder))


def parse_lora_adapter(
    config_bytes: bytes, weights_bytes: bytes, model: ModelConfig, source: str = "adapter"
) -> LoraAdapter:
    """Validate an adapter given as the bytes of its two files (an upload); ``source`` names it in errors."""
    config = parse_lora_config(config_bytes, model, source)
    pairs = _pair_tensors(_read_tensors(weights_bytes, source), model, source)
    shapes = projection_shapes(model)
    layers: list[dict[str, LoraWeights]] = [{} for _ in range(model.num_layers)]
    ranks: dict[str, int] = {}
    for (layer, module), (a, b) in sorted(pairs.items()):
        rank = _check_pair(config, layer, module, a, b, shapes[module], source)
        scale = config.scale_of(module_key(layer, module))
        layers[layer][module] = LoraWeights(a=a.float().contiguous(), b=(b.float() * scale).contiguous())
        ranks[module] = max(ranks.get(module, 0), rank)
    modules = tuple(m for m in PROJECTIONS if m in ranks)
    adapter = LoraAdapter(
        digest=adapter_digest(config_bytes, weights_bytes),
        size_bytes=len(config_bytes) + len(weights_bytes),
        modules=modules,
        ranks={m: ranks[m] for m in modules},
        layers=tuple(layers),
        lora_alpha=config.lora_alpha,
        use_rslora=config.use_rslora,
        base_model_name_or_path=config.base_model_name_or_path,
    )
    logger.info(
        "loaded LoRA adapter %s: modules %s, ranks %s, %d layers, digest %s",
        source,
        ",".join(modules),
        adapter.ranks,
        sum(1 for layer in layers if layer),
        adapter.digest[:12],
    )
    return adapter


def _read_tensors(data: bytes, source: str) -> dict[str, torch.Tensor]:
    try:
        tensors = load_safetensors(data)
    except (SafetensorError, ValueError) as exc:
        raise AdapterFormatError(
            f"{source}: {WEIGHTS_FILE} is corrupt or truncated ({exc}); upload the file again or re-save the adapter"
        ) from exc
    if not tensors:
        raise AdapterFormatError(f"{source}: {WEIGHTS_FILE} holds no tensors")
    return tensors


def _pair_tensors(
    tensors: dict[str, torch.Tensor], model: ModelConfig, source: str
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Group lora_A and lora_B by (layer, projection), rejecting every tensor that is not one of them."""
    sides: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    adapter_names: set[str] = set()
    for name, tensor in tensors.items():
        match = TENSOR_NAME.fullmatch(name)
        if match is None:
            raise _unexpected_tensor(name, source)
        layer, module = int(match["layer"]), match["module"]
        if module not in PROJECTIONS or PARENT[module] != match["parent"]:
            raise AdapterMismatchError(
                f"{source}: tensor {name} is for {match['key']}, which this {model.model_type}"
                " model does not have; the adapter was made for another architecture"
            )
        if layer >= model.num_layers:
            raise AdapterMismatchError(
                f"{source}: tensor {name} is for layer {layer} but the base model has "
                f"{model.num_layers} layers; the adapter was made for another model"
            )
        if tensor.dtype not in FLOAT_DTYPES:
            raise AdapterFormatError(f"{source}: tensor {name} has dtype {tensor.dtype}; LoRA weights are floats")
        if not torch.isfinite(tensor).all():
            raise AdapterFormatError(
                f"{source}: tensor {name} holds NaN or infinite values; the adapter is broken "
                "(diverged training or a bad export), retrain or re-export it"
            )
        adapter_names.add(match["adapter"] or "")
        side = sides.setdefault((layer, module), {})
        if match["side"] in side:
            raise AdapterFormatError(
                f"{source}: {match['key']} has two lora_{match['side']} tensors; save one adapter per folder"
            )
        side[match["side"]] = tensor
    if len(adapter_names) > 1:
        raise AdapterFormatError(
            f"{source}: tensors belong to several adapters ({sorted(adapter_names)}); save one adapter per folder"
        )
    pairs = {}
    for (layer, module), side in sides.items():
        if len(side) != 2:
            present, missing = next(iter(side)), "B" if "A" in side else "A"
            raise AdapterFormatError(
                f"{source}: {module_key(layer, module)} has lora_{present} but no "
                f"lora_{missing}; the weights file is incomplete"
            )
        pairs[(layer, module)] = (side["A"], side["B"])
    return pairs


def _unexpected_tensor(name: str, source: str) -> Exception:
    if "embed_tokens" in name or "lm_head" in name:
        return UnsupportedAdapterError(
            f"{source}: tensor {name} is an embedding or lm_head weight; embedding and "
            "lm_head LoRA cannot be served, retrain targeting only the projections"
        )
    if "lora_magnitude_vector" in name:
        return UnsupportedAdapterError(f"{source}: tensor {name} is a DoRA magnitude; only plain LoRA can be served")
    if ".lora_B." in name and name.endswith(".bias"):
        return UnsupportedAdapterError(f"{source}: tensor {name} is a LoRA bias; retrain with lora_bias=False")
    return AdapterFormatError(
        f"{source}: unexpected tensor {name}; a LoRA adapter holds only the lora_A/lora_B weights of "
        f"{', '.join(PROJECTIONS)}, named like base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    )


def _check_pair(
    config: LoraConfig, layer: int, module: str, a: torch.Tensor, b: torch.Tensor, shape: tuple[int, int], source: str
) -> int:
    """Check one projection's A [r, in] and B [out, r] against the config and the base model; return r."""
    key = module_key(layer, module)
    if (layer, module) not in config.targets:
        raise AdapterFormatError(
            f"{source}: the weights hold a LoRA for {key}, which adapter_config.json does not "
            "target (PEFT would ignore it); the config and weights do not belong together"
        )
    in_features, out_features = shape
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape[0] != out_features:
        raise AdapterMismatchError(
            f"{source}: {key} has lora_A {list(a.shape)} and lora_B {list(b.shape)}, but this model's {module} maps "
            f"{in_features} to {out_features} features, so they must be [r, {in_features}] and [{out_features}, r]; "
            f"the adapter was made for another base model ({config.base_model_name_or_path or 'unknown'})"
        )
    rank = a.shape[0]
    if b.shape[1] != rank:
        raise AdapterFormatError(
            f"{source}: {key} has lora_A of rank {rank} but lora_B of rank {b.shape[1]}; "
            "the weights file is inconsistent"
        )
    if not MIN_RANK <= rank <= MAX_RANK:
        raise UnsupportedAdapterError(
            f"{source}: {key} has rank {rank}; ranks {MIN_RANK} to {MAX_RANK} are supported, retrain with a smaller r"
        )
    if rank != config.rank_of(key):
        raise AdapterFormatError(
            f"{source}: {key} has rank {rank} in the weights but {config.rank_of(key)} in "
            "adapter_config.json (r, rank_pattern); the config and weights do not match"
        )
    return rank
