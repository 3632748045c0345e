// The paged attention's path for many query vectors per kv head (prefill tiles): sixteen keys at a time
// as two small matrix products with register tiles. Scores: S[m, 0:16] = Q[m] . K^T for four query
// vectors at once over K transposed in scratch (each load of K^T feeds four FMAs, no horizontal sums;
// one sixteen-lane load per dimension with AVX-512, two of eight with AVX2); weights: S[m] ->
// exp2(S[m] - max) after the online-softmax update; values: acc[m, d:d+2W] += P[m, n] V[n, d:d+2W] for
// four vectors (W lanes a vector), the accumulators held in registers across the sixteen keys.
// Compute-bound: the K/V block is in L1 and serves up to kTileQueries (128) query vectors.
#pragma once

#include <type_traits>

#include "attention_common.h"

namespace loraplex::attention {

struct TilePath {
  static constexpr int kKeys = 2 * kLanes;
  // Vectors across the sixteen keys: 1 on AVX-512, 2 on AVX2.
  static constexpr int kParts = kKeys / kWideLanes;
  // Eight independent FMA chains in the score (two ports x four cycles of latency): 4 x 2 accumulators + 2
  // loads + 1 broadcast take 11 of AVX2's 16 registers; 8 x 1 on AVX-512 take 10 of its 32.
  static constexpr int kVectorsPerTile = 8 / kParts;

  // keys_t[d * 16 + n] = K[n][d] of one kv head, in fp32
  template <int kHeadDim, typename KV>
  static void gather_transposed(const KV* const* rows, int64_t offset, float* keys_t, int head_dim) {
    const int dim = kHeadDim ? kHeadDim : head_dim;
    for (int n = 0; n < kKeys; ++n) {
      const KV* src = rows[n] + offset;
      for (int d = 0; d < dim; ++d) keys_t[d * kKeys + n] = static_cast<float>(src[d]);
    }
  }

  template <int kHeadDim, typename KV>
  static void gather(const KV* const* rows, int64_t offset, float* dst, int head_dim) {
    const int dim = kHeadDim ? kHeadDim : head_dim;
    for (int n = 0; n < kKeys; ++n) load_row(dst + n * dim, rows[n] + offset, dim);
  }

  // scores[i, 0:16] = q[i] . K^T for kCount consecutive query vectors
  template <int kHeadDim, int kCount>
  static void score(const float* q, const float* keys_t, float* scores, int head_dim) {
    const int dim = kHeadDim ? kHeadDim : head_dim;
    FW acc[kCount][kParts];
    for (auto& parts : acc)
      for (auto& a : parts) a = zerow();
    for (int d = 0; d < dim; ++d) {
      FW k[kParts];
      for (int part = 0; part < kParts; ++part) {
        k[part] = loadw(keys_t + d * kKeys + part * kWideLanes);
        pinw(k[part]);
      }
      for (int i = 0; i < kCount; ++i) {
        const FW qd = splatw(q[i * dim + d]);
        for (int part = 0; part < kParts; ++part) acc[i][part] = fmaw(qd, k[part], acc[i][part]);
      }
    }
    for (int i = 0; i < kCount; ++i)
      for (int part = 0; part < kParts; ++part) storew(scores + i * kKeys + part * kWideLanes, acc[i][part]);
  }

  // acc[i][d:d + kWidth lanes of Vec] += sum_n p[i, n] * values[n][same] for kCount consecutive query
  // vectors, their accumulators held in registers across the sixteen keys
  template <int kCount, int kWidth, typename Vec>
  static void accumulate_span(const float* p, const float* values, float* acc, int dim, int d) {
    using Op = VecOps<Vec>;
    Vec a[kCount][kWidth];
    for (int i = 0; i < kCount; ++i)
      for (int w = 0; w < kWidth; ++w) a[i][w] = Op::load(acc + i * dim + d + w * Op::kCount);
    for (int n = 0; n < kKeys; ++n) {
      Vec v[kWidth];
      for (int w = 0; w < kWidth; ++w) {
        v[w] = Op::load(values + n * dim + d + w * Op::kCount);
        Op::pin(v[w]);
      }
      for (int i = 0; i < kCount; ++i) {
        const Vec weight = Op::splat(p[i * kKeys + n]);
        for (int w = 0; w < kWidth; ++w) a[i][w] = Op::fma(weight, v[w], a[i][w]);
      }
    }
    for (int i = 0; i < kCount; ++i)
      for (int w = 0; w < kWidth; ++w) Op::store(acc + i * dim + d + w * Op::kCount, a[i][w]);
  }

  // acc[i] += sum_n p[i, n] * values[n] for kCount consecutive query vectors
  template <int kHeadDim, int kCount>
  static void accumulate(const float* p, const float* values, float* acc, int head_dim) {
    const int dim = kHeadDim ? kHeadDim : head_dim;
    int d = 0;
    for (; d + 2 * kWideLanes <= dim; d += 2 * kWideLanes) accumulate_span<kCount, 2, FW>(p, values, acc, dim, d);
    for (; d + kWideLanes <= dim; d += kWideLanes) {  // a last 16 dims on AVX-512 (head_dim 48, 80, ...)
      accumulate_span<kCount, 1, FW>(p, values, acc, dim, d);
    }
    for (; d < dim; d += kLanes) accumulate_span<kCount, 1, F8>(p, values, acc, dim, d);  // a last 8 (40, 56, ...)
  }

  // Runs `fn<count>(m)` over [begin, end) in tiles of kVectorsPerTile and a shorter last one.
  template <typename Fn>
  static void by_tiles(int begin, int end, Fn&& fn) {
    int m = begin;
    for (; m + kVectorsPerTile <= end; m += kVectorsPerTile) fn(std::integral_constant<int, kVectorsPerTile>{}, m);
    last_tile<kVectorsPerTile - 1>(end - m, m, fn);
  }

  // fn<count>(m) for the count left over, kCount or fewer
  template <int kCount, typename Fn>
  static void last_tile(int count, int m, Fn& fn) {
    if constexpr (kCount > 0) {
      if (count == kCount) {
        fn(std::integral_constant<int, kCount>{}, m);
      } else {
        last_tile<kCount - 1>(count, m, fn);
      }
    }
  }

  template <int kHeadDim, typename KV>
  static void run(const Problem& pb, const Scratch& scratch, const KV* const* k_rows, const HeadBlock& blk) {
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
