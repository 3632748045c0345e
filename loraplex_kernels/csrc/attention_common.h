// What the paged attention's items and its row path share (loraplex_kernels/csrc/paged_attention.cpp includes
// them): the problem, the work items, per-thread scratch, and how a block of keys is found and prefetched.
// The pool's K/V are fp32 or bf16 (KV, a template argument of the path); a block's rows are widened to fp32
// as they are loaded, so scores, softmax and accumulation are fp32 either way.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "bf16.h"

namespace loraplex::attention {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct WorkItem {
  int32_t seq;
  int32_t kv_head_begin;  // kv heads [begin, end) of the sequence
  int32_t kv_head_end;
  int32_t row_begin;  // query rows of the sequence, counted from its first query row
  int32_t row_end;
  int64_t cost;
};

struct Problem {
  const float* q;
  int64_t q_token_stride;
  int64_t q_head_stride;
  const void* kv;  // the layer's view of the pool (fp32 or bf16): page p's K at kv + p * page_stride elements
  int64_t page_stride;
  int64_t v_offset;  // V of a page starts this many elements after its K
  int64_t slot_stride;  // elements between consecutive tokens of a page
  int block_size;
  int group;
  int num_heads;
  int num_kv_heads;
  int head_dim;
  const int32_t* block_tables;
  int64_t block_table_stride;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  float scale_log2;  // softmax scale x log2(e)
  float* out;  // [num_tokens, num_heads, head_dim], contiguous
};

// Per-thread scratch, sized for the largest item.
struct Scratch {
  float* queries;  // [vectors, head_dim]: the item's query vectors, pre-scaled
  float* acc;  // [vectors, head_dim]: running sums of p * V
  float* row_max;  // [vectors]: running max of the scores (log2 units)
  float* row_sum;  // [vectors]: running sum of exp2(score - max)
};

// One kv head's share of a block of keys: its query vectors [m_begin, m_end) that see some key of the
// block, and what row each vector belongs to (causality).
struct HeadBlock {
  int64_t head_offset;  // floats from a key's K row start to this kv head
  int j0;  // position of the block's first key
  int m_begin;
  int m_end;
  int m_head;  // the head's first vector: vector m is row (m - m_head) / group
  int first_pos;  // position of the item's first row
  int group;

  int num_live(int m) const { return first_pos + (m - m_head) / group - j0 + 1; }  // keys j0 .. its position
};

// The K rows of keys j0 .. j0 + kKeys - 1 (at their page's slot; V is v_offset further). Keys past
// last_key repeat it, so every pointer is valid memory; the queries mask those lanes out.
template <int kKeys, typename KV>
inline void key_rows(const Problem& pb, const int32_t* table, int j0, int last_key, const KV** rows) {
  const KV* kv = static_cast<const KV*>(pb.kv);
  int block = j0 / pb.block_size;
  int slot = j0 % pb.block_size;
  const KV* page = kv + table[block] * pb.page_stride;
  for (int n = 0; n < kKeys; ++n) {
    rows[n] = page + slot * pb.slot_stride;
    if (j0 + n + 1 > last_key) continue;  // keep repeating the last key
    if (++slot == pb.block_size) {
      slot = 0;
      page = kv + table[++block] * pb.page_stride;
    }
  }
}

// Prefetch into the outer caches (prefetcht2), one block ahead: a decode step's attention is bound by
// memory, and the next block's lines then arrive while this one is scored. prefetcht0 (into L1) stalls on
// the L1's miss buffers, and two or three blocks ahead evict what is still needed (both measured slower:
// docs/benchmarks.md#native-kernel-constants-and-choices).
inline void prefetch_bytes(const void* p, int64_t num_bytes) {
  constexpr int kLineBytes = 64;
  constexpr int kLocality = 1;  // prefetcht2
  const char* bytes = static_cast<const char*>(p);
  for (int64_t i = 0; i < num_bytes; i += kLineBytes) __builtin_prefetch(bytes + i, 0, kLocality);
}

// An item's running sums before its first block: acc [vectors, head_dim] zero, max -inf, sum zero.
inline void reset_sums(float* acc, float* row_max, float* row_sum, int64_t vectors, int head_dim) {
  std::fill(acc, acc + vectors * head_dim, 0.0f);
  std::fill(row_max, row_max + vectors, kNegInf);
  std::fill(row_sum, row_sum + vectors, 0.0f);
}

// fn(j0, rows) for each block of kKeys keys of `item`'s sequence, j0 from 0 to last_pos (rows: each key's K
// row, its V v_offset further; key_rows), prefetching meanwhile the next block's K and V rows of the item's
// kv heads: the pool is far larger than the caches, and a decode row's keys are read once.
template <int kKeys, typename KV, typename Fn>
inline void walk_key_blocks(const Problem& pb, const WorkItem& item, int last_pos, Fn&& fn) {
  const int32_t* table = pb.block_tables + item.seq * pb.block_table_stride;
  const int64_t heads_begin = static_cast<int64_t>(item.kv_head_begin) * pb.head_dim;
  const int64_t heads_bytes = static_cast<int64_t>(item.kv_head_end - item.kv_head_begin) * pb.head_dim * sizeof(KV);
  const KV* rows[kKeys];
  const KV* next_rows[kKeys] = {};
  key_rows<kKeys>(pb, table, 0, last_pos, rows);
  for (int j0 = 0; j0 <= last_pos; j0 += kKeys) {
    const bool more = j0 + kKeys <= last_pos;
    if (more) {
      key_rows<kKeys>(pb, table, j0 + kKeys, last_pos, next_rows);
      for (int n = 0; n < kKeys; ++n) {
        prefetch_bytes(next_rows[n] + heads_begin, heads_bytes);
        prefetch_bytes(next_rows[n] + pb.v_offset + heads_begin, heads_bytes);
      }
    }
    fn(j0, static_cast<const KV* const*>(rows));
    // Found again rather than copied from next_rows: the copy measured slower on decode steps (docs/benchmarks.md).
    if (more) key_rows<kKeys>(pb, table, j0 + kKeys, last_pos, rows);
  }
}

inline void scale_row(float* row, float factor, int head_dim) { scale_copy(row, row, factor, head_dim); }

// Folds a block's max into a vector's running max: rescales its running sum and accumulator when it grows.
inline void raise_max(float block_max, float& row_max, float& row_sum, float* acc_row, int head_dim) {
  if (block_max <= row_max) return;
  if (row_max != kNegInf) {
    const float alpha = std::exp2(row_max - block_max);
    row_sum *= alpha;
    scale_row(acc_row, alpha, head_dim);
  }
  row_max = block_max;
}

}  // namespace loraplex::attention
