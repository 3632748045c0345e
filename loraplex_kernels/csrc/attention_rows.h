// The paged attention's one path, for every query row (decode rows, verification rows, prefill chunks): eight keys
// at a time, read in place from the pool (bf16 rows widened as they are loaded) and shared by a chunk of
// the row's query vectors (its grouped heads): each vector scores the eight keys in one vector (eight FMA
// chains finished by one transpose-and-add) and accumulates p x V, each K and V load feeding every vector
// of the chunk. Memory-bound on long contexts: the keys are read once per step.
#pragma once

#include "attention_common.h"

namespace loraplex::attention {

struct RowPath {
  static constexpr int kKeys = kLanes;
  // Query vectors sharing each load: 3 x 8 score chains + 3 queries + a key take 28 of AVX-512's 32
  // registers; AVX2's 16 hold one vector's eight chains.
  static constexpr int kChunk = LORAPLEX_AVX512 ? 3 : 1;
  static_assert(kChunk <= 3, "run() finishes a row with chunks of 2 and 1");

  // s[c] lane n = q[c] . key n, for the C query vectors at q (rows head_dim apart) and the block's keys at
  // rows[n] + offset.
  template <int kHeadDim, int C, typename KV>
  static void score(const float* q, const KV* const* rows, int64_t offset, int head_dim, F8 (&s)[C]) {
    const int dim = kHeadDim ? kHeadDim : head_dim;
    FW wide[C][8];
    for (auto& chains : wide)
      for (auto& a : chains) a = zerow();
    int d = 0;
    for (; d + kWideLanes <= dim; d += kWideLanes) {
      FW qv[C];
      for (int c = 0; c < C; ++c) qv[c] = loadw(q + c * dim + d);
      for (int n = 0; n < 8; ++n) {
        const FW key = loadw(rows[n] + offset + d);
        for (int c = 0; c < C; ++c) wide[c][n] = fmaw(qv[c], key, wide[c][n]);
      }
    }
    F8 acc[C][8];
    for (int c = 0; c < C; ++c)
      for (int n = 0; n < 8; ++n) acc[c][n] = fold8(wide[c][n]);
    for (; d < dim; d += kLanes) {
      for (int n = 0; n < 8; ++n) {
        const F8 key = load8(rows[n] + offset + d);
        for (int c = 0; c < C; ++c) acc[c][n] = fma8(load8(q + c * dim + d), key, acc[c][n]);
      }
    }
    for (int c = 0; c < C; ++c) s[c] = transpose_sum8(acc[c]);
  }

  // acc[c] += sum_n weights[c][n] * value n, for the C vectors' accumulators at acc (rows head_dim apart)
  // and the block's values at rows[n] + offset.
  template <int kHeadDim, int C, typename KV>
  static void accumulate(float* acc, const float (&weights)[C][8], const KV* const* rows, int64_t offset,
                         int head_dim) {
    const int dim = kHeadDim ? kHeadDim : head_dim;
    int d = 0;
    for (; d + kWideLanes <= dim; d += kWideLanes) {
      FW a[C];
      for (int c = 0; c < C; ++c) a[c] = loadw(acc + c * dim + d);
      for (int n = 0; n < 8; ++n) {
        const FW value = loadw(rows[n] + offset + d);
        for (int c = 0; c < C; ++c) a[c] = fmaw(splatw(weights[c][n]), value, a[c]);
      }
      for (int c = 0; c < C; ++c) storew(acc + c * dim + d, a[c]);
    }
    for (; d < dim; d += kLanes) {
      F8 a[C];
      for (int c = 0; c < C; ++c) a[c] = load8(acc + c * dim + d);
      for (int n = 0; n < 8; ++n) {
        const F8 value = load8(rows[n] + offset + d);
        for (int c = 0; c < C; ++c) a[c] = fma8(splat8(weights[c][n]), value, a[c]);
      }
      for (int c = 0; c < C; ++c) store8(acc + c * dim + d, a[c]);
    }
  }

  // The C vectors from m (all of one row, num_live keys of the block visible) against the block.
  template <int kHeadDim, int C, typename KV>
  static void run_chunk(const Problem& pb, const Scratch& scratch, const KV* const* k_rows, const HeadBlock& blk,
                        int m, int num_live) {
    const int head_dim = kHeadDim ? kHeadDim : pb.head_dim;
    const int64_t first = static_cast<int64_t>(m) * head_dim;
    F8 s[C];
    score<kHeadDim, C>(scratch.queries + first, k_rows, blk.head_offset, head_dim, s);
    alignas(32) float weights[C][8];
    for (int c = 0; c < C; ++c) {
      if (num_live < kKeys) s[c] = keep_lanes8(s[c], (1 << num_live) - 1, kNegInf);
      float* acc_row = scratch.acc + first + static_cast<int64_t>(c) * head_dim;
      raise_max(hmax8(s[c]), scratch.row_max[m + c], scratch.row_sum[m + c], acc_row, head_dim);
      const F8 p = exp2_8(sub8(s[c], splat8(scratch.row_max[m + c])));
      scratch.row_sum[m + c] += hsum8(p);
      store8(weights[c], p);
    }
    accumulate<kHeadDim, C>(scratch.acc + first, weights, k_rows, blk.head_offset + pb.v_offset, head_dim);
  }

  template <int kHeadDim, typename KV>
  static void run(const Problem& pb, const Scratch& scratch, const KV* const* k_rows, const HeadBlock& blk) {
    // Row by row (m_row is a row's first vector): one count of live keys per row, not per vector.
    for (int m_row = blk.m_begin; m_row < blk.m_end; m_row += blk.group) {
      const int num_live = blk.num_live(m_row);
      const int row_end = m_row + blk.group;
      int m = m_row;
      for (; m + kChunk <= row_end; m += kChunk) run_chunk<kHeadDim, kChunk>(pb, scratch, k_rows, blk, m, num_live);
      if constexpr (kChunk > 1) {
        if (row_end - m == 2) run_chunk<kHeadDim, 2>(pb, scratch, k_rows, blk, m, num_live);
        if (row_end - m == 1) run_chunk<kHeadDim, 1>(pb, scratch, k_rows, blk, m, num_live);
      }
    }
  }
};

}  // namespace loraplex::attention
