// The native CPU ops, fp32 (the projections' weights also bf16 or int8, the pool's K/V also bf16). Each is defined in its own file and registered in registration.cpp as
// torch.ops.loraplex.<name>; the Python functions in loraplex_kernels/ hold each op's Semantics docstring.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

namespace loraplex {

// out[T, H, D]: causal attention of each query row over its sequence's fp32 or bf16 pages
// (loraplex_kernels/attention/paged_attention.py).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale);

// x += residual (in place, when given); returns rmsnorm(x) * weight (loraplex_kernels/layer_ops/add_rms_norm.py).
at::Tensor add_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& weight,
                        double eps);

// Rotates qkv's q and k heads in place and writes k and v into their pool rows
// (loraplex_kernels/layer_ops/rope_kv_write.py).
void rope_kv_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& signed_sin,
                   const at::Tensor& storage, int64_t layer, const at::Tensor& kv_rows, int64_t num_heads,
                   int64_t num_kv_heads);

// silu(gate) * up from gate_up [T, 2I] (loraplex_kernels/layer_ops/silu_mul.py).
at::Tensor silu_mul(const at::Tensor& gate_up);

// y += (x @ A^T) @ B^T per item of a module group's adapter rows, read in place from the fp32 or bf16 pool
// (loraplex_kernels/sgmv/sgmv_fused_native.py).
void sgmv_fused(const at::Tensor& x, const at::Tensor& storage, int64_t layer_offset, const at::Tensor& token_ids,
                const at::Tensor& item_starts, const at::Tensor& row_start_a, const at::Tensor& row_start_b,
                const at::Tensor& ranks, const at::Tensor& row_addr, const at::Tensor& out_dims,
                const at::Tensor& out_offsets, const at::Tensor& y);

// Columns of one weight panel in this build's packed layout (48 on AVX-512, 24 on AVX2).
int64_t linear_panel_width();

// weight [N, K] (fp32, bf16 or int8) packed into panels of linear_panel_width() columns, k-major
// (loraplex_kernels/projection/linear_packed.py).
at::Tensor pack_linear_weight(const at::Tensor& weight);

// x @ weight^T + bias on a weight from pack_linear_weight; int8 panels take per-column scales
// (loraplex_kernels/projection/linear_packed.py).
at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                         int64_t out_features, const std::optional<at::Tensor>& scales);

// silu(x @ gate^T) * (x @ up^T) on the fused gate_up weight from pack_linear_weight; int8 panels take
// per-column scales (loraplex_kernels/projection/linear_packed.py).
at::Tensor linear_packed_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t intermediate,
                                  const std::optional<at::Tensor>& scales);

// Whether this build runs the AVX512-BF16 dot-product panels here (linear_dot.cpp; loraplex_kernels/projection/linear_dot.py).
bool linear_dot_available();

// weight [N, K] bf16 packed into panels of linear_panel_width() columns, k in pairs
// (loraplex_kernels/projection/linear_dot.py).
at::Tensor pack_linear_pairs(const at::Tensor& weight);

// bf16(x) @ weight^T + bias on a weight from pack_linear_pairs, on vdpbf16ps (loraplex_kernels/projection/linear_dot.py).
at::Tensor linear_dot(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                      int64_t out_features);

// silu(bf16(x) @ gate^T) * (bf16(x) @ up^T) on the fused gate_up weight from pack_linear_pairs, on vdpbf16ps
// (loraplex_kernels/projection/linear_dot.py).
at::Tensor linear_dot_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t intermediate);

// Whether this build runs AMX tiles on the pair panels here (linear_amx.cpp; loraplex_kernels/projection/linear_dot.py).
bool linear_amx_available();

// bf16(x) @ weight^T + bias on a weight from pack_linear_pairs, on AMX tiles (loraplex_kernels/projection/linear_dot.py).
at::Tensor linear_amx(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                      int64_t out_features);

// silu(bf16(x) @ gate^T) * (bf16(x) @ up^T) on the fused gate_up weight from pack_linear_pairs, on AMX tiles
// (loraplex_kernels/projection/linear_dot.py).
at::Tensor linear_amx_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t intermediate);

// Whether this build runs the AVX512-VNNI int8 panels here (linear_vnni.cpp; loraplex_kernels/projection/linear_vnni.py).
bool linear_vnni_available();

// weight [N, K] int8 packed into panels of linear_panel_width() columns, k in quads, and each panel's
// block offsets (loraplex_kernels/projection/linear_vnni.py).
std::vector<at::Tensor> pack_linear_quads(const at::Tensor& weight);

// x @ (scales * weight)^T + bias on the activations quantized to int8 per row and block of 32, on vpdpbusd
// (loraplex_kernels/projection/linear_vnni.py).
at::Tensor linear_vnni(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& offsets,
                       const std::optional<at::Tensor>& bias, int64_t out_features, const at::Tensor& scales);

// The index of each row's first maximum (a NaN wins), as torch.argmax(dim=-1) (loraplex_kernels/layer_ops/argmax_rows.py).
at::Tensor argmax_rows(const at::Tensor& logits);

}  // namespace loraplex
