// Paged attention on CPU, reading K/V in place from the page pool: one call per layer serves the step's
// decode rows and prefill chunks together (semantics: kernels/paged_attention.py::paged_attention).
//
// Work is split into items. A sequence whose query vectors (rows x heads) fit one tile, as a decode row
// does, is one item over all its kv heads, so each page is read front to back once; a longer prefill
// chunk becomes items of (kv head, tile of rows), each tile of up to kTileQueries query vectors sharing
// every K/V load. An item copies its query vectors (pre-scaled) into scratch and walks its keys eight at
// a time: the block's K and V rows of one kv head are copied to contiguous scratch (one base address for
// the inner loops) while the next block's rows are prefetched, then every query vector of that kv head
// scores the eight keys (one vector of eight dot products), updates its online softmax (running max and
// sum, fp32, in log2 units so exp is exp2) and accumulates p x V. Causality is a per-row count of live
// lanes, so no mask is built. Items are sorted by cost (query vectors x visible keys) and taken from a
// shared counter by the OpenMP threads, largest first, so a long chunk does not leave a thread idle.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <vector>

#include "ops.h"
#include "vec8.h"

namespace loraplex {
namespace {

// Query vectors (rows x grouped heads) per item: its accumulators and queries (2 x 64 x 64 fp32 =
// 32 KiB at head_dim 64) stay in L1/L2 while eight keys at a time stream past.
constexpr int kTileQueries = 64;
constexpr int kKeysPerBlock = kLanes;  // keys scored per step: one vector of scores per query vector
constexpr float kLog2e = 1.4426950408889634f;
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
  const float* kv;  // the layer's view of the pool: page p's K at kv + p * page_stride
  int64_t page_stride;
  int64_t v_offset;  // V of a page starts this many floats after its K
  int64_t slot_stride;  // floats between consecutive tokens of a page
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
  float* keys;  // [8, head_dim]: the block's K rows of one kv head, contiguous
  float* values;  // [8, head_dim]: the same for V
};

// Scores of one query vector against the eight keys: lane n = q . keys[n].
template <int kHeadDim>
inline F8 score8(const float* q, const float* keys, int head_dim) {
  const int dim = kHeadDim ? kHeadDim : head_dim;
  F8 acc[8];
  for (auto& a : acc) a = zero8();
  for (int d = 0; d < dim; d += kLanes) {
    const F8 qv = load8(q + d);
    for (int n = 0; n < 8; ++n) acc[n] = fma8(qv, load8(keys + n * dim + d), acc[n]);
  }
  return transpose_sum8(acc);
}

// acc += sum_n p[n] * values[n]
template <int kHeadDim>
inline void accumulate8(float* acc, F8 p, const float* values, int head_dim) {
  const int dim = kHeadDim ? kHeadDim : head_dim;
  alignas(32) float weights[8];
  store8(weights, p);
  for (int d = 0; d < dim; d += kLanes) {
    F8 a = load8(acc + d);
    for (int n = 0; n < 8; ++n) a = fma8(splat8(weights[n]), load8(values + n * dim + d), a);
    store8(acc + d, a);
  }
}

inline void scale_row(float* row, float factor, int head_dim) {
  const F8 f = splat8(factor);
  for (int d = 0; d < head_dim; d += kLanes) store8(row + d, mul8(load8(row + d), f));
}

// One query vector's online softmax step over a block of scores (log2 units): masks the lanes past its
// position, rescales its running sum and accumulator when the max grows, returns the block's weights.
inline F8 softmax_step(F8 scores, int num_live, float& row_max, float& row_sum, float* acc_row, int head_dim) {
  if (num_live < kKeysPerBlock) scores = keep_lanes8(scores, (1 << num_live) - 1, kNegInf);
  const float block_max = hmax8(scores);
  if (block_max > row_max) {
    if (row_max != kNegInf) {
      const float alpha = std::exp2(row_max - block_max);
      row_sum *= alpha;
      scale_row(acc_row, alpha, head_dim);
    }
    row_max = block_max;
  }
  const F8 p = exp2_8(sub8(scores, splat8(row_max)));
  row_sum += hsum8(p);
  return p;
}

// Copies the eight K (and V) rows of one kv head into contiguous scratch: one base address for the
// inner loops, and the reads of a page stay sequential.
template <int kHeadDim>
inline void gather8(const float* const* rows, int64_t head_offset, float* dst, int head_dim) {
  const int dim = kHeadDim ? kHeadDim : head_dim;
  for (int n = 0; n < 8; ++n) {
    const float* src = rows[n] + head_offset;
    for (int d = 0; d < dim; d += kLanes) store8(dst + n * dim + d, load8(src + d));
  }
}

// The K rows of keys j0 .. j0 + 7 (at their page's slot; V is v_offset further). Keys past last_key
// repeat it, so every pointer is valid memory; the queries mask those lanes out.
inline void key_rows(const Problem& pb, const int32_t* table, int j0, int last_key, const float** rows) {
  int block = j0 / pb.block_size;
  int slot = j0 % pb.block_size;
  const float* page = pb.kv + table[block] * pb.page_stride;
  for (int n = 0; n < kKeysPerBlock; ++n) {
    rows[n] = page + slot * pb.slot_stride;
    if (j0 + n + 1 > last_key) continue;  // keep repeating the last key
    if (++slot == pb.block_size) {
      slot = 0;
      page = pb.kv + table[++block] * pb.page_stride;
    }
  }
}

// Prefetch into the outer caches (prefetcht2): measured on the EPYC, one block ahead, this cut a decode
// step's attention by a third, while prefetcht0 (into L1) stalled on the L1's miss buffers and was slower
// than no prefetch at all; two or three blocks ahead was slower than one.
inline void prefetch_floats(const float* p, int64_t num_floats) {
  constexpr int kLineFloats = 16;  // 64-byte cache lines
  constexpr int kLocality = 1;  // prefetcht2
  for (int64_t i = 0; i < num_floats; i += kLineFloats) __builtin_prefetch(p + i, 0, kLocality);
}

// One item: its kv heads' query vectors of its tile of rows against every key they see.
template <int kHeadDim>
void attend(const Problem& pb, const WorkItem& item, const Scratch& scratch) {
  const int group = pb.group;
  const int head_dim = kHeadDim ? kHeadDim : pb.head_dim;
  const int q_begin = pb.query_start_loc[item.seq];
  const int q_len = pb.query_start_loc[item.seq + 1] - q_begin;
  const int num_rows = item.row_end - item.row_begin;
  const int num_heads = item.kv_head_end - item.kv_head_begin;
  const int vectors_per_head = num_rows * group;  // vector m of kv head h: (h - begin) * this + r * group + g
  const int num_vectors = num_heads * vectors_per_head;
  const int first_pos = pb.seq_lens[item.seq] - q_len + item.row_begin;  // position of the tile's first row
  const int last_pos = first_pos + num_rows - 1;
  float* const queries = scratch.queries;
  float* const acc = scratch.acc;
  float* const row_max = scratch.row_max;
  float* const row_sum = scratch.row_sum;

  for (int h = 0; h < num_heads; ++h) {
    for (int r = 0; r < num_rows; ++r) {
      const float* row = pb.q + static_cast<int64_t>(q_begin + item.row_begin + r) * pb.q_token_stride;
      for (int g = 0; g < group; ++g) {
        const int head = (item.kv_head_begin + h) * group + g;
        const float* src = row + static_cast<int64_t>(head) * pb.q_head_stride;
        float* dst = queries + static_cast<int64_t>(h * vectors_per_head + r * group + g) * head_dim;
        for (int d = 0; d < head_dim; ++d) dst[d] = src[d] * pb.scale_log2;
      }
    }
  }
  std::fill(acc, acc + static_cast<int64_t>(num_vectors) * head_dim, 0.0f);
  std::fill(row_max, row_max + num_vectors, kNegInf);
  std::fill(row_sum, row_sum + num_vectors, 0.0f);

  const int32_t* table = pb.block_tables + item.seq * pb.block_table_stride;
  const int64_t heads_begin = static_cast<int64_t>(item.kv_head_begin) * head_dim;
  const int64_t heads_floats = static_cast<int64_t>(num_heads) * head_dim;
  const float* k_rows[8];
  const float* v_rows[8];
  const float* next_rows[8] = {};
  key_rows(pb, table, 0, last_pos, k_rows);
  for (int j0 = 0; j0 <= last_pos; j0 += kKeysPerBlock) {
    for (int n = 0; n < kKeysPerBlock; ++n) v_rows[n] = k_rows[n] + pb.v_offset;
    if (j0 + kKeysPerBlock <= last_pos) {
      // Ask for the next block's K and V rows while this one is computed: the pool is far larger than
      // the caches, and a decode row's keys are read once.
      key_rows(pb, table, j0 + kKeysPerBlock, last_pos, next_rows);
      for (int n = 0; n < kKeysPerBlock; ++n) {
        prefetch_floats(next_rows[n] + heads_begin, heads_floats);
        prefetch_floats(next_rows[n] + pb.v_offset + heads_begin, heads_floats);
      }
    }
    const int r_first = std::max(0, j0 - first_pos);  // rows before position j0 see none of these keys
    for (int h = 0; h < num_heads; ++h) {
      const int64_t head_offset = static_cast<int64_t>(item.kv_head_begin + h) * head_dim;
      gather8<kHeadDim>(k_rows, head_offset, scratch.keys, head_dim);
      gather8<kHeadDim>(v_rows, head_offset, scratch.values, head_dim);
      for (int r = r_first; r < num_rows; ++r) {
        const int num_live = first_pos + r - j0 + 1;  // keys j0 .. the position of row r
        for (int g = 0; g < group; ++g) {
          const int m = h * vectors_per_head + r * group + g;
          float* acc_row = acc + static_cast<int64_t>(m) * head_dim;
          const F8 scores = score8<kHeadDim>(queries + static_cast<int64_t>(m) * head_dim, scratch.keys, head_dim);
          const F8 p = softmax_step(scores, num_live, row_max[m], row_sum[m], acc_row, head_dim);
          accumulate8<kHeadDim>(acc_row, p, scratch.values, head_dim);
        }
      }
    }
    if (j0 + kKeysPerBlock <= last_pos) key_rows(pb, table, j0 + kKeysPerBlock, last_pos, k_rows);
  }

  for (int h = 0; h < num_heads; ++h) {
    for (int r = 0; r < num_rows; ++r) {
      float* out_row = pb.out + static_cast<int64_t>(q_begin + item.row_begin + r) * pb.num_heads * head_dim;
      for (int g = 0; g < group; ++g) {
        const int m = h * vectors_per_head + r * group + g;
        const F8 inv = splat8(1.0f / row_sum[m]);
        const float* src = acc + static_cast<int64_t>(m) * head_dim;
        float* dst = out_row + static_cast<int64_t>((item.kv_head_begin + h) * group + g) * head_dim;
        for (int d = 0; d < head_dim; d += kLanes) store8(dst + d, mul8(load8(src + d), inv));
      }
    }
  }
}

// Items of every sequence, largest first. A sequence whose query vectors fit one tile (decode rows,
// short chunks) is one item over all its kv heads, so its pages are read front to back; a longer chunk
// is split by kv head and by tiles of rows. Checks each sequence's lengths and page ids, so no item
// can read outside the pool.
std::vector<WorkItem> plan_items(const Problem& pb, int64_t num_seqs, int64_t max_blocks, int64_t num_pages) {
  std::vector<WorkItem> items;
  const int rows_per_tile = std::max(1, kTileQueries / pb.group);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int q_len = pb.query_start_loc[s + 1] - pb.query_start_loc[s];
    const int seq_len = pb.seq_lens[s];
    TORCH_CHECK_VALUE(q_len >= 0 && seq_len >= q_len, "paged_attention: sequence ", s, " has ", q_len,
                      " query rows but seq_len ", seq_len, "; query_start_loc must rise and seq_len >= q_len");
    if (q_len == 0) continue;
    const int64_t num_blocks = (seq_len + pb.block_size - 1) / pb.block_size;
    TORCH_CHECK_VALUE(num_blocks <= max_blocks, "paged_attention: sequence ", s, " needs ", num_blocks,
                      " pages but block_tables has ", max_blocks, " columns");
    const int32_t* table = pb.block_tables + s * pb.block_table_stride;
    for (int64_t b = 0; b < num_blocks; ++b) {
      TORCH_CHECK_VALUE(table[b] >= 0 && table[b] < num_pages, "paged_attention: block_tables[", s, ", ", b,
                        "] = ", table[b], " is not a page of the pool (", num_pages, " pages)");
    }
    // cost: query vectors x keys they see, plus the keys loaded once per kv head
    auto cost = [&](int r0, int r1, int heads) {
      const int64_t first_keys = seq_len - q_len + r0 + 1, last_keys = seq_len - q_len + r1;
      return heads * (static_cast<int64_t>(r1 - r0) * pb.group * (first_keys + last_keys) / 2 + last_keys);
    };
    if (static_cast<int64_t>(q_len) * pb.num_heads <= kTileQueries) {
      items.push_back({static_cast<int32_t>(s), 0, pb.num_kv_heads, 0, q_len, cost(0, q_len, pb.num_kv_heads)});
      continue;
    }
    for (int r0 = 0; r0 < q_len; r0 += rows_per_tile) {
      const int r1 = std::min(r0 + rows_per_tile, q_len);
      for (int h = 0; h < pb.num_kv_heads; ++h) {
        items.push_back({static_cast<int32_t>(s), h, h + 1, r0, r1, cost(r0, r1, 1)});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return items;
}

template <int kHeadDim>
void run_items(const Problem& pb, const std::vector<WorkItem>& items) {
  // An item holds at most kTileQueries vectors, or one row's heads when a row alone has more.
  const int max_vectors = std::max({pb.num_heads, pb.group, kTileQueries});
  const int64_t num_threads = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(items.size()));
  std::atomic<size_t> next{0};
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
    const size_t vector_floats = static_cast<size_t>(max_vectors) * pb.head_dim;
    const size_t block_floats = static_cast<size_t>(kKeysPerBlock) * pb.head_dim;
    std::vector<float> buffer(2 * vector_floats + 2 * max_vectors + 2 * block_floats);
    Scratch scratch{};
    scratch.queries = buffer.data();
    scratch.acc = scratch.queries + vector_floats;
    scratch.row_max = scratch.acc + vector_floats;
    scratch.row_sum = scratch.row_max + max_vectors;
    scratch.keys = scratch.row_sum + max_vectors;
    scratch.values = scratch.keys + block_floats;
    for (size_t i = next.fetch_add(1, std::memory_order_relaxed); i < items.size();
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      attend<kHeadDim>(pb, items[i], scratch);
    }
  }
}

void check_int32_vector(const at::Tensor& t, const char* name, int64_t length) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kInt && t.dim() == 1 && t.is_contiguous() && t.device().is_cpu(),
                    "paged_attention: ", name, " must be a contiguous int32 CPU vector");
  TORCH_CHECK_VALUE(t.size(0) == length, "paged_attention: ", name, " must have ", length, " entries, got ",
                    t.size(0));
}

}  // namespace

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale) {
  TORCH_CHECK_VALUE(q.dim() == 3 && q.scalar_type() == at::kFloat && q.device().is_cpu(),
                    "paged_attention: q must be a float32 CPU tensor [num_tokens, num_heads, head_dim]");
  TORCH_CHECK_VALUE(kv_cache.dim() == 5 && kv_cache.size(1) == 2 && kv_cache.scalar_type() == at::kFloat &&
                        kv_cache.device().is_cpu(),
                    "paged_attention: kv_cache must be a float32 CPU tensor [num_pages, 2, block_size, "
                    "num_kv_heads, head_dim]");
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_pages = kv_cache.size(0), block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  TORCH_CHECK_VALUE(q.stride(2) == 1, "paged_attention: q must be contiguous along head_dim");
  TORCH_CHECK_VALUE(kv_cache.size(4) == head_dim, "paged_attention: kv_cache head_dim ", kv_cache.size(4),
                    " != q head_dim ", head_dim);
  TORCH_CHECK_VALUE(head_dim % kLanes == 0, "paged_attention: head_dim must be a multiple of ", kLanes, ", got ",
                    head_dim);
  TORCH_CHECK_VALUE(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "paged_attention: num_heads ", num_heads,
                    " must be a multiple of num_kv_heads ", num_kv_heads);
  // Each page's [2, block_size, kv_heads, head_dim] must be contiguous; pages may be strided (a layer view).
  TORCH_CHECK_VALUE(kv_cache.stride(4) == 1 && kv_cache.stride(3) == head_dim &&
                        kv_cache.stride(2) == num_kv_heads * head_dim &&
                        kv_cache.stride(1) == block_size * num_kv_heads * head_dim,
                    "paged_attention: each page of kv_cache must be contiguous (a layer view of the pool is)");
  const int64_t num_seqs = seq_lens.numel();
  check_int32_vector(seq_lens, "seq_lens", num_seqs);
  check_int32_vector(query_start_loc, "query_start_loc", num_seqs + 1);
  TORCH_CHECK_VALUE(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                        block_tables.size(0) == num_seqs && block_tables.stride(1) == 1 &&
                        block_tables.device().is_cpu(),
                    "paged_attention: block_tables must be an int32 CPU tensor [num_seqs, max_blocks] with "
                    "contiguous rows");
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  TORCH_CHECK_VALUE(starts[0] == 0 && starts[num_seqs] == num_tokens, "paged_attention: query_start_loc must run "
                    "from 0 to num_tokens = ", num_tokens, ", got ", starts[0], " .. ", starts[num_seqs]);

  at::Tensor out = at::empty({num_tokens, num_heads, head_dim}, q.options());  // [num_tokens, heads, head_dim]
  Problem pb{};
  pb.q = q.data_ptr<float>();
  pb.q_token_stride = q.stride(0);
  pb.q_head_stride = q.stride(1);
  pb.kv = kv_cache.data_ptr<float>();
  pb.page_stride = kv_cache.stride(0);
  pb.v_offset = kv_cache.stride(1);
  pb.slot_stride = kv_cache.stride(2);
  pb.block_size = static_cast<int>(block_size);
  pb.group = static_cast<int>(num_heads / num_kv_heads);
  pb.num_heads = static_cast<int>(num_heads);
  pb.num_kv_heads = static_cast<int>(num_kv_heads);
  pb.head_dim = static_cast<int>(head_dim);
  pb.block_tables = block_tables.data_ptr<int32_t>();
  pb.block_table_stride = block_tables.stride(0);
  pb.seq_lens = seq_lens.data_ptr<int32_t>();
  pb.query_start_loc = starts;
  pb.scale_log2 = static_cast<float>(scale) * kLog2e;
  pb.out = out.data_ptr<float>();

  const std::vector<WorkItem> items =
      plan_items(pb, num_seqs, block_tables.size(1), num_pages);
  if (items.empty()) return out;
  switch (head_dim) {  // the common head sizes get fully unrolled loops
    case 64:
      run_items<64>(pb, items);
      break;
    case 128:
      run_items<128>(pb, items);
      break;
    default:
      run_items<0>(pb, items);
  }
  return out;
}

}  // namespace loraplex
