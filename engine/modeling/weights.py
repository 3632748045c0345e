"""Read a Llama-family safetensors folder into fused, per-layer weight tensors."""

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.errors import ConfigError
from engine.modeling.precision import Precision
from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.projection.linear import WIDEN, LinearWeight


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
    folder: Path, config: ModelConfig, precision: Precision, device: torch.device, backend: KernelBackend
) -> ModelWeights:
    """The checkpoint's tensors on ``device``, projections prepared for ``backend``'s GEMM.

    The embedding, norms and biases come in the activation dtype; the projections in the model's dtype, or
    quantized from the checkpoint's values (read in fp32) when ``precision.quantization`` says so.
    """
    dtype = precision.activation_dtype
    projection_dtype = torch.float32 if precision.quantization else precision.dtype
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{folder} has no .safetensors weights; convert the model to safetensors first")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[name] = handle.get_tensor(name)

    def take(name: str, as_dtype: torch.dtype = dtype) -> torch.Tensor:
        if name not in tensors:
            raise ConfigError(f"{folder} lacks the tensor {name!r}; is it a {config.model_type} checkpoint?")
        return tensors.pop(name).to(device=device, dtype=as_dtype)

    def optional(name: str, as_dtype: torch.dtype = dtype) -> torch.Tensor | None:
        return take(name, as_dtype) if name in tensors else None

    def weight(name: str) -> torch.Tensor:
        return take(name, projection_dtype)

    def projection(matrix: torch.Tensor, bias: torch.Tensor | None = None) -> LinearWeight:
        return LinearWeight.prepare(
            matrix.to(projection_dtype), bias, backend, precision.quantization, precision.bf16_gemm or WIDEN
        )

    layers = []
    for index in range(config.num_layers):
        prefix = f"model.layers.{index}."
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        biases = [optional(attn + f"{proj}_proj.bias") for proj in "qkv"]
        qkv_bias = torch.cat(biases) if all(b is not None for b in biases) else None
        layers.append(
            LayerWeights(
                input_norm=take(prefix + "input_layernorm.weight"),
                qkv=projection(torch.cat([weight(attn + f"{proj}_proj.weight") for proj in "qkv"]), qkv_bias),
                o=projection(weight(attn + "o_proj.weight")),
                post_norm=take(prefix + "post_attention_layernorm.weight"),
                gate_up=projection(torch.cat([weight(mlp + "gate_proj.weight"), weight(mlp + "up_proj.weight")])),
                down=projection(weight(mlp + "down_proj.weight")),
            )
        )
    embed = take("model.embed_tokens.weight", torch.float32)  # the tied LM head's weight in full precision
    lm_head = optional("lm_head.weight", projection_dtype)
    if lm_head is None:
        if not config.tie_word_embeddings:
            raise ConfigError(f"{folder} has no lm_head.weight and its config does not tie embeddings")
        lm_head = embed
    return ModelWeights(
        embed=embed.to(dtype), layers=tuple(layers), final_norm=take("model.norm.weight"), lm_head=projection(lm_head)
    )
