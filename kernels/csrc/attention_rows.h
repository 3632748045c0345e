// The paged attention's path for few query vectors per kv head (decode rows, short chunks): eight keys
// at a time, each query vector scoring them in one vector (eight FMA chains finished by one
// transpose-and-add) and accumulating p x V itself. Memory-bound: the keys are read once per step.
#pragma once

#include "attention_common.h"

namespace loraplex::attention {

struct RowPath {
  static constexpr int kKeys = kLanes;

  // Scores of one query vector against the block: lane n = q . keys[n].
  template <int kHeadDim>
  static F8 score(const float* q, const float* keys, int head_dim) {
    const int dim = kHeadDim ? kHeadDim : head_dim;
    FW wide[8];
    for (auto& a : wide) a = zerow();
    int d = 0;
    for (; d + kWideLanes <= dim; d += kWideLanes) {
      const FW qv = loadw(q + d);
      for (int n = 0; n < 8; ++n) wide[n] = fmaw(qv, loadw(keys + n * dim + d), wide[n]);
    }
    F8 acc[8];
    for (int n = 0; n < 8; ++n) acc[n] = fold8(wide[n]);
    for (; d < dim; d += kLanes) {
      const F8 qv = load8(q + d);
      for (int n = 0; n < 8; ++n) acc[n] = fma8(qv, load8(keys + n * dim + d), acc[n]);
    }
    return transpose_sum8(acc);
  }

  // acc += sum_n p[n] * values[n]
  template <int kHeadDim>
  static void accumulate(float* acc, F8 p, const float* values, int head_dim) {
    const int dim = kHeadDim ? kHeadDim : head_dim;
    alignas(32) float weights[8];
    store8(weights, p);
    int d = 0;
    for (; d + kWideLanes <= dim; d += kWideLanes) {
      FW a = loadw(acc + d);
      for (int n = 0; n < 8; ++n) a = fmaw(splatw(weights[n]), loadw(values + n * dim + d), a);
      storew(acc + d, a);
    }
    for (; d < dim; d += kLanes) {
      F8 a = load8(acc + d);
      for (int n = 0; n < 8; ++n) a = fma8(splat8(weights[n]), load8(values + n * dim + d), a);
      store8(acc + d, a);
    }
  }

  // Copies the block's rows of one kv head into contiguous fp32 scratch (one base address for the loops).
  template <int kHeadDim, typename KV>
  static void gather(const KV* const* rows, int64_t offset, float* dst, int head_dim) {
    const int dim = kHeadDim ? kHeadDim : head_dim;
    for (int n = 0; n < 8; ++n) load_row(dst + n * dim, rows[n] + offset, dim);
  }

  template <int kHeadDim, typename KV>
  static void run(const Problem& pb, const Scratch& scratch, const KV* const* k_rows, const HeadBlock& blk) {
    const int head_dim = kHeadDim ? kHeadDim : pb.head_dim;
    gather<kHeadDim>(k_rows, blk.head_offset, scratch.keys, head_dim);
    gather<kHeadDim>(k_rows, blk.head_offset + pb.v_offset, scratch.values, head_dim);
    // Row by row (m_begin is a row's first vector): one count of live keys per row, not per vector.
    for (int m_row = blk.m_begin; m_row < blk.m_end; m_row += blk.group) {
      const int num_live = blk.num_live(m_row);
      for (int m = m_row; m < m_row + blk.group; ++m) {
        float* acc_row = scratch.acc + static_cast<int64_t>(m) * head_dim;
        F8 s = score<kHeadDim>(scratch.queries + static_cast<int64_t>(m) * head_dim, scratch.keys, head_dim);
        if (num_live < kKeys) s = keep_lanes8(s, (1 << num_live) - 1, kNegInf);
        raise_max(hmax8(s), scratch.row_max[m], scratch.row_sum[m], acc_row, head_dim);
        const F8 p = exp2_8(sub8(s, splat8(scratch.row_max[m])));
        scratch.row_sum[m] += hsum8(p);
        accumulate<kHeadDim>(acc_row, p, scratch.values, head_dim);
      }
    }
  }
};

}  // namespace loraplex::attention
