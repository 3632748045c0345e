// Dense projections on bf16 weights with AVX512-BF16's dot product (semantics:
// loraplex_kernels/projection/linear_dot.py); the second panel format of bf16 weights beside linear_packed.cpp's
// k-major panels (int8 weights have linear_vnni.cpp's).
//
// The weight [N, K] is packed once into panels of kPanelWidth output columns with k in pairs:
// packed[p][kp][2c + j] = weight[p * kPanelWidth + c][2kp + j], zero past N and past K (the pairs run to a
// multiple of 16, whole AMX tiles: linear_amx.cpp reads the same panels). Each 32-bit lane of
// a bf16 panel row holds one column's weights at k = 2kp and 2kp + 1, the operand layout of vdpbf16ps; the
// activations are rounded to bf16 (ties to even) once per call, in the same pairs. One instruction then
// does two k-steps for sixteen columns: acc += x[2kp] * w[2kp] + x[2kp + 1] * w[2kp + 1], the products
// exact in fp32 (bf16 mantissas are 8 bits) and the sums fp32.
//
// The tile is the k-major tile's shape: kTileRows rows x three panel vectors, 24 independent accumulators.
// That is more chains than the instruction's latency x issue rate anywhere it is known: on the 2-core
// Xeon (Sapphire Rapids generation) it takes ~8 cycles and issues one every ~2, so four chains saturate
// it; AMD Zen 4 is reported at 6 cycles and two ymm (one zmm) a cycle, 12 ymm or 6 zmm chains. There the
// tile is bound by the instruction's throughput: on the Xeon 15 bf16 products a cycle against the fp32
// FMAs' 32, so it takes longer than the widened panels from 8 rows on; where it issues as fast as the FMAs
// it does twice their products (figures: docs/precision.md).
//
// Each output is one chain along k in order, whatever the number of rows: a row's result is the same bits
// alone or in any batch. Only an AVX-512 build with AVX512-BF16 (-march of a CPU that has it) compiles the
// tile; elsewhere linear_dot_available() is false and the engine keeps the k-major panels.
// linear_dot_silu_mul runs a fused gate/up weight's panels in pairs with SiLU x up in scratch (panel_passes.h).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bf16_pairs.h"
#include "linear_panels.h"
#include "ops.h"
#include "panel_passes.h"
#include "vec_wide.h"

#if LORAPLEX_AVX512 && defined(__AVX512BF16__)
#define LORAPLEX_BF16_DOT 1
#else
#define LORAPLEX_BF16_DOT 0
#endif

namespace loraplex {
namespace {

constexpr int kPairRowValues = 2 * kPanelWidth;  // one panel row of k pairs: two values a column

void pack_pairs(const c10::BFloat16* src, c10::BFloat16* dst, int64_t out_features, int64_t in_features,
                int64_t panels, int64_t pairs) {
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t columns = std::min<int64_t>(kPanelWidth, out_features - p * kPanelWidth);
      c10::BFloat16* panel = dst + p * pairs * kPairRowValues;
      for (int64_t c = 0; c < columns; ++c) {
        const c10::BFloat16* column = src + (p * kPanelWidth + c) * in_features;
        for (int64_t k = 0; k < in_features; ++k) panel[(k / 2) * kPairRowValues + 2 * c + k % 2] = column[k];
      }
    }
  });
}

#if LORAPLEX_BF16_DOT

struct PairPanel {
  const Bf16Pair* weights;   // [pairs, kPanelWidth]
  const float* bias;         // [kPanelWidth], zero past the real columns
  const Bf16Pair* prefetch;  // the next panel this thread computes, or nullptr
  int64_t pairs;
  int64_t columns;  // real columns, <= kPanelWidth
};

// y[0:R, 0:columns] = x[0:R] @ panel + bias; x rows of bf16 pairs `x_stride` pairs apart.
template <int R>
void dot_tile(const Bf16Pair* x, int64_t x_stride, const PairPanel& panel, float* y, int64_t y_stride,
              PrefetchCursor<Bf16Pair>& cursor) {
  PrefetchCursor<Bf16Pair> next = cursor;  // a local copy stays in registers through the loop
  FW acc[R][kPanelVectors];
  start_sums(acc, panel.bias, nullptr);
  for (int64_t kp = 0; kp < panel.pairs; ++kp) {
    const Bf16Pair* row = panel.weights + kp * kPanelWidth;
    __m512bh w[kPanelVectors];
    for (int j = 0; j < kPanelVectors; ++j) w[j] = (__m512bh)_mm512_loadu_si512(row + j * kWideLanes);
    next.step();
    for (int i = 0; i < R; ++i) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[i * x_stride + kp]));
      for (int j = 0; j < kPanelVectors; ++j) acc[i][j].v = _mm512_dpbf16_ps(acc[i][j].v, a, w[j]);
    }
  }
  cursor = next;
  finish_sums(acc, panel.bias, nullptr, panel.columns, y, y_stride);
}

template <int R>
void dot_tail_tile(int rows, const Bf16Pair* x, int64_t x_stride, const PairPanel& panel, float* y,
                   int64_t y_stride, PrefetchCursor<Bf16Pair>& next) {
  if constexpr (R > 0) {
    if (rows == R) return dot_tile<R>(x, x_stride, panel, y, y_stride, next);
    dot_tail_tile<R - 1>(rows, x, x_stride, panel, y, y_stride, next);
  }
}

// Every row of the pass against one pair panel, prefetching the next panel meanwhile.
void dot_panel_rows(const Bf16Pair* x, int64_t x_stride, int64_t rows, const PairPanel& panel, float* y,
                    int64_t y_stride) {
  PrefetchCursor<Bf16Pair> next(panel.prefetch, panel.pairs, (rows + kTileRows - 1) / kTileRows);
  int64_t m = 0;
  for (; m + kTileRows <= rows; m += kTileRows) {
    dot_tile<kTileRows>(x + m * x_stride, x_stride, panel, y + m * y_stride, y_stride, next);
  }
  if (m < rows) {
    dot_tail_tile<kTileRows - 1>(static_cast<int>(rows - m), x + m * x_stride, x_stride, panel, y + m * y_stride,
                                 y_stride, next);
  }
}

// out = x @ the panels + bias, or SiLU(gate) x up of a fused gate/up weight (silu_intermediate > 0), as
// linear_packed.cpp's run_panels.
void run_pair_panels(const at::Tensor& x, const at::Tensor& packed, const float* bias, int64_t bias_step,
                     float* out, int64_t out_features, int64_t silu_intermediate) {
  const int64_t rows = x.size(0), panels = packed.size(0), pairs = packed.size(1);
  const at::Tensor x_rounded = round_to_pairs(x, pairs);  // [rows, pairs]
  const Bf16Pair* x_pairs = reinterpret_cast<const Bf16Pair*>(x_rounded.data_ptr());
  const Bf16Pair* w_ptr = reinterpret_cast<const Bf16Pair*>(packed.data_ptr());
  const int64_t panel_lanes = pairs * kPanelWidth;
  auto compute = [&](int64_t p, int64_t next, int64_t pass_rows, int64_t first, float* y, int64_t y_stride) {
    const PairPanel panel{w_ptr + p * panel_lanes, bias + p * bias_step,
                          next >= 0 ? w_ptr + next * panel_lanes : nullptr, pairs,
                          std::min<int64_t>(kPanelWidth, out_features - p * kPanelWidth)};
    dot_panel_rows(x_pairs + first * pairs, pairs, pass_rows, panel, y, y_stride);
  };
  run_panel_passes(rows, panels, out_features, silu_intermediate, out, compute);
}

#endif  // LORAPLEX_BF16_DOT

}  // namespace

bool linear_dot_available() {
#if LORAPLEX_BF16_DOT
  static const bool available = __builtin_cpu_supports("avx512bf16");
  return available;
#else
  return false;
#endif
}

at::Tensor pack_linear_pairs(const at::Tensor& weight) {
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu(),
                    "pack_linear_pairs: weight must be a bfloat16 CPU tensor [out_features, in_features]");
  const at::Tensor w = weight.contiguous();
  const int64_t out_features = w.size(0), in_features = w.size(1);
  const int64_t panels = (out_features + kPanelWidth - 1) / kPanelWidth, pairs = packed_pairs(in_features);
  at::Tensor packed = at::zeros({panels, pairs, kPairRowValues}, w.options());  // zero past N and K
  pack_pairs(w.data_ptr<c10::BFloat16>(), packed.data_ptr<c10::BFloat16>(), out_features, in_features, panels,
             pairs);
  return packed;
}

namespace {

void check_dot(const char* op) {
  TORCH_CHECK_VALUE(linear_dot_available(), op,
                    ": the native kernels have no AVX512-BF16 dot products here (the CPU lacks avx512_bf16, or "
                    "the library is built for another target); use the k-major panels of pack_linear_weight");
}

}  // namespace

at::Tensor linear_dot(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                      int64_t out_features) {
  check_dot("linear_dot");
  check_pair_panels("linear_dot", x, packed, bias, out_features);
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());  // [num_rows, out_features]
  if (x.size(0) == 0) return y;
#if LORAPLEX_BF16_DOT
  const PanelBias panel_biases = panel_bias(bias, packed.size(0), x);  // every tile reads kPanelWidth values
  run_pair_panels(x, packed, panel_biases.values, panel_biases.stride, y.data_ptr<float>(), out_features, 0);
#endif
  return y;
}

at::Tensor linear_dot_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t intermediate) {
  check_dot("linear_dot_silu_mul");
  TORCH_CHECK_VALUE(intermediate > 0 && intermediate % kPanelWidth == 0,
                    "linear_dot_silu_mul: intermediate must be a positive multiple of the panel width ", kPanelWidth,
                    ", got ", intermediate);
  check_pair_panels("linear_dot_silu_mul", x, packed, std::nullopt, 2 * intermediate);
  at::Tensor act = at::empty({x.size(0), intermediate}, x.options());  // [num_rows, intermediate]
  if (x.size(0) == 0) return act;
#if LORAPLEX_BF16_DOT
  const PanelBias no_bias = panel_bias(std::nullopt, packed.size(0), x);
  run_pair_panels(x, packed, no_bias.values, no_bias.stride, act.data_ptr<float>(), 2 * intermediate, intermediate);
#endif
  return act;
}

}  // namespace loraplex
