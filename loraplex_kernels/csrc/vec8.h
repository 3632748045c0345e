// Eight fp32 lanes: AVX2 + FMA intrinsics when the compiler targets them, plain loops otherwise.
//
// The kernels are written once against these few functions. The fallback loops have fixed trip counts,
// so at -O3 they still compile to vector code on other targets; only the AVX2 path was measured.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LORAPLEX_AVX2 1
#else
#define LORAPLEX_AVX2 0
#endif

namespace loraplex {

constexpr int kLanes = 8;
// Below this, exp2 flushes to zero: 2^-126 is the smallest normal float.
constexpr float kExp2Min = -126.0f;
// Above this, exp2 saturates at 2^127 (finite), so silu's 1 + exp(-x) never becomes inf / inf.
constexpr float kExp2Max = 127.0f;
// The same bounds for e^x: e^-87 is above the smallest normal float, e^88 below the largest.
constexpr float kExpMin = -87.0f;
constexpr float kExpMax = 88.0f;

#if LORAPLEX_AVX2

struct F8 {
  __m256 v;
};

inline F8 load8(const float* p) { return {_mm256_loadu_ps(p)}; }
inline void store8(float* p, F8 a) { _mm256_storeu_ps(p, a.v); }
inline F8 splat8(float x) { return {_mm256_set1_ps(x)}; }
inline F8 zero8() { return {_mm256_setzero_ps()}; }
inline F8 add8(F8 a, F8 b) { return {_mm256_add_ps(a.v, b.v)}; }
inline F8 sub8(F8 a, F8 b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline F8 mul8(F8 a, F8 b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline F8 div8(F8 a, F8 b) { return {_mm256_div_ps(a.v, b.v)}; }
inline F8 max8(F8 a, F8 b) { return {_mm256_max_ps(a.v, b.v)}; }
inline F8 fma8(F8 a, F8 b, F8 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c

inline float hsum8(F8 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));  // 4 lanes
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));  // 2 lanes
  s = _mm_add_ss(s, _mm_movehdup_ps(s));  // 1 lane
  return _mm_cvtss_f32(s);
}

inline float hmax8(F8 a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));  // 4 lanes
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));  // 2 lanes
  s = _mm_max_ss(s, _mm_movehdup_ps(s));  // 1 lane
  return _mm_cvtss_f32(s);
}

// Lane n of the result is the sum of a[n]'s eight lanes: eight dot products finished at once.
inline F8 transpose_sum8(const F8 (&a)[8]) {
  __m256 t0 = _mm256_hadd_ps(a[0].v, a[1].v);
  __m256 t1 = _mm256_hadd_ps(a[2].v, a[3].v);
  __m256 t2 = _mm256_hadd_ps(a[4].v, a[5].v);
  __m256 t3 = _mm256_hadd_ps(a[6].v, a[7].v);
  __m256 u0 = _mm256_hadd_ps(t0, t1);  // low half: sums of a0..a3's low halves; high half: their high halves
  __m256 u1 = _mm256_hadd_ps(t2, t3);  // the same for a4..a7
  __m256 lo = _mm256_permute2f128_ps(u0, u1, 0x20);
  __m256 hi = _mm256_permute2f128_ps(u0, u1, 0x31);
  return {_mm256_add_ps(lo, hi)};
}

// Makes the compiler hold `a` in a register from here on: GCC folds a load used by several FMAs into
// each of them (one load per FMA), which starves the load ports of a register-tiled product.
inline void pin8(F8& a) { asm volatile("" : "+x"(a.v)); }

// Lanes whose n-th bit of `live` is clear become `fill`.
inline F8 keep_lanes8(F8 a, int live, float fill) {
  const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  __m256i on = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(live), bits), bits);
  return {_mm256_blendv_ps(_mm256_set1_ps(fill), a.v, _mm256_castsi256_ps(on))};
}

// e^y for |y| <= ln2 / 2 by Taylor to y^7 (error < 5e-9), Horner with FMA.
inline __m256 exp_taylor7(__m256 y) {
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.0f));
  return _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.0f));
}

// 2^n for integral n in [-126, 127], built from the exponent bits.
inline __m256 pow2i(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}

// 2^x, relative error < 2e-7: 2^round(x) times e^((x - round(x)) ln2).
// Lanes below kExp2Min (and -inf) give 0.
inline F8 exp2_8(F8 x) {
  __m256 in_range = _mm256_cmp_ps(x.v, _mm256_set1_ps(kExp2Min), _CMP_GE_OQ);
  __m256 xc = _mm256_min_ps(_mm256_max_ps(x.v, _mm256_set1_ps(kExp2Min)), _mm256_set1_ps(kExp2Max));
  __m256 n = _mm256_round_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 y = _mm256_mul_ps(_mm256_sub_ps(xc, n), _mm256_set1_ps(0.69314718055994531f));  // |y| <= ln2 / 2
  return {_mm256_and_ps(_mm256_mul_ps(exp_taylor7(y), pow2i(n)), in_range)};
}

// e^x, about 1 ulp: n = round(x / ln2), r = x - n ln2 in two parts (Cody-Waite), e^r by Taylor to r^7.
// Saturates at e^88 (finite) and gives 0 below e^-87.
inline F8 exp8(F8 x) {
  __m256 in_range = _mm256_cmp_ps(x.v, _mm256_set1_ps(kExpMin), _CMP_GE_OQ);
  __m256 xc = _mm256_min_ps(_mm256_max_ps(x.v, _mm256_set1_ps(kExpMin)), _mm256_set1_ps(kExpMax));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  return {_mm256_and_ps(_mm256_mul_ps(exp_taylor7(r), pow2i(n)), in_range)};
}

#else  // portable fallback: the same operations lane by lane

struct F8 {
  float v[8];
};

inline F8 load8(const float* p) {
  F8 r;
  std::memcpy(r.v, p, sizeof r.v);
  return r;
}
inline void store8(float* p, F8 a) { std::memcpy(p, a.v, sizeof a.v); }
inline F8 splat8(float x) {
  F8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = x;
  return r;
}
inline F8 zero8() { return splat8(0.0f); }
#define LORAPLEX_LANEWISE(name, expr)          \
  inline F8 name(F8 a, F8 b) {                 \
    F8 r;                                      \
    for (int i = 0; i < 8; ++i) r.v[i] = expr; \
    return r;                                  \
  }
LORAPLEX_LANEWISE(add8, a.v[i] + b.v[i])
LORAPLEX_LANEWISE(sub8, a.v[i] - b.v[i])
LORAPLEX_LANEWISE(mul8, a.v[i] * b.v[i])
LORAPLEX_LANEWISE(div8, a.v[i] / b.v[i])
LORAPLEX_LANEWISE(max8, a.v[i] > b.v[i] ? a.v[i] : b.v[i])
#undef LORAPLEX_LANEWISE
inline F8 fma8(F8 a, F8 b, F8 c) {
  F8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return r;
}
inline float hsum8(F8 a) {
  float s = 0.0f;
  for (float x : a.v) s += x;
  return s;
}
inline float hmax8(F8 a) {
  float m = a.v[0];
  for (float x : a.v) m = x > m ? x : m;
  return m;
}
inline F8 transpose_sum8(const F8 (&a)[8]) {
  F8 r;
  for (int n = 0; n < 8; ++n) r.v[n] = hsum8(a[n]);
  return r;
}
inline void pin8(F8&) {}
inline F8 keep_lanes8(F8 a, int live, float fill) {
  for (int i = 0; i < 8; ++i) a.v[i] = (live >> i) & 1 ? a.v[i] : fill;
  return a;
}
inline F8 exp2_8(F8 x) {
  F8 r;
  for (int i = 0; i < 8; ++i) {
    r.v[i] = x.v[i] < kExp2Min ? 0.0f : std::exp2(x.v[i] > kExp2Max ? kExp2Max : x.v[i]);
  }
  return r;
}
inline F8 exp8(F8 x) {
  F8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = x.v[i] < kExpMin ? 0.0f : std::exp(x.v[i] > kExpMax ? kExpMax : x.v[i]);
  return r;
}

#endif

}  // namespace loraplex
