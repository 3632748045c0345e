// What the panel GEMMs share (linear_packed.cpp: k-major panels of fp32, bf16 or int8 weights;
// linear_dot.cpp: bf16 weights with k in pairs on AVX512-BF16's dot products; linear_vnni.cpp: int8 weights
// with k in quads on AVX512-VNNI's): the panel and tile sizes, the prefetch of a thread's next panel, a
// tile's first and last touches of its sums, and the checks of a call's bias and scales.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>
#include <xmmintrin.h>

#include "vec_wide.h"

namespace loraplex {

constexpr int kPanelVectors = 3;
constexpr int kPanelWidth = kPanelVectors * kWideLanes;  // 48 on AVX-512, 24 on AVX2
// Rows a tile: accumulators + three panel vectors + one broadcast fill the register file (32 zmm, 16 ymm).
constexpr int kTileRows = LORAPLEX_AVX512 ? 8 : 4;
// Rows a pass over the panels: the pass's inputs (128 x K floats) stay in L2 while each thread walks its
// panels (1,024 rows in one pass measured slower: docs/benchmarks.md).
constexpr int64_t kRowsPerPass = 128;
constexpr int kLineBytes = 64;

// Walks the next panel's cache lines into L2 spread evenly over this panel's k-steps (all its tiles):
// a core keeps only so many misses in flight (its fill buffers), so a burst of prefetches in one tile
// stalls the arithmetic, where one line every few steps hides under it. A k-step of the next panel is
// kPanelWidth values of W (a pair panel's: kPanelWidth lanes holding two values each).
template <typename W>
class PrefetchCursor {
 public:
  PrefetchCursor(const W* next, int64_t steps, int64_t num_tiles)
      : line_(reinterpret_cast<const char*>(next)),
        end_(next == nullptr ? line_ : line_ + steps * kStepBytes),
        bytes_per_line_(kLineBytes * num_tiles) {}

  // One k-step's share of the next panel: one panel row's bytes over the tiles, carried over as credit.
  void step() {
    credit_ += kStepBytes;
    while (credit_ >= bytes_per_line_ && line_ < end_) {
      _mm_prefetch(line_, _MM_HINT_T1);
      line_ += kLineBytes;
      credit_ -= bytes_per_line_;
    }
  }

 private:
  static constexpr int64_t kStepBytes = kPanelWidth * sizeof(W);  // a panel row
  const char* line_;
  const char* end_;
  int64_t bytes_per_line_;  // credit a line costs: the panel's k-steps are num_tiles times its rows
  int64_t credit_ = 0;
};

// A tile's sums before its first k-step: the panel's bias, or zero for int8 panels (whose bias is added
// after their scale, in finish_sums).
template <int R>
inline void start_sums(FW (&acc)[R][kPanelVectors], const float* bias, const float* scales) {
  for (int j = 0; j < kPanelVectors; ++j) {
    const FW b = scales == nullptr ? loadw(bias + j * kWideLanes) : zerow();
    for (int i = 0; i < R; ++i) acc[i][j] = b;
  }
}

// y[0:R, 0:columns] = the finished sums (int8 panels: sum * scale + bias), rows `y_stride` apart; a panel
// of fewer than kPanelWidth real columns goes through a spill so nothing is written past them.
template <int R>
inline void finish_sums(FW (&acc)[R][kPanelVectors], const float* bias, const float* scales, int64_t columns,
                        float* y, int64_t y_stride) {
  if (scales != nullptr) {
    for (int j = 0; j < kPanelVectors; ++j) {
      const FW scale = loadw(scales + j * kWideLanes), b = loadw(bias + j * kWideLanes);
      for (int i = 0; i < R; ++i) acc[i][j] = fmaw(acc[i][j], scale, b);
    }
  }
  if (columns == kPanelWidth) {
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < kPanelVectors; ++j) storew(y + i * y_stride + j * kWideLanes, acc[i][j]);
    return;
  }
  alignas(64) float spill[kPanelWidth];
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < kPanelVectors; ++j) storew(spill + j * kWideLanes, acc[i][j]);
    std::memcpy(y + i * y_stride, spill, columns * sizeof(float));
  }
}

// `values` [out_features] fp32 padded with zeros to whole panels (itself when it fills them), or an empty
// tensor when absent.
inline at::Tensor pad_to_panels(const std::optional<at::Tensor>& values, int64_t panels, const at::Tensor& like) {
  if (!values.has_value()) return at::Tensor();
  if (values->size(0) == panels * kPanelWidth && values->is_contiguous()) return *values;
  at::Tensor padded = at::zeros({panels * kPanelWidth}, like.options());
  padded.narrow(0, 0, values->size(0)).copy_(*values);
  return padded;
}

// A call's bias as the tiles read it: padded to whole panels (a panel's bias `stride` floats after the
// last), or, without a bias, one panel of zeros that every panel reads (a stride of 0). `padded` owns the
// padded copy while the call runs.
struct PanelBias {
  at::Tensor padded;
  const float* values;
  int64_t stride;
};

inline PanelBias panel_bias(const std::optional<at::Tensor>& bias, int64_t panels, const at::Tensor& like) {
  alignas(64) static const float kNoBias[kPanelWidth] = {};
  if (!bias.has_value()) return {at::Tensor(), kNoBias, 0};
  at::Tensor padded = pad_to_panels(bias, panels, like);
  const float* values = padded.data_ptr<float>();
  return {std::move(padded), values, kPanelWidth};
}

// The checks a call's bias and scales pass, whichever panels it runs on (`op` names it in the errors).
inline void check_bias_and_scales(const char* op, const std::optional<at::Tensor>& bias,
                                  const std::optional<at::Tensor>& scales, bool int8, int64_t out_features) {
  TORCH_CHECK_VALUE(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == out_features &&
                                           bias->scalar_type() == at::kFloat && bias->device().is_cpu()),
                    op, ": bias must be a float32 CPU tensor [out_features]");
  TORCH_CHECK_VALUE(int8 == scales.has_value(), op, ": scales are given with int8 panels and only then");
  TORCH_CHECK_VALUE(!scales.has_value() || (scales->dim() == 1 && scales->size(0) == out_features &&
                                             scales->scalar_type() == at::kFloat && scales->device().is_cpu()),
                    op, ": scales must be a float32 CPU tensor [out_features]");
}

}  // namespace loraplex
