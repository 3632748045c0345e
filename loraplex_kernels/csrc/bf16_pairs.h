// The bf16 pair panels' shared pieces (linear_dot.cpp on vdpbf16ps, linear_amx.cpp on AMX tiles): a panel row
// is kPanelWidth 32-bit lanes, each one column's weights at k = 2kp and 2kp + 1, and the activations are
// rounded to bf16 in the same pairs once per call.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "bf16.h"
#include "linear_panels.h"

namespace loraplex {

// Two bf16 values, k = 2kp in the low half (little-endian) and 2kp + 1 in the high half.
using Bf16Pair = uint32_t;

// K pairs a panel holds for in_features: whole AMX weight tiles (16 pairs, 32 k), zero past in_features.
constexpr int64_t kPairsMultiple = 16;
inline int64_t packed_pairs(int64_t in_features) {
  return (in_features + 2 * kPairsMultiple - 1) / (2 * kPairsMultiple) * kPairsMultiple;
}

// The checks of a call on pair panels (`op` names it in the errors).
inline void check_pair_panels(const char* op, const at::Tensor& x, const at::Tensor& packed,
                              const std::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.stride(1) == 1, op,
                    ": x must be a float32 CPU tensor [num_rows, in_features] with contiguous rows");
  TORCH_CHECK_VALUE(packed.dim() == 3 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                        packed.size(2) == 2 * kPanelWidth,
                    op, ": packed must come from pack_linear_pairs of this build (panels of ", kPanelWidth,
                    " columns in k pairs), got ", packed.sizes());
  TORCH_CHECK_VALUE(packed.size(1) == packed_pairs(x.size(1)), op, ": x has ", x.size(1),
                    " features, the weight takes ", 2 * packed.size(1) - 2 * kPairsMultiple + 1, " to ",
                    2 * packed.size(1));
  const int64_t panels = packed.size(0);
  TORCH_CHECK_VALUE(out_features > (panels - 1) * kPanelWidth && out_features <= panels * kPanelWidth, op,
                    ": out_features ", out_features, " does not match ", panels, " panels");
  check_bias_and_scales(op, bias, std::nullopt, false, out_features);
}

// dst[0:n] = src[0:n] rounded to bf16, ties to even. With AVX512-BF16, its conversion: 32 values an
// instruction, fp32 subnormals (below 1.2e-38) read as zero as the dot products read bf16 ones, NaN kept NaN;
// else round_bf16_bits, torch's bits.
inline void round_row(const float* src, uint16_t* dst, int64_t n) {
#if LORAPLEX_AVX512 && defined(__AVX512BF16__)
  constexpr int64_t kStep = 2 * kWideLanes;
  for (int64_t k = 0; k < n; k += kStep) {
    const int64_t left = std::min(kStep, n - k);
    const __mmask16 low = left >= kWideLanes ? 0xffff : (1u << left) - 1;
    const __mmask16 high = left > kWideLanes ? (1u << (left - kWideLanes)) - 1 : 0;
    const __m512bh pairs = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(high, src + k + kWideLanes),
                                               _mm512_maskz_loadu_ps(low, src + k));
    _mm512_mask_storeu_epi16(dst + k, static_cast<__mmask32>((uint64_t{1} << left) - 1), (__m512i)pairs);
  }
#else
#pragma omp simd
  for (int64_t k = 0; k < n; ++k) dst[k] = round_bf16_bits(src[k]);
#endif
}

// x [rows, K] fp32 rounded to bf16 (round_row) as `pairs` pairs a row, zero past K: [rows, pairs] int32.
inline at::Tensor round_to_pairs(const at::Tensor& x, int64_t pairs) {
  const int64_t rows = x.size(0), in_features = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows, pairs}, x.options().dtype(at::kInt));
  uint16_t* values = reinterpret_cast<uint16_t*>(out.data_ptr());  // [rows, 2 * pairs] bf16 bits
  const float* src = x.data_ptr<float>();
  at::parallel_for(0, rows, kRowsPerPass, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      uint16_t* dst = values + r * 2 * pairs;
      round_row(src + r * stride, dst, in_features);
      std::fill(dst + in_features, dst + 2 * pairs, uint16_t{0});
    }
  });
  return out;
}

}  // namespace loraplex
