"""Rotary position embeddings: a cos/sin table computed once, gathered by position each step."""

import torch

from engine.config import ModelConfig
from engine.errors import ConfigError

# Rope types whose frequencies do not depend on the sequence length, so one table serves every request.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _rope_parameters(config: ModelConfig) -> dict:
    raw = config.raw
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def inverse_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Per-pair rotation frequencies [head_dim // 2] and the attention scaling the rope type asks for."""
    params = _rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type not in STATIC_ROPE_TYPES:
        raise ConfigError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(STATIC_ROPE_TYPES)}")
    if rope_type == "default":
        dim = config.head_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [head_dim // 2]
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = AutoConfig.for_model(**config.raw)
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RotaryEmbedding:
    """RoPE's tables as Hugging Face's Llama computes them (rotate-half layout, fp32 angles).

    ``rotate_half(x) * sin`` equals ``x`` with its halves swapped times ``sin`` with its first half
    negated, so the table keeps that signed sin; ``loraplex_kernels/layer_ops/rope_kv_write.py`` applies the rotation.
    """

    def __init__(self, config: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device):
        inv_freq, scaling = inverse_frequencies(config)
        positions = torch.arange(max_positions, dtype=torch.int64).float()  # [max_positions]
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2]
        cos, sin = freqs.cos() * scaling, freqs.sin() * scaling  # [max_positions, head_dim // 2] each
        self.cos = torch.cat([cos, cos], dim=-1).to(device=device, dtype=dtype)  # [max_positions, head_dim]
        self.signed_sin = torch.cat([-sin, sin], dim=-1).to(device=device, dtype=dtype)  # [max_positions, head_dim]

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin at each token's position, [num_tokens, head_dim] each: once per step."""
        return self.cos[positions], self.signed_sin[positions]  # [num_tokens, head_dim] each
