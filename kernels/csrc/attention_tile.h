// The paged attention's path for many query vectors per kv head (prefill tiles): sixteen keys at a time
// as two small matrix products with register tiles. Scores: S[m, 0:16] = Q[m] . K^T for four query
// vectors at once over K transposed in scratch (each load of K^T feeds eight FMAs, no horizontal sums);
// weights: S[m] -> exp2(S[m] - max) after the online-softmax update; values: acc[m, d:d+16] +=
// P[m, n] V[n, d:d+16] for four vectors, the accumulators held in registers across the sixteen keys.
// Compute-bound: the K/V block is in L1 and serves up to kTileQueries (128) query vectors.
#pragma once

#include <type_traits>

#include "attention_common.h"

namespace loraplex::attention {

struct TilePath {
  static constexpr int kKeys = 2 * kLanes;
  static constexpr int kVectorsPerTile = 4;  // 4 x 2 accumulators + 2 loads + 1 broadcast: 11 of AVX2's 16 registers

  // keys_t[d * 16 + n] = K[n][d] of one kv head
  template <int kHeadDim>
  static void gather_transposed(const float* const* rows, int64_t offset, float* keys_t, int head_dim) {
    const int dim = kHeadDim ? kHeadDim : head_dim;
    for (int n = 0; n < kKeys; ++n) {
      const float* src = rows[n] + offset;
      for (int d = 0; d < dim; ++d) keys_t[d * kKeys + n] = src[d];
    }
  }

  template <int kHeadDim>
  static void gather(const float* const* rows, int64_t offset, float* dst, int head_dim) {
    const int dim = kHeadDim ? kHeadDim : head_dim;
    for (int n = 0; n < kKeys; ++n) {
      const float* src = rows[n] + offset;
      for (int d = 0; d < dim; d += kLanes) store8(dst + n * dim + d, load8(src + d));
    }
  }

  // scores[i, 0:16] = q[i] . K^T for kCount consecutive query vectors
  template <int kHeadDim, int kCount>
  static void score(const float* q, const float* keys_t, float* scores, int head_dim) {
    const int dim = kHeadDim ? kHeadDim : head_dim;
    F8 acc[kCount][2];
    for (auto& pair : acc) pair[0] = pair[1] = zero8();
    for (int d = 0; d < dim; ++d) {
      F8 k0 = load8(keys_t + d * kKeys), k1 = load8(keys_t + d * kKeys + kLanes);
      pin8(k0);
      pin8(k1);
      for (int i = 0; i < kCount; ++i) {
        const F8 qd = splat8(q[i * dim + d]);
        acc[i][0] = fma8(qd, k0, acc[i][0]);
        acc[i][1] = fma8(qd, k1, acc[i][1]);
      }
    }
    for (int i = 0; i < kCount; ++i) {
      store8(scores + i * kKeys, acc[i][0]);
      store8(scores + i * kKeys + kLanes, acc[i][1]);
    }
  }

  // acc[i] += sum_n p[i, n] * values[n] for kCount consecutive query vectors
  template <int kHeadDim, int kCount>
  static void accumulate(const float* p, const float* values, float* acc, int head_dim) {
    const int dim = kHeadDim ? kHeadDim : head_dim;
    int d = 0;
    for (; d + 2 * kLanes <= dim; d += 2 * kLanes) {
      F8 a[kCount][2];
      for (int i = 0; i < kCount; ++i) {
        a[i][0] = load8(acc + i * dim + d);
        a[i][1] = load8(acc + i * dim + d + kLanes);
      }
      for (int n = 0; n < kKeys; ++n) {
        F8 v0 = load8(values + n * dim + d), v1 = load8(values + n * dim + d + kLanes);
        pin8(v0);
        pin8(v1);
        for (int i = 0; i < kCount; ++i) {
          const F8 w = splat8(p[i * kKeys + n]);
          a[i][0] = fma8(w, v0, a[i][0]);
          a[i][1] = fma8(w, v1, a[i][1]);
        }
      }
      for (int i = 0; i < kCount; ++i) {
        store8(acc + i * dim + d, a[i][0]);
        store8(acc + i * dim + d + kLanes, a[i][1]);
      }
    }
    if (d < dim) {  // a last 8 dims (head_dim 40, 56, ...)
      F8 a[kCount];
      for (int i = 0; i < kCount; ++i) a[i] = load8(acc + i * dim + d);
      for (int n = 0; n < kKeys; ++n) {
        const F8 v = load8(values + n * dim + d);
        for (int i = 0; i < kCount; ++i) a[i] = fma8(splat8(p[i * kKeys + n]), v, a[i]);
      }
      for (int i = 0; i < kCount; ++i) store8(acc + i * dim + d, a[i]);
    }
  }

  // Runs `fn<count>(m)` over [begin, end) in tiles of kVectorsPerTile and a shorter last one.
  template <typename Fn>
  static void by_tiles(int begin, int end, Fn&& fn) {
    int m = begin;
    for (; m + kVectorsPerTile <= end; m += kVectorsPerTile) fn(std::integral_constant<int, kVectorsPerTile>{}, m);
    switch (end - m) {
      case 5:
        fn(std::integral_constant<int, 5>{}, m);
        break;
      case 4:
        fn(std::integral_constant<int, 4>{}, m);
        break;
      case 3:
        fn(std::integral_constant<int, 3>{}, m);
        break;
      case 2:
        fn(std::integral_constant<int, 2>{}, m);
        break;
      case 1:
        fn(std::integral_constant<int, 1>{}, m);
        break;
      default:
        break;
    }
  }

  template <int kHeadDim>
  static void run(const Problem& pb, const Scratch& scratch, const float* const* k_rows, const HeadBlock& blk) {
    const int head_dim = kHeadDim ? kHeadDim : pb.head_dim;
    gather_transposed<kHeadDim>(k_rows, blk.head_offset, scratch.keys, head_dim);
    gather<kHeadDim>(k_rows, blk.head_offset + pb.v_offset, scratch.values, head_dim);
    by_tiles(blk.m_begin, blk.m_end, [&](auto count, int m) {
      score<kHeadDim, decltype(count)::value>(scratch.queries + static_cast<int64_t>(m) * head_dim, scratch.keys,
                                              scratch.scores + m * kKeys, head_dim);
    });
    for (int m = blk.m_begin; m < blk.m_end; ++m) {
      float* s = scratch.scores + m * kKeys;
      F8 lo = load8(s), hi = load8(s + kLanes);
      const int num_live = blk.num_live(m);
      if (num_live < kKeys) {
        lo = keep_lanes8(lo, num_live >= kLanes ? 0xff : (1 << num_live) - 1, kNegInf);
        hi = keep_lanes8(hi, num_live > kLanes ? (1 << (num_live - kLanes)) - 1 : 0, kNegInf);
      }
      raise_max(hmax8(max8(lo, hi)), scratch.row_max[m], scratch.row_sum[m],
                scratch.acc + static_cast<int64_t>(m) * head_dim, head_dim);
      const F8 max = splat8(scratch.row_max[m]);
      lo = exp2_8(sub8(lo, max));
      hi = exp2_8(sub8(hi, max));
      scratch.row_sum[m] += hsum8(add8(lo, hi));
      store8(s, lo);
      store8(s + kLanes, hi);
    }
    by_tiles(blk.m_begin, blk.m_end, [&](auto count, int m) {
      accumulate<kHeadDim, decltype(count)::value>(scratch.scores + m * kKeys, scratch.values,
                                                   scratch.acc + static_cast<int64_t>(m) * head_dim, head_dim);
    });
  }
};

}  // namespace loraplex::attention
