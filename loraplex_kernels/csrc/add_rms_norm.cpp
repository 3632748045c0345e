// Fused residual add + RMSNorm (semantics: loraplex_kernels/layer_ops/add_rms_norm.py::add_rms_norm): one pass over
// each row adds the residual in place and sums squares, a second writes the normalised row.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cmath>

#include "ops.h"
#include "vec8.h"

namespace loraplex {
namespace {

// Elements per parallel chunk. A decode step's rows (64 x 576) take about what waking the second thread
// costs on one core, and on a busy host a woken thread can wait milliseconds for its core; so only
// prefill-sized steps are split (docs/benchmarks.md).
constexpr int64_t kMinElemsPerTask = 65536;

void norm_row(float* x, const float* residual, const float* weight, float* out, int64_t hidden, float eps) {
  const int64_t vec_end = hidden - hidden % kLanes;
  F8 squares = zero8();
  for (int64_t i = 0; i < vec_end; i += kLanes) {
    F8 v = load8(x + i);
    if (residual != nullptr) {
      v = add8(v, load8(residual + i));
      store8(x + i, v);
    }
    squares = fma8(v, v, squares);
  }
  float sum = hsum8(squares);
  for (int64_t i = vec_end; i < hidden; ++i) {
    if (residual != nullptr) x[i] += residual[i];
    sum += x[i] * x[i];
  }
  // As Hugging Face's Llama: x * rsqrt(mean(x^2) + eps), then times the weight.
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(hidden) + eps);
  const F8 inv8 = splat8(inv);
  for (int64_t i = 0; i < vec_end; i += kLanes) {
    store8(out + i, mul8(load8(weight + i), mul8(load8(x + i), inv8)));
  }
  for (int64_t i = vec_end; i < hidden; ++i) out[i] = weight[i] * (x[i] * inv);
}

}  // namespace

at::Tensor add_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& weight,
                        double eps) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.is_contiguous(),
                    "add_rms_norm: x must be a contiguous float32 CPU tensor [num_tokens, hidden]");
  const int64_t num_tokens = x.size(0), hidden = x.size(1);
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == hidden && weight.scalar_type() == at::kFloat &&
                        weight.is_contiguous() && weight.device().is_cpu(),
                    "add_rms_norm: weight must be a contiguous float32 CPU vector of ", hidden, " entries");
  const float* residual_ptr = nullptr;
  if (residual.has_value()) {
    const at::Tensor& r = *residual;
    TORCH_CHECK_VALUE(r.sizes() == x.sizes() && r.scalar_type() == at::kFloat && r.is_contiguous() &&
                          r.device().is_cpu(),
                      "add_rms_norm: residual must be a contiguous float32 CPU tensor shaped like x");
    TORCH_CHECK_VALUE(x.numel() == 0 || r.data_ptr<float>() != x.data_ptr<float>(),
                      "add_rms_norm: residual must not be x itself");
    residual_ptr = r.data_ptr<float>();
  }
  at::Tensor out = at::empty({num_tokens, hidden}, x.options());  // [num_tokens, hidden]
  float* x_ptr = x.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  const float* w_ptr = weight.data_ptr<float>();
  const float eps_f = static_cast<float>(eps);
  const int64_t grain = std::max<int64_t>(1, kMinElemsPerTask / std::max<int64_t>(hidden, 1));
  at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      norm_row(x_ptr + t * hidden, residual_ptr ? residual_ptr + t * hidden : nullptr, w_ptr, out_ptr + t * hidden,
               hidden, eps_f);
    }
  });
  return out;
}

}  // namespace loraplex
