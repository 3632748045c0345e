// bf16 rows of the page pool (K/V, and adapters in bf16 mode): widened to fp32 where they are read (bf16 is
// fp32's high half, so widening is a zero-extend and a shift, exact) and rounded to nearest even where they
// are written.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "vec_wide.h"

namespace loraplex {

// Eight bf16 values widened to fp32 lanes (the same call as load8 on fp32 values).
inline F8 load8(const c10::BFloat16* p) {
#if LORAPLEX_AVX2
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16))};
#else
  F8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = static_cast<float>(p[i]);
  return r;
#endif
}

// kWideLanes bf16 values widened to fp32 lanes (the same call as loadw on fp32 values).
inline FW loadw(const c10::BFloat16* p) {
#if LORAPLEX_AVX512
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16))};
#else
  return load8(p);
#endif
}

// One element as fp32, for the last few of a row.
inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }

// Vec::kCount lanes (Vec is F8 or FW) from fp32 elements, or from bf16 elements widened: loops written once
// over the pool's element type T.
template <typename Vec, typename T>
Vec load_lanes(const T* p) {
  if constexpr (std::is_same_v<Vec, F8>) {
    return load8(p);
  } else {
    return loadw(p);
  }
}

// dst[0:n] = src[0:n] widened to fp32, n a multiple of kLanes.
inline void load_row(float* dst, const c10::BFloat16* src, int64_t n) {
  int64_t d = 0;
  for (; d + kWideLanes <= n; d += kWideLanes) storew(dst + d, loadw(src + d));
  for (; d < n; d += kLanes) store8(dst + d, load8(src + d));
}

// dst[0:n] = src[0:n] for fp32 rows, n a multiple of kLanes (the same call as the bf16 widening).
inline void load_row(float* dst, const float* src, int64_t n) { copy_floats(dst, src, n); }

// One fp32 rounded to the nearest bf16, ties to even; a NaN stays a (quiet) NaN. The same bits as
// torch's float -> bfloat16 conversion.
inline uint16_t round_bf16_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint32_t is_nan = (bits & 0x7fffffffu) > 0x7f800000u;
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(is_nan ? 0x7fc0u : rounded);
}

// dst[0:n] = src[0:n] rounded to bf16 (ties to even).
inline void store_row(c10::BFloat16* dst, const float* src, int64_t n) {
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = round_bf16_bits(src[i]);
}

// dst[0:n] = src[0:n] for an fp32 pool.
inline void store_row(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

}  // namespace loraplex
