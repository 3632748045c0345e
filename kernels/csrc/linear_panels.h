// What the two panel GEMMs share (linear_packed.cpp: k-major panels of fp32, bf16 or int8 weights;
// linear_dot.cpp: bf16 or int8 weights with k in pairs on AVX512-BF16's dot products): the panel and tile
// sizes, how threads share the panels, the prefetch of a thread's next panel, a tile's first and last
// touches of its sums, and the checks of a call's bias and scales.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>
#include <xmmintrin.h>

#include "vec_wide.h"

namespace loraplex {

constexpr int kPanelVectors = 3;
constexpr int kPanelWidth = kPanelVectors * kWideLanes;  // 48 on AVX-512, 24 on AVX2
// Rows a tile: accumulators + three panel vectors + one broadcast fill the register file (32 zmm, 16 ymm).
constexpr int kTileRows = LORAPLEX_AVX512 ? 8 : 4;
// Rows a pass over the panels: the pass's inputs (128 x K floats) stay in L2 while each thread walks its
// panels (measured: 1,024 rows in one pass ran ~5 % slower than in passes of 128).
constexpr int64_t kRowsPerPass = 128;
constexpr int kLineBytes = 64;

// One thread's share of a call's panels, [begin, end): its owner runs them from the front, and a thread
// that has run out of its own takes them from the back. `taken` counts both (front: low half, back: high
// half), so each panel is taken once.
struct alignas(64) PanelShare {
  int64_t begin = 0, end = 0;
  std::atomic<uint64_t> taken{0};

  // The next panel from the front (`front`) or the back, or -1 when none is left.
  int64_t take(bool front) {
    uint64_t seen = taken.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t from_front = static_cast<int64_t>(seen & 0xffffffffu), from_back = static_cast<int64_t>(seen >> 32);
      if (begin + from_front + from_back >= end) return -1;
      const uint64_t after = seen + (front ? uint64_t{1} : uint64_t{1} << 32);
      if (taken.compare_exchange_weak(seen, after, std::memory_order_relaxed)) {
        return front ? begin + from_front : end - 1 - from_back;
      }
    }
  }
};

// run_panel(p, next) for every panel p in [0, panels) on the library's threads, `next` being the panel the
// thread is likely to run after p (-1 if none), for its prefetch. Each thread owns an equal, contiguous share
// and runs it in order; one that finishes early takes the others' remaining panels from their back ends.
// On a machine whose every core runs the engine, another process's wake-up preempts one of its threads:
// with fixed shares the whole call waited for that thread's; now it holds back one panel. An output
// column is still one thread's one FMA chain, so the results are the same bits whoever runs it.
template <typename F>
void for_each_panel(int64_t panels, const F& run_panel) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), panels);
  std::vector<PanelShare> shares(static_cast<size_t>(threads));
  for (int64_t t = 0; t < threads; ++t) {
    shares[t].begin = panels * t / threads;
    shares[t].end = panels * (t + 1) / threads;
  }
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    PanelShare& mine = shares[omp_get_thread_num()];
    for (int64_t p = mine.take(true); p >= 0; p = mine.take(true)) run_panel(p, p + 1 < mine.end ? p + 1 : -1);
    for (int64_t step = 1; step < threads; ++step) {
      PanelShare& other = shares[(omp_get_thread_num() + step) % threads];
      for (int64_t p = other.take(false); p >= 0; p = other.take(false)) run_panel(p, p > other.begin ? p - 1 : -1);
    }
  }
}

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

// `values` [out_features] fp32 padded with zeros to whole panels, or an empty tensor when absent.
inline at::Tensor pad_to_panels(const std::optional<at::Tensor>& values, int64_t panels, const at::Tensor& like) {
  if (!values.has_value()) return at::Tensor();
  at::Tensor padded = at::zeros({panels * kPanelWidth}, like.options());
  padded.narrow(0, 0, values->size(0)).copy_(*values);
  return padded;
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
