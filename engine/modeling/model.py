"""Our forward pass of a Llama-family model over the paged pool (Llama, Qwen2, Mistral).

A decoder layer is nine ops (and the adapters' ``lora.apply`` after each projection): add + norm, the
q/k/v projection, RoPE + K/V write, paged attention, the o projection, add + norm, the gate/up
projection, SiLU·mul (one pass with the gate/up projection where its GEMM fuses them and no adapter of
the step targets gate/up), the down projection. The residual stream is one tensor updated in place; each
layer's last output is added at the start of the next. Each glue op runs the kernel backend the engine
resolved (the native C++ ops on CPU, or torch's).
"""

import torch

from engine.config import ModelConfig
from engine.memory.page_pool import PagePool
from engine.modeling.rope import RotaryEmbedding
from engine.modeling.weights import LayerWeights, ModelWeights
from engine.step.step_batch import StepBatch
from loraplex_kernels.attention.paged_attention import paged_attention
from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.layer_ops.add_rms_norm import add_rms_norm
from loraplex_kernels.layer_ops.kv_write import kv_row_index
from loraplex_kernels.layer_ops.rope_kv_write import rope_kv_write
from loraplex_kernels.layer_ops.silu_mul import silu_mul
from loraplex_kernels.projection.linear import linear, linear_silu_mul


class LlamaModel:
    """Embedding, decoder layers writing their K/V into the pool, final norm and LM head."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, max_positions: int, backend: KernelBackend) -> None:
        self.config = config
        self.weights = weights
        self.backend = backend
        self.rope = RotaryEmbedding(config, max_positions, weights.embed.dtype, weights.embed.device)
        self.scale = config.head_dim**-0.5
        self._q_size = config.num_heads * config.head_dim

    @torch.inference_mode()
    def forward(self, batch: StepBatch, pool: PagePool) -> torch.Tensor:
        """Logits of ``batch.logits_indices`` (sampled rows, then prompt rows to score): [num_rows, vocab] fp32."""
        x = self.weights.embed[batch.input_ids]  # [num_tokens, hidden], the residual stream
        kv_rows = kv_row_index(batch.slot_mapping, len(self.weights.layers), pool.block_size)  # [num_tokens]
        rope = self.rope.tables(batch.positions)  # cos and signed sin: [num_tokens, head_dim] each
        pending = None  # the last layer's output, not yet added to x
        for index, layer in enumerate(self.weights.layers):
            pending = self._layer(x, pending, layer, index, pool, kv_rows, rope, batch)
        rows = batch.logits_indices
        h = add_rms_norm(
            x[rows], pending[rows], self.weights.final_norm, self.config.rms_norm_eps, self.backend
        )  # [num_rows, hidden]
        return linear(h, self.weights.lm_head).float()  # [num_rows, vocab]

    def _layer(
        self,
        x: torch.Tensor,
        pending: torch.Tensor | None,
        w: LayerWeights,
        index: int,
        pool: PagePool,
        kv_rows: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: StepBatch,
    ) -> torch.Tensor:
        """Adds ``pending`` and this layer's attention output into ``x`` in place; returns its MLP output."""
        cfg = self.config
        backend = self.backend
        num_tokens = x.shape[0]
        h = add_rms_norm(x, pending, w.input_norm, cfg.rms_norm_eps, backend)  # [num_tokens, hidden]
        qkv = linear(h, w.qkv)  # [num_tokens, (heads + 2 * kv_heads) * head_dim]
        lora = batch.lora
        if lora is not None:
            lora.apply("qkv", h, qkv, index, pool.storage)
        rope_kv_write(qkv, *rope, pool.storage, index, kv_rows, cfg.num_heads, cfg.num_kv_heads, backend)
        q = qkv[:, : self._q_size].view(num_tokens, cfg.num_heads, cfg.head_dim)  # [num_tokens, heads, D], strided
        attn = paged_attention(q, pool.kv_layer(index), batch.attention, self.scale, backend)  # [num_tokens, heads, D]
        attn = attn.view(num_tokens, self._q_size)  # [num_tokens, heads * head_dim]
        o = linear(attn, w.o)  # [num_tokens, hidden]
        if lora is not None:
            lora.apply("o", attn, o, index, pool.storage)
        h = add_rms_norm(x, o, w.post_norm, cfg.rms_norm_eps, backend)  # [num_tokens, hidden]
        if lora is not None and lora.targets("gate_up"):
            gate_up = linear(h, w.gate_up)  # [num_tokens, 2 * intermediate]
            lora.apply("gate_up", h, gate_up, index, pool.storage)
            act = silu_mul(gate_up, backend)  # [num_tokens, intermediate]
        else:
            act = linear_silu_mul(h, w.gate_up, backend)  # [num_tokens, intermediate]
        down = linear(act, w.down)  # [num_tokens, hidden]
        if lora is not None:
            lora.apply("down", act, down, index, pool.storage)
        return down
