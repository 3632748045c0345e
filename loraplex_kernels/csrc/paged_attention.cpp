// Paged attention on CPU, reading K/V in place from the page pool: one call per layer serves the step's
// decode rows and prefill chunks together (semantics: loraplex_kernels/attention/paged_attention.py::paged_attention).
//
// Every query row is computed as a decode row of its position: one arithmetic, the row path
// (attention_rows.h: eight keys a block, read in place from the pool, bf16 rows widened to fp32 as they are
// loaded), whether the row is decoded alone, verifies a speculated token among k + 1 rows of its sequence,
// sits in a prefill chunk of any length or is recomputed after a preemption. Each query vector's scores,
// online softmax (running max and sum, fp32, in log2 units so exp is exp2; causality a count of live keys
// per row, no mask) and sums run over the same blocks of keys in the same order whatever else the item
// holds, so a row's output is the same bits in any batch: the engine's tokens do not depend on what runs
// beside a request (docs/speculative-decoding.md). A path for many vectors a kv head (K transposed into
// scratch, sixteen keys a block, or AMX tiles on bf16 q and weights) can be faster on long prefill chunks,
// but it sums in another order, so a chunk's rows would differ from the decode rows they stand for.
//
// Work is split into items. A sequence whose query vectors (rows x heads) fit one tile, as a decode row
// and a verification chunk do, is one item over all its kv heads, so each page is read front to back once;
// a longer prefill chunk becomes items of (kv head, tile of rows), kTileQueries query vectors each, so a
// block of keys is read from L1 by all of them. An item copies its query vectors (pre-scaled) into scratch
// and walks its keys a block at a time, prefetching the next block's rows. Items are sorted by cost (query
// vectors x visible keys) and taken from a shared counter by the OpenMP threads, largest first, so a long
// chunk does not leave a thread idle. The pool's K/V may be fp32 or bf16: bf16 keys stream half the bytes
// and every product, the softmax and the accumulators stay fp32. Scoring the bf16 keys in place with
// AVX512-BF16's vdpbf16ps instead (q rounded to bf16 once per item) measured the same (docs/benchmarks.md):
// a decode step is bound by memory, so the widening, exact on the bf16 values, with one path for AVX-512
// and AVX2, is kept.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "attention_common.h"
#include "attention_rows.h"
#include "ops.h"

namespace loraplex {
namespace {

using attention::HeadBlock;
using attention::kNegInf;
using attention::Problem;
using attention::RowPath;
using attention::Scratch;
using attention::WorkItem;

// Query vectors (rows x grouped heads) per item: each K/V block serves all of them from L1, and their
// queries and accumulators (2 x 128 x 64 fp32 = 64 KiB at head_dim 64) stay in L2; 128 keeps enough items
// to share among more threads (docs/benchmarks.md#native-kernel-constants-and-choices).
constexpr int kTileQueries = 128;
constexpr float kLog2e = 1.4426950408889634f;

// One item: its kv heads' query vectors of its tile of rows against every key they see, a block of
// RowPath::kKeys keys at a time.
template <int kHeadDim, typename KV>
void attend(const Problem& pb, const WorkItem& item, const Scratch& scratch) {
  constexpr int kKeys = RowPath::kKeys;
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

  for (int h = 0; h < num_heads; ++h) {
    for (int r = 0; r < num_rows; ++r) {
      const float* row = pb.q + static_cast<int64_t>(q_begin + item.row_begin + r) * pb.q_token_stride;
      for (int g = 0; g < group; ++g) {
        const int head = (item.kv_head_begin + h) * group + g;
        const float* src = row + static_cast<int64_t>(head) * pb.q_head_stride;
        float* dst = scratch.queries + static_cast<int64_t>(h * vectors_per_head + r * group + g) * head_dim;
        scale_copy(dst, src, pb.scale_log2, head_dim);
      }
    }
  }
  attention::reset_sums(scratch.acc, scratch.row_max, scratch.row_sum, num_vectors, head_dim);

  const auto block = [&](int j0, const KV* const* k_rows) {
    const int r_first = std::max(0, j0 - first_pos);  // rows before position j0 see none of these keys
    for (int h = 0; h < num_heads; ++h) {
      const HeadBlock blk{static_cast<int64_t>(item.kv_head_begin + h) * head_dim,
                          j0,
                          h * vectors_per_head + r_first * group,
                          (h + 1) * vectors_per_head,
                          h * vectors_per_head,
                          first_pos,
                          group};
      RowPath::run<kHeadDim>(pb, scratch, k_rows, blk);
    }
  };
  attention::walk_key_blocks<kKeys, KV>(pb, item, last_pos, block);

  for (int h = 0; h < num_heads; ++h) {
    for (int r = 0; r < num_rows; ++r) {
      float* out_row = pb.out + static_cast<int64_t>(q_begin + item.row_begin + r) * pb.num_heads * head_dim;
      for (int g = 0; g < group; ++g) {
        const int m = h * vectors_per_head + r * group + g;
        const float* src = scratch.acc + static_cast<int64_t>(m) * head_dim;
        float* dst = out_row + static_cast<int64_t>((item.kv_head_begin + h) * group + g) * head_dim;
        scale_copy(dst, src, 1.0f / scratch.row_sum[m], head_dim);
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

template <int kHeadDim, typename KV>
void run_items(const Problem& pb, const std::vector<WorkItem>& items) {
  // An item holds at most kTileQueries vectors, or one row's heads when a row alone has more.
  const int max_vectors = std::max({pb.num_heads, pb.group, kTileQueries});
  const int64_t num_threads = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(items.size()));
  std::atomic<size_t> next{0};
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
    const size_t vector_floats = static_cast<size_t>(max_vectors) * pb.head_dim;
    std::vector<float> buffer(2 * vector_floats + 2 * max_vectors);
    Scratch scratch{};
    scratch.queries = buffer.data();
    scratch.acc = scratch.queries + vector_floats;
    scratch.row_max = scratch.acc + vector_floats;
    scratch.row_sum = scratch.row_max + max_vectors;
    for (size_t i = next.fetch_add(1, std::memory_order_relaxed); i < items.size();
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      attend<kHeadDim, KV>(pb, items[i], scratch);
    }
  }
}

template <typename KV>
void run_head_dim(const Problem& pb, const std::vector<WorkItem>& items) {
  switch (pb.head_dim) {  // the common head sizes get fully unrolled loops
    case 64:
      run_items<64, KV>(pb, items);
      break;
    case 128:
      run_items<128, KV>(pb, items);
      break;
    default:
      run_items<0, KV>(pb, items);
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
  const bool bf16_kv = kv_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK_VALUE(kv_cache.dim() == 5 && kv_cache.size(1) == 2 && (bf16_kv || kv_cache.scalar_type() == at::kFloat) &&
                        kv_cache.device().is_cpu(),
                    "paged_attention: kv_cache must be a float32 or bfloat16 CPU tensor [num_pages, 2, block_size, "
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
  pb.kv = kv_cache.data_ptr();
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
  pb.scale_log2 = static_cast<float>(scale) * kLog2e;  // scores in log2 units: exp is exp2
  pb.out = out.data_ptr<float>();

  const std::vector<WorkItem> items =
      plan_items(pb, num_seqs, block_tables.size(1), num_pages);
  if (items.empty()) return out;
  if (bf16_kv) {
    run_head_dim<c10::BFloat16>(pb, items);
  } else {
    run_head_dim<float>(pb, items);
  }
  return out;
}

}  // namespace loraplex
