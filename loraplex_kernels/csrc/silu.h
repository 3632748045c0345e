// SiLU(gate) * up over a row: silu_mul.cpp's op and the AMX GEMM's fused gate/up epilogue run this one
// loop, so the two give the same bits.
#pragma once

#include <cmath>
#include <cstdint>

#include "vec8.h"

namespace loraplex {

// out[0:width] = gate / (1 + e^-gate) * up, as torch's silu.
inline void silu_mul_row(const float* gate, const float* up, float* out, int64_t width) {
  const int64_t vec_end = width - width % kLanes;
  const F8 one = splat8(1.0f);
  for (int64_t i = 0; i < vec_end; i += kLanes) {
    const F8 g = load8(gate + i);
    const F8 silu = div8(g, add8(one, exp8(sub8(zero8(), g))));
    store8(out + i, mul8(silu, load8(up + i)));
  }
  for (int64_t i = vec_end; i < width; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

}  // namespace loraplex
