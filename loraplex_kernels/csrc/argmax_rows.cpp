// The index of each row's largest value, as torch.argmax(dim=-1) (semantics:
// loraplex_kernels/layer_ops/argmax_rows.py).
//
// Greedy decoding reads one row of logits per sequence: 64 rows x 49,152 fp32 (12.6 MB) a decode step
// of the default model, which torch's reduction reads far below the memory's speed (figures:
// docs/benchmarks.md). Here each row is one vector pass for its maximum and a second, in L2 by then, for
// the first index that holds it (ties: the first, as torch), and rows are shared among the threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cmath>

#include "ops.h"
#include "vec_wide.h"

namespace loraplex {
namespace {

// Rows per parallel chunk: a few rows of the default model's vocabulary outweigh waking another thread.
constexpr int64_t kMinRowsPerTask = 8;

// The row's maximum, or NaN when it holds one (a NaN wins, as in torch).
float row_max(const float* row, int64_t width) {
  float best = -INFINITY;
  int64_t d = 0;
#if LORAPLEX_AVX512
  __m512 wide = _mm512_set1_ps(-INFINITY);
  __mmask16 unordered = 0;  // lanes that met a NaN
  for (; d + 16 <= width; d += 16) {
    const __m512 v = _mm512_loadu_ps(row + d);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    wide = _mm512_max_ps(wide, v);
  }
  if (unordered != 0) return NAN;
  best = _mm512_reduce_max_ps(wide);
#elif LORAPLEX_AVX2
  __m256 wide = _mm256_set1_ps(-INFINITY);
  __m256 unordered = _mm256_setzero_ps();
  for (; d + 8 <= width; d += 8) {
    const __m256 v = _mm256_loadu_ps(row + d);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    wide = _mm256_max_ps(wide, v);
  }
  if (_mm256_movemask_ps(unordered) != 0) return NAN;
  best = hmax8({wide});
#endif
  for (; d < width; ++d) {
    if (std::isnan(row[d])) return NAN;
    best = row[d] > best ? row[d] : best;
  }
  return best;
}

// The first index whose value is `target` (NaN: the first NaN); the row holds it.
int64_t first_index_of(const float* row, int64_t width, float target) {
  if (std::isnan(target)) {
    for (int64_t i = 0; i < width; ++i) {
      if (std::isnan(row[i])) return i;
    }
    return 0;
  }
  int64_t d = 0;
#if LORAPLEX_AVX512
  const __m512 t = _mm512_set1_ps(target);
  for (; d + 16 <= width; d += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + d), t, _CMP_EQ_OQ);
    if (hit != 0) return d + __builtin_ctz(hit);
  }
#elif LORAPLEX_AVX2
  const __m256 t = _mm256_set1_ps(target);
  for (; d + 8 <= width; d += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + d), t, _CMP_EQ_OQ));
    if (hit != 0) return d + __builtin_ctz(hit);
  }
#endif
  for (; d < width; ++d) {
    if (row[d] == target) return d;
  }
  return 0;
}

}  // namespace

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK_VALUE(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.device().is_cpu() &&
                        logits.stride(1) == 1 && logits.size(1) > 0,
                    "argmax_rows: logits must be a float32 CPU tensor [num_rows, width > 0] with contiguous rows");
  const int64_t num_rows = logits.size(0), width = logits.size(1), stride = logits.stride(0);
  at::Tensor out = at::empty({num_rows}, logits.options().dtype(at::kLong));  // [num_rows]
  const float* in_ptr = logits.data_ptr<float>();
  int64_t* out_ptr = out.data_ptr<int64_t>();
  at::parallel_for(0, num_rows, kMinRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = in_ptr + r * stride;
      out_ptr[r] = first_index_of(row, width, row_max(row, width));
    }
  });
  return out;
}

}  // namespace loraplex
