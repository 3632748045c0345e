// How the panel GEMMs (linear_packed.cpp, linear_dot.cpp) walk their panels: passes of kRowsPerPass rows,
// each pass's panels shared by the threads, every panel written to its columns of the output; or, for the
// gated MLP's fused gate/up weight (gate's `intermediate` columns, then up's), gate's panel j and up's
// panel j computed side by side into the thread's scratch and turned into SiLU(gate) x up there, so the
// [rows, 2 x intermediate] product never reaches memory nor a second op.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "linear_panels.h"
#include "silu.h"

namespace loraplex {

// compute(p, next, rows, first, out, out_stride): panel p against rows [first, first + rows) of the input,
// sums to out (rows out_stride floats apart); `next` is the panel the thread computes after it (to
// prefetch), or -1.
//
// y [rows, out_features] = every panel's columns.
template <typename Compute>
void run_panels_into(int64_t rows, int64_t panels, int64_t out_features, float* y, Compute&& compute) {
  for (int64_t first = 0; first < rows; first += kRowsPerPass) {
    const int64_t pass_rows = std::min(kRowsPerPass, rows - first);
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        compute(p, p + 1 < end ? p + 1 : -1, pass_rows, first, y + first * out_features + p * kPanelWidth,
                out_features);
      }
    });
  }
}

// act [rows, intermediate] = SiLU(gate) x up, gate's panels the first intermediate / kPanelWidth (a whole
// number) and up's the next as many.
template <typename Compute>
void run_gate_up_silu(int64_t rows, int64_t intermediate, float* act, Compute&& compute) {
  constexpr int64_t kPairWidth = 2 * kPanelWidth;  // a scratch row: gate's panel columns, then up's
  const int64_t gate_panels = intermediate / kPanelWidth;
  for (int64_t first = 0; first < rows; first += kRowsPerPass) {
    const int64_t pass_rows = std::min(kRowsPerPass, rows - first);
    at::parallel_for(0, gate_panels, 1, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> sums;  // [kRowsPerPass, kPairWidth]
      sums.resize(kRowsPerPass * kPairWidth);
      for (int64_t j = begin; j < end; ++j) {
        compute(j, gate_panels + j, pass_rows, first, sums.data(), kPairWidth);
        compute(gate_panels + j, j + 1 < end ? j + 1 : -1, pass_rows, first, sums.data() + kPanelWidth, kPairWidth);
        for (int64_t r = 0; r < pass_rows; ++r) {
          const float* row = sums.data() + r * kPairWidth;
          silu_mul_row(row, row + kPanelWidth, act + (first + r) * intermediate + j * kPanelWidth, kPanelWidth);
        }
      }
    });
  }
}

// out = every panel's columns (silu_intermediate 0), or SiLU(gate) x up of a fused gate/up weight whose
// intermediate size is silu_intermediate: the one walk both panel GEMMs take.
template <typename Compute>
void run_panel_passes(int64_t rows, int64_t panels, int64_t out_features, int64_t silu_intermediate, float* out,
                      Compute&& compute) {
  if (silu_intermediate > 0) {
    run_gate_up_silu(rows, silu_intermediate, out, compute);
  } else {
    run_panels_into(rows, panels, out_features, out, compute);
  }
}

}  // namespace loraplex
