// The widest fp32 vector the compiler targets, for loops that walk a contiguous dimension (head_dim,
// in_dim, out columns): sixteen lanes with AVX-512, else the eight-lane F8 of vec8.h itself.
//
// Kernels keep their eight-lane structure (eight keys a block, eight-lane masks and exponentials) and
// widen only the loops along a row: `for (d = 0; d + kWideLanes <= dim; d += kWideLanes)` on FW, then
// the rest eight lanes at a time on F8 (nothing is left on AVX2, where FW is F8). `fold8` turns a wide
// accumulator into an eight-lane one with the same total, so a reduction can finish on F8.
//
// Measured on a 2-core Xeon with AVX-512 (two 512-bit FMA ports): oneDNN's GEMMs reach twice the AVX2
// rate there, so the native ops' eight-lane loops had become over a quarter of a LoRA step's operator time.
#pragma once

#include "vec8.h"

#if LORAPLEX_AVX2 && defined(__AVX512F__)
#define LORAPLEX_AVX512 1
#else
#define LORAPLEX_AVX512 0
#endif

namespace loraplex {

#if LORAPLEX_AVX512

constexpr int kWideLanes = 16;

struct FW {
  __m512 v;
};

inline FW loadw(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void storew(float* p, FW a) { _mm512_storeu_ps(p, a.v); }
inline FW splatw(float x) { return {_mm512_set1_ps(x)}; }
inline FW zerow() { return {_mm512_setzero_ps()}; }
inline FW addw(FW a, FW b) { return {_mm512_add_ps(a.v, b.v)}; }
inline FW mulw(FW a, FW b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline FW fmaw(FW a, FW b, FW c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c
inline F8 fold8(FW a) {  // low eight lanes + high eight lanes (AVX512F alone: the upper half as 4 doubles)
  return {_mm256_add_ps(_mm512_castps512_ps256(a.v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)))};
}
// See pin8: holds `a` in a register so several FMAs share one load.
inline void pinw(FW& a) { asm volatile("" : "+v"(a.v)); }

#else

constexpr int kWideLanes = kLanes;
using FW = F8;

inline FW loadw(const float* p) { return load8(p); }
inline void storew(float* p, FW a) { store8(p, a); }
inline FW splatw(float x) { return splat8(x); }
inline FW zerow() { return zero8(); }
inline FW addw(FW a, FW b) { return add8(a, b); }
inline FW mulw(FW a, FW b) { return mul8(a, b); }
inline FW fmaw(FW a, FW b, FW c) { return fma8(a, b, c); }
inline F8 fold8(FW a) { return a; }
inline void pinw(FW& a) { pin8(a); }

#endif

// The same few operations by vector type, for loops written once for FW and for an F8 tail.
template <typename Vec>
struct VecOps;

template <>
struct VecOps<F8> {
  static constexpr int kCount = kLanes;
  static F8 load(const float* p) { return load8(p); }
  static void store(float* p, F8 a) { store8(p, a); }
  static F8 splat(float x) { return splat8(x); }
  static F8 fma(F8 a, F8 b, F8 c) { return fma8(a, b, c); }
  static void pin(F8& a) { pin8(a); }
};

#if LORAPLEX_AVX512
template <>
struct VecOps<FW> {
  static constexpr int kCount = kWideLanes;
  static FW load(const float* p) { return loadw(p); }
  static void store(float* p, FW a) { storew(p, a); }
  static FW splat(float x) { return splatw(x); }
  static FW fma(FW a, FW b, FW c) { return fmaw(a, b, c); }
  static void pin(FW& a) { pinw(a); }
};
#endif

// dst[0:n] = src[0:n], n a multiple of kLanes.
inline void copy_floats(float* dst, const float* src, int64_t n) {
  int64_t d = 0;
  for (; d + kWideLanes <= n; d += kWideLanes) storew(dst + d, loadw(src + d));
  for (; d < n; d += kLanes) store8(dst + d, load8(src + d));
}

// dst[0:n] = src[0:n] * factor, n a multiple of kLanes.
inline void scale_copy(float* dst, const float* src, float factor, int64_t n) {
  int64_t d = 0;
  const FW fw = splatw(factor);
  for (; d + kWideLanes <= n; d += kWideLanes) storew(dst + d, mulw(loadw(src + d), fw));
  const F8 f8 = splat8(factor);
  for (; d < n; d += kLanes) store8(dst + d, mul8(load8(src + d), f8));
}

}  // namespace loraplex
