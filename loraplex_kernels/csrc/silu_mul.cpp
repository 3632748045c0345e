// SiLU(gate) * up from the fused gate_up projection (semantics: loraplex_kernels/layer_ops/silu_mul.py::silu_mul).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>

#include "ops.h"
#include "silu.h"

namespace loraplex {
namespace {

// Elements per parallel chunk: enough exp and divide on one core to outweigh waking the second thread.
constexpr int64_t kMinElemsPerTask = 32768;

}  // namespace

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK_VALUE(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.scalar_type() == at::kFloat &&
                        gate_up.device().is_cpu() && gate_up.stride(1) == 1,
                    "silu_mul: gate_up must be a float32 CPU tensor [num_tokens, 2 * intermediate] with "
                    "contiguous rows");
  const int64_t num_tokens = gate_up.size(0), width = gate_up.size(1) / 2;
  at::Tensor out = at::empty({num_tokens, width}, gate_up.options());  // [num_tokens, intermediate]
  const float* in_ptr = gate_up.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t row_stride = gate_up.stride(0);
  const int64_t grain = std::max<int64_t>(1, kMinElemsPerTask / std::max<int64_t>(width, 1));
  at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = in_ptr + t * row_stride;
      silu_mul_row(row, row + width, out_ptr + t * width, width);
    }
  });
  return out;
}

}  // namespace loraplex
