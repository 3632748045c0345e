// Dense projections on weights packed into column panels (semantics: loraplex_kernels/projection/linear_packed.py).
//
// The weight [N, K] is packed once into panels of kPanelWidth output columns, each stored k-major:
// packed[p][k][c] = weight[p * kPanelWidth + c][k], zero past N. A tile of kTileRows input rows and one
// panel keeps 3 x kTileRows vector accumulators in registers (24 on AVX-512: 8 rows x 48 columns); each
// step along k loads one panel row (three vectors), broadcasts one input value per row, and runs
// 3 x kTileRows FMAs, so no horizontal sums and no re-reading of the output. linear_packed_silu_mul runs a
// fused gate/up weight's panels in pairs and applies SiLU x up in scratch (panel_passes.h).
//
// Why not oneDNN's packed GEMM at decode sizes: it streams a panel's weights in from memory, then
// computes, one after the other, so a decode step pays for both in turn. Here a thread prefetches its next
// panel into L2 while it computes the current one, so the two overlap.
//
// At prefill sizes the tiles run a few percent behind oneDNN, and the same tiles serve every batch size:
// BLAS's batched GEMM on the same panels was no faster once its panels were copied into rows, and blocking
// k for L1 was slower (figures: docs/benchmarks.md#native-kernel-constants-and-choices).
//
// Each output is one fp32 FMA chain along k in order, whatever the number of rows: a row's result is the
// same bits alone or in any batch.
//
// Panels hold fp32, bf16 or int8 weights (the engine's weight formats). A bf16 or int8 panel row is widened
// to fp32 (a shift, or a sign extension and a convert) and the arithmetic is the fp32 tile's: the loads it
// saves are what decode steps are bound by. One tile of rows widens in registers as it loads; more rows
// widen the panel once into fp32 scratch that stays in L2 and share it (widening per tile measured slower
// at 64-256 rows, where the tiles are bound by arithmetic: docs/benchmarks.md). int8 panels carry one scale per output
// column, applied once to the finished sums (y = scale * sum_k x * q + bias). These k-major panels are the
// GEMM of bf16 and int8 weights on every build; linear_dot.cpp holds the other, on AVX512-BF16's dot
// products, which the engine times against this one at load (engine/modeling/bf16_gemm.py).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "linear_panels.h"
#include "ops.h"
#include "panel_passes.h"
#include "vec_wide.h"

namespace loraplex {
namespace {

// One panel row's kWideLanes weights from `p`, widened to fp32 (bf16: a zero-extend and a shift, bf16.h).
inline FW load_weights(const float* p) { return loadw(p); }
inline FW load_weights(const c10::BFloat16* p) { return loadw(p); }

#if LORAPLEX_AVX512
inline FW load_weights(const int8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes))};
}
#elif LORAPLEX_AVX2
inline FW load_weights(const int8_t* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes))};
}
#else
inline FW load_weights(const int8_t* p) {
  alignas(32) float widened[kWideLanes];
  for (int i = 0; i < kWideLanes; ++i) widened[i] = static_cast<float>(p[i]);
  return loadw(widened);
}
#endif

// A panel's weights of type W; P is the type of the packed panels the thread prefetches (W, or the packed
// type of a panel widened into fp32 scratch).
template <typename W, typename P = W>
struct Panel {
  const W* weights;       // [K, kPanelWidth]
  const float* bias;      // [kPanelWidth], zero past the real columns
  const float* scales;    // [kPanelWidth] for int8 panels, else nullptr
  const P* prefetch;      // the next panel this thread computes, or nullptr
  int64_t in_features;
  int64_t columns;  // real columns, <= kPanelWidth
};

// y[0:R, 0:columns] = x[0:R, :] @ panel + bias; x rows `x_stride` apart, y rows `y_stride` apart.
template <int R, typename W, typename P>
void tile(const float* x, int64_t x_stride, const Panel<W, P>& panel, float* y, int64_t y_stride,
          PrefetchCursor<P>& cursor) {
  PrefetchCursor<P> next = cursor;  // a local copy stays in registers through the loop
  FW acc[R][kPanelVectors];
  start_sums(acc, panel.bias, panel.scales);
  for (int64_t k = 0; k < panel.in_features; ++k) {
    const W* row = panel.weights + k * kPanelWidth;
    FW w[kPanelVectors];
    for (int j = 0; j < kPanelVectors; ++j) w[j] = load_weights(row + j * kWideLanes);
    next.step();
    for (int i = 0; i < R; ++i) {
      const FW a = splatw(x[i * x_stride + k]);
      for (int j = 0; j < kPanelVectors; ++j) acc[i][j] = fmaw(a, w[j], acc[i][j]);
    }
  }
  cursor = next;
  finish_sums(acc, panel.bias, panel.scales, panel.columns, y, y_stride);
}

template <int R, typename W, typename P>
void tail_tile(int rows, const float* x, int64_t x_stride, const Panel<W, P>& panel, float* y, int64_t y_stride,
               PrefetchCursor<P>& next) {
  if constexpr (R > 0) {
    if (rows == R) return tile<R>(x, x_stride, panel, y, y_stride, next);
    tail_tile<R - 1>(rows, x, x_stride, panel, y, y_stride, next);
  }
}

// Every row of the pass against one panel, prefetching the next panel meanwhile.
template <typename W, typename P>
void panel_rows(const float* x, int64_t x_stride, int64_t rows, const Panel<W, P>& panel, float* y, int64_t y_stride) {
  if constexpr (!std::is_same_v<W, float>) {
    if (rows > kTileRows) {  // several tiles: widen the panel once into fp32 scratch (L2) and share it
      thread_local std::vector<float> scratch;
      const int64_t elems = panel.in_features * kPanelWidth;
      if (static_cast<int64_t>(scratch.size()) < elems) scratch.resize(elems);
      for (int64_t i = 0; i < elems; i += kWideLanes) storew(scratch.data() + i, load_weights(panel.weights + i));
      const Panel<float, P> wide{scratch.data(), panel.bias, panel.scales, panel.prefetch, panel.in_features,
                                 panel.columns};
      return panel_rows(x, x_stride, rows, wide, y, y_stride);
    }
  }
  PrefetchCursor<P> next(panel.prefetch, panel.in_features, (rows + kTileRows - 1) / kTileRows);
  int64_t m = 0;
  for (; m + kTileRows <= rows; m += kTileRows) {
    tile<kTileRows>(x + m * x_stride, x_stride, panel, y + m * y_stride, y_stride, next);
  }
  if (m < rows) {
    tail_tile<kTileRows - 1>(static_cast<int>(rows - m), x + m * x_stride, x_stride, panel, y + m * y_stride,
                             y_stride, next);
  }
}


template <typename W>
void pack_panels(const W* src, W* dst, int64_t out_features, int64_t in_features, int64_t panels) {
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t columns = std::min<int64_t>(kPanelWidth, out_features - p * kPanelWidth);
      W* panel = dst + p * in_features * kPanelWidth;
      for (int64_t c = 0; c < columns; ++c) {
        const W* column = src + (p * kPanelWidth + c) * in_features;
        for (int64_t k = 0; k < in_features; ++k) panel[k * kPanelWidth + c] = column[k];
      }
    }
  });
}

// out = x @ the panels + bias (out [rows, out_features]), or with silu_intermediate > 0 the panels being a
// fused gate/up weight, out [rows, silu_intermediate] = SiLU(gate) x up (panel_passes.h).
template <typename W>
void run_panels(const at::Tensor& x, const at::Tensor& packed, const float* bias, int64_t bias_step,
                const float* scales, float* out, int64_t out_features, int64_t silu_intermediate) {
  const int64_t rows = x.size(0), in_features = x.size(1), panels = packed.size(0);
  const float* x_ptr = x.data_ptr<float>();
  const W* w_ptr = packed.data_ptr<W>();
  const int64_t x_stride = x.stride(0), panel_elems = in_features * kPanelWidth;
  auto compute = [&](int64_t p, int64_t next, int64_t pass_rows, int64_t first, float* y, int64_t y_stride) {
    const Panel<W> panel{w_ptr + p * panel_elems, bias + p * bias_step,
                         scales != nullptr ? scales + p * kPanelWidth : nullptr,
                         next >= 0 ? w_ptr + next * panel_elems : nullptr, in_features,
                         std::min<int64_t>(kPanelWidth, out_features - p * kPanelWidth)};
    panel_rows(x_ptr + first * x_stride, x_stride, pass_rows, panel, y, y_stride);
  };
  run_panel_passes(rows, panels, out_features, silu_intermediate, out, compute);
}

bool is_weight_format(at::ScalarType type) {
  return type == at::kFloat || type == at::kBFloat16 || type == at::kChar;
}

}  // namespace

int64_t linear_panel_width() { return kPanelWidth; }

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK_VALUE(weight.dim() == 2 && is_weight_format(weight.scalar_type()) && weight.device().is_cpu(),
                    "pack_linear_weight: weight must be a float32, bfloat16 or int8 CPU tensor "
                    "[out_features, in_features]");
  const at::Tensor w = weight.contiguous();
  const int64_t out_features = w.size(0), in_features = w.size(1);
  const int64_t panels = (out_features + kPanelWidth - 1) / kPanelWidth;
  at::Tensor packed = at::zeros({panels, in_features, kPanelWidth}, w.options());  // zero past out_features
  switch (w.scalar_type()) {
    case at::kBFloat16:
      pack_panels(w.data_ptr<c10::BFloat16>(), packed.data_ptr<c10::BFloat16>(), out_features, in_features, panels);
      break;
    case at::kChar:
      pack_panels(w.data_ptr<int8_t>(), packed.data_ptr<int8_t>(), out_features, in_features, panels);
      break;
    default:
      pack_panels(w.data_ptr<float>(), packed.data_ptr<float>(), out_features, in_features, panels);
  }
  return packed;
}

namespace {

void check_packed(const char* op, const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.stride(1) == 1, op,
                    ": x must be a float32 CPU tensor [num_rows, in_features] with contiguous rows");
  TORCH_CHECK_VALUE(packed.dim() == 3 && is_weight_format(packed.scalar_type()) && packed.is_contiguous() &&
                        packed.size(2) == kPanelWidth,
                    op, ": packed must come from pack_linear_weight of this build (panels of ", kPanelWidth,
                    " columns), got ", packed.sizes());
  const int64_t panels = packed.size(0);
  TORCH_CHECK_VALUE(packed.size(1) == x.size(1), op, ": x has ", x.size(1), " features, the weight takes ",
                    packed.size(1));
  TORCH_CHECK_VALUE(out_features > (panels - 1) * kPanelWidth && out_features <= panels * kPanelWidth, op,
                    ": out_features ", out_features, " does not match ", panels, " panels");
}

// out = the call's product on the weight's type (bias and scales padded to whole panels, so every tile reads
// kPanelWidth values); silu_intermediate as run_panels takes it.
void dispatch_panels(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                     const std::optional<at::Tensor>& scales, at::Tensor& out, int64_t out_features,
                     int64_t silu_intermediate) {
  const int64_t panels = packed.size(0);
  const PanelBias panel_biases = panel_bias(bias, panels, x);
  const at::Tensor scale_panels = pad_to_panels(scales, panels, x);
  const float* b_ptr = panel_biases.values;
  const int64_t b_step = panel_biases.stride;
  const float* s_ptr = packed.scalar_type() == at::kChar ? scale_panels.data_ptr<float>() : nullptr;
  float* out_ptr = out.data_ptr<float>();
  switch (packed.scalar_type()) {
    case at::kBFloat16:
      run_panels<c10::BFloat16>(x, packed, b_ptr, b_step, s_ptr, out_ptr, out_features, silu_intermediate);
      break;
    case at::kChar:
      run_panels<int8_t>(x, packed, b_ptr, b_step, s_ptr, out_ptr, out_features, silu_intermediate);
      break;
    default:
      run_panels<float>(x, packed, b_ptr, b_step, s_ptr, out_ptr, out_features, silu_intermediate);
  }
}

}  // namespace

at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                         int64_t out_features, const std::optional<at::Tensor>& scales) {
  check_packed("linear_packed", x, packed, out_features);
  check_bias_and_scales("linear_packed", bias, scales, packed.scalar_type() == at::kChar, out_features);
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());  // [num_rows, out_features]
  if (x.size(0) > 0) dispatch_panels(x, packed, bias, scales, y, out_features, 0);
  return y;
}

at::Tensor linear_packed_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t intermediate,
                                  const std::optional<at::Tensor>& scales) {
  TORCH_CHECK_VALUE(intermediate > 0 && intermediate % kPanelWidth == 0,
                    "linear_packed_silu_mul: intermediate must be a positive multiple of the panel width ",
                    kPanelWidth, ", got ", intermediate);
  check_packed("linear_packed_silu_mul", x, packed, 2 * intermediate);
  check_bias_and_scales("linear_packed_silu_mul", std::nullopt, scales, packed.scalar_type() == at::kChar,
                        2 * intermediate);
  at::Tensor act = at::empty({x.size(0), intermediate}, x.options());  // [num_rows, intermediate]
  if (x.size(0) > 0) dispatch_panels(x, packed, std::nullopt, scales, act, 2 * intermediate, intermediate);
  return act;
}

}  // namespace loraplex
