// RoPE on the fused qkv output, in place, and the K/V write into the page pool
// (semantics: loraplex_kernels/layer_ops/rope_kv_write.py::rope_kv_write). One pass per token: its q and k heads are
// rotated (Hugging Face's rotate-half layout) and its rotated k and its v rows copied to their slot, or
// rounded to bf16 (to nearest even) when the pool's K/V are bf16.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include "bf16.h"
#include "ops.h"

namespace loraplex {
namespace {

// Tokens per parallel chunk: a decode step's 64 tokens take about what waking the second thread costs,
// so only prefill-sized steps are split (docs/benchmarks.md).
constexpr int64_t kMinTokensPerTask = 128;

// x[i] = x[i] * cos[i] + x[(i + D/2) % D] * signed_sin[i]  (signed_sin = [-sin, sin], cos = [cos, cos])
inline void rotate_head(float* __restrict x, const float* __restrict cos, const float* __restrict signed_sin,
                        int64_t head_dim) {
  const int64_t half = head_dim / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] + b * signed_sin[i];
    x[i + half] = b * cos[i + half] + a * signed_sin[i + half];
  }
}

void check_table(const at::Tensor& t, const char* name, int64_t num_tokens, int64_t head_dim) {
  TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == num_tokens && t.size(1) == head_dim && t.is_contiguous() &&
                        t.scalar_type() == at::kFloat && t.device().is_cpu(),
                    "rope_kv_write: ", name, " must be a contiguous float32 CPU tensor [", num_tokens, ", ",
                    head_dim, "]");
}

// Rotates every token's q and k heads and writes its k and v rows into the pool of element type KV.
template <typename KV>
void rotate_and_write(float* qkv_ptr, int64_t qkv_stride, const float* cos_ptr, const float* sin_ptr, KV* pool,
                      const int64_t* rows, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                      int64_t head_dim, int64_t block_size, int64_t layer_offset) {
  const int64_t kv_width = num_kv_heads * head_dim;
  at::parallel_for(0, num_tokens, kMinTokensPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* row = qkv_ptr + t * qkv_stride;  // q heads, k heads, v heads
      const float* c = cos_ptr + t * head_dim;
      const float* s = sin_ptr + t * head_dim;
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) rotate_head(row + h * head_dim, c, s, head_dim);
      KV* k_dst = pool + (rows[t] + layer_offset) * kv_width;
      store_row(k_dst, row + num_heads * head_dim, kv_width);
      store_row(k_dst + block_size * kv_width, row + (num_heads + num_kv_heads) * head_dim, kv_width);
    }
  });
}

}  // namespace

void rope_kv_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& signed_sin,
                   const at::Tensor& storage, int64_t layer, const at::Tensor& kv_rows, int64_t num_heads,
                   int64_t num_kv_heads) {
  TORCH_CHECK_VALUE(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.device().is_cpu() &&
                        qkv.stride(1) == 1,
                    "rope_kv_write: qkv must be a float32 CPU tensor [num_tokens, (heads + 2 kv_heads) * head_dim] "
                    "with contiguous rows");
  const int64_t num_tokens = qkv.size(0);
  const int64_t num_all_heads = num_heads + 2 * num_kv_heads;
  TORCH_CHECK_VALUE(num_heads > 0 && num_kv_heads > 0 && qkv.size(1) % num_all_heads == 0,
                    "rope_kv_write: qkv width ", qkv.size(1), " is not (", num_heads, " + 2 x ", num_kv_heads,
                    ") heads");
  const int64_t head_dim = qkv.size(1) / num_all_heads;
  TORCH_CHECK_VALUE(head_dim % 2 == 0, "rope_kv_write: head_dim must be even, got ", head_dim);
  check_table(cos, "cos", num_tokens, head_dim);
  check_table(signed_sin, "signed_sin", num_tokens, head_dim);
  const bool bf16_pool = storage.scalar_type() == at::kBFloat16;
  TORCH_CHECK_VALUE(storage.dim() == 3 && storage.is_contiguous() &&
                        (bf16_pool || storage.scalar_type() == at::kFloat) && storage.device().is_cpu(),
                    "rope_kv_write: storage must be the contiguous float32 or bfloat16 CPU pool "
                    "[num_pages, num_layers, P]");
  const int64_t kv_width = num_kv_heads * head_dim;  // elements of one token's K (or V) in a page
  TORCH_CHECK_VALUE(storage.size(2) % (2 * kv_width) == 0, "rope_kv_write: page size ", storage.size(2),
                    " is not block_size x 2 x ", kv_width);
  const int64_t block_size = storage.size(2) / (2 * kv_width);
  TORCH_CHECK_VALUE(layer >= 0 && layer < storage.size(1), "rope_kv_write: layer ", layer, " is not in [0, ",
                    storage.size(1), ")");
  TORCH_CHECK_VALUE(kv_rows.dim() == 1 && kv_rows.size(0) == num_tokens && kv_rows.scalar_type() == at::kLong &&
                        kv_rows.is_contiguous() && kv_rows.device().is_cpu(),
                    "rope_kv_write: kv_rows must be a contiguous int64 CPU vector of ", num_tokens, " entries");
  const int64_t* rows = kv_rows.data_ptr<int64_t>();
  const int64_t layer_offset = layer * 2 * block_size;  // rows from a token's layer-0 K to its layer's K
  const int64_t num_rows = storage.numel() / kv_width;
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK_VALUE(rows[t] >= 0 && rows[t] + layer_offset + block_size < num_rows, "rope_kv_write: kv_rows[", t,
                      "] = ", rows[t], " is outside the pool");
  }

  float* qkv_ptr = qkv.data_ptr<float>();
  const float* cos_ptr = cos.data_ptr<float>();
  const float* sin_ptr = signed_sin.data_ptr<float>();
  if (bf16_pool) {
    rotate_and_write(qkv_ptr, qkv.stride(0), cos_ptr, sin_ptr, storage.data_ptr<c10::BFloat16>(), rows, num_tokens,
                     num_heads, num_kv_heads, head_dim, block_size, layer_offset);
  } else {
    rotate_and_write(qkv_ptr, qkv.stride(0), cos_ptr, sin_ptr, storage.data_ptr<float>(), rows, num_tokens,
                     num_heads, num_kv_heads, head_dim, block_size, layer_offset);
  }
}

}  // namespace loraplex
