"""Read a Llama-family safetensors folder into fused, per-layer weight tensors."""

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.errors import ConfigError
from kernels.backend import KernelBackend
from kernels.linear import LinearWeight


@dataclass(frozen=True, slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: LinearWeight  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden], q, k, v stacked (+ bias)
    o: LinearWeight  # [hidden, num_heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: LinearWeight  # [2 * intermediate, hidden], gate then up
    down: LinearWeight  # [hidden, intermediate]


@dataclass(frozen=True, slots=True)
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor  # [hidden]
    lm_head: LinearWeight  # [vocab, hidden]; a copy of the embedding when tied


def load_weights(
    folder: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device, backend: KernelBackend
) -> ModelWeights:
    """The checkpoint's tensors on ``device`` in ``dtype``, projections prepared for ``backend``'s GEMM."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{folder} has no .safetensors weights; convert the model to safetensors first")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[name] = handle.get_tensor(name)

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ConfigError(f"{folder} lacks the tensor {name!r}; is it a {config.model_type} checkpoint?")
        return tensors.pop(name).to(device=device, dtype=dtype)

    def optional(name: str) -> torch.Tensor | None:
        return take(name) if name in tensors else None

    def projection(weight: torch.Tensor, bias: torch.Tensor | None = None) -> LinearWeight:
        return LinearWeight.prepare(weight, bias, backend)

    layers = []
    for index in range(config.num_layers):
        prefix = f"model.layers.{index}."
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        biases = [optional(attn + f"{proj}_proj.bias") for proj in "qkv"]
        qkv_bias = torch.cat(biases) if all(b is not None for b in biases) else None
        layers.append(
            LayerWeights(
                input_norm=take(prefix + "input_layernorm.weight"),
                qkv=projection(torch.cat([take(attn + f"{proj}_proj.weight") for proj in "qkv"]), qkv_bias),
                o=projection(take(attn + "o_proj.weight")),
                post_norm=take(prefix + "post_attention_layernorm.weight"),
                gate_up=projection(torch.cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")])),
                down=projection(take(mlp + "down_proj.weight")),
            )
        )
    embed = take("model.embed_tokens.weight")
    lm_head = optional("lm_head.weight")
    if lm_head is None:
        if not config.tie_word_embeddings:
            raise ConfigError(f"{folder} has no lm_head.weight and its config does not tie embeddings")
        lm_head = embed
    return ModelWeights(
        embed=embed, layers=tuple(layers), final_norm=take("model.norm.weight"), lm_head=projection(lm_head)
    )
