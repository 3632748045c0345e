"""Our forward pass of a Llama-family model over the paged pool (Llama, Qwen2, Mistral)."""

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.page_pool import PagePool
from engine.rope import RotaryEmbedding
from engine.step_batch import StepBatch
from engine.weights import LayerWeights, ModelWeights
from kernels.kv_write import kv_row_index, write_kv
from kernels.linear import linear
from kernels.paged_attention import paged_attention


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, as Hugging Face's Llama does."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # [num_tokens, hidden]
    return weight * x32.to(x.dtype)  # [num_tokens, hidden]


class LlamaModel:
    """Embedding, decoder layers writing their K/V into the pool, final norm and LM head."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, max_positions: int) -> None:
        self.config = config
        self.weights = weights
        self.rope = RotaryEmbedding(config, max_positions, weights.embed.dtype, weights.embed.device)
        self.scale = config.head_dim**-0.5
        self._q_size = config.num_heads * config.head_dim
        self._kv_size = config.num_kv_heads * config.head_dim

    @torch.inference_mode()
    def forward(self, batch: StepBatch, pool: PagePool) -> torch.Tensor:
        """Logits of ``batch.logits_indices`` (sampled rows, then prompt rows to score): [num_rows, vocab] fp32."""
        x = self.weights.embed[batch.input_ids]  # [num_tokens, hidden]
        kv_rows = kv_row_index(batch.slot_mapping, len(self.weights.layers), pool.block_size)  # [num_tokens]
        rope = self.rope.tables(batch.positions)  # cos and signed sin: [num_tokens, 1, head_dim] each
        for index, layer in enumerate(self.weights.layers):
            x = self._layer(x, layer, index, pool, kv_rows, rope, batch)
        x = x[batch.logits_indices]  # [num_rows, hidden]
        x = rms_norm(x, self.weights.final_norm, self.config.rms_norm_eps)
        return linear(x, self.weights.lm_head).float()  # [num_rows, vocab]

    def _layer(
        self,
        x: torch.Tensor,
        w: LayerWeights,
        index: int,
        pool: PagePool,
        kv_rows: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: StepBatch,
    ) -> torch.Tensor:
        cfg = self.config
        num_tokens = x.shape[0]
        h = rms_norm(x, w.input_norm, cfg.rms_norm_eps)  # [num_tokens, hidden]
        qkv = linear(h, w.qkv)  # [num_tokens, (heads + 2 * kv_heads) * head_dim]
        lora = batch.lora
        if lora is not None:
            lora.apply("qkv", h, qkv, index, pool.storage)
        qk, v = qkv.split([self._q_size + self._kv_size, self._kv_size], dim=-1)
        qk = qk.view(num_tokens, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)  # [num_tokens, heads + kv_heads, D]
        q, k = self.rope.rotate(qk, *rope).split([cfg.num_heads, cfg.num_kv_heads], dim=1)  # q, then k heads
        v = v.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)  # [num_tokens, kv_heads, head_dim]
        write_kv(pool.storage, index, k, v, kv_rows)
        kv_cache = pool.kv_layer(index)  # [num_pages, 2, block_size, kv_heads, head_dim]
        attn = paged_attention(q.contiguous(), kv_cache, batch.attention, self.scale)  # [num_tokens, heads, D]
        attn = attn.view(num_tokens, self._q_size)  # [num_tokens, heads * head_dim]
        o = linear(attn, w.o)  # [num_tokens, hidden]
        if lora is not None:
            lora.apply("o", attn, o, index, pool.storage)
        x = x + o  # [num_tokens, hidden]
        h = rms_norm(x, w.post_norm, cfg.rms_norm_eps)  # [num_tokens, hidden]
        gate_up = linear(h, w.gate_up)  # [num_tokens, 2 * intermediate]
        if lora is not None:
            lora.apply("gate_up", h, gate_up, index, pool.storage)
        gate, up = gate_up.chunk(2, dim=-1)  # 2 x [num_tokens, intermediate]
        act = F.silu(gate).mul_(up)  # [num_tokens, intermediate]
        down = linear(act, w.down)  # [num_tokens, hidden]
        if lora is not None:
            lora.apply("down", act, down, index, pool.storage)
        return x + down  # [num_tokens, hidden]
