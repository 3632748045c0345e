// SGMV shrink then expand, fused, reading adapter rows from the page pool in place
// (semantics: loraplex_kernels/sgmv/sgmv_fused.py::sgmv_fused; the plan: loraplex_kernels/sgmv/sgmv_fused_native.py).
//
// Work comes as items (one adapter's rows for the module group: every token that reads them, wherever it
// sits in the step), so an adapter's rows are read once per tile of its tokens, not once per token. An
// item's module with rank r runs as tiles of at most kTileTokens tokens:
//   v[k, j] = x[token_k] . A_j                      (j < r; A_j is in_dim long)
//   y[token_k, out_offset:out_offset + out_dim] += sum_j v[k, j] * Bt_j
// Both products run on register tiles (see kShrinkTokens below). Different modules write different columns
// of y and different tiles different rows, so the work items run on the threads with no locking.
//
// The pool holds the rows in fp32, or in bf16 (bf16 mode's pool): bf16 rows are widened to fp32 as they are
// loaded into registers (exact), so x, v and the sums are fp32 either way and a bf16 pool halves the bytes
// the op streams. The kernels below are written once over the pool's element type T.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "bf16.h"
#include "ops.h"

namespace loraplex {
namespace {

// Tokens per work item: a tile's A and Bt rows stay in L1 while each of its tokens reads them.
constexpr int64_t kTileTokens = 16;
// Below this many multiply-adds in a call, handing work to a second thread costs more than it saves.
constexpr int64_t kMinParallelMacs = 1 << 16;

struct Tile {
  int32_t item;
  int32_t module;
  int32_t first;  // into the item's tokens
  int32_t end;
};

struct Problem {
  const float* x;
  int64_t x_stride;
  float* y;
  int64_t y_stride;
  const void* pool;  // storage + layer_offset, float or c10::BFloat16: row addresses index from here
  int64_t in_dim;
  int64_t num_modules;
  const int32_t* token_ids;
  const int32_t* item_starts;
  const int32_t* row_start_a;
  const int32_t* row_start_b;
  const int32_t* ranks;
  const int64_t* row_addr;
  const int32_t* out_dims;
  const int32_t* out_offsets;
};

// Register tiles: the shrink scores kShrinkTokens tokens against kShrinkRanks A rows at once (each load of
// x or A feeds several FMAs: 6 loads for 8 FMAs at 2 x 4, where one dot product at a time needs 2 for 1);
// the expand adds kExpandTokens tokens' deltas to two vectors of columns of y at once (32 columns with
// AVX-512, 16 with AVX2), holding them in registers across the rank (2 Bt loads and 4 broadcasts for 8
// FMAs). 2 x 4 and 4 x 2 accumulators leave room in AVX2's 16 registers for the operands.
constexpr int kShrinkTokens = 2;
constexpr int kShrinkRanks = 4;
constexpr int kExpandTokens = 4;

// v[t * v_stride + j] = x_t . a_j for kT tokens and kR rows of A (fp32 or bf16 elements)
template <int kT, int kR, typename T>
void shrink_block(const float* const* x, const T* const* a, int64_t in_dim, float* v, int v_stride) {
  FW wide[kT][kR];
  for (auto& row : wide)
    for (auto& c : row) c = zerow();
  int64_t d = 0;
  for (; d + kWideLanes <= in_dim; d += kWideLanes) {
    FW xs[kT];
    for (int t = 0; t < kT; ++t) {
      xs[t] = loadw(x[t] + d);
      pinw(xs[t]);
    }
    for (int j = 0; j < kR; ++j) {
      const FW aj = loadw(a[j] + d);  // bf16: widened in the register
      for (int t = 0; t < kT; ++t) wide[t][j] = fmaw(xs[t], aj, wide[t][j]);
    }
  }
  F8 acc[kT][kR];
  for (int t = 0; t < kT; ++t)
    for (int j = 0; j < kR; ++j) acc[t][j] = fold8(wide[t][j]);
  for (; d + kLanes <= in_dim; d += kLanes) {  // a last 8 on AVX-512
    for (int j = 0; j < kR; ++j) {
      const F8 aj = load8(a[j] + d);
      for (int t = 0; t < kT; ++t) acc[t][j] = fma8(load8(x[t] + d), aj, acc[t][j]);
    }
  }
  for (int t = 0; t < kT; ++t) {
    for (int j = 0; j < kR; ++j) {
      float sum = hsum8(acc[t][j]);
      // Fused as the lanes are, whatever the compiler contracts: fp32 and bf16 rows give the same bits.
      for (int64_t e = d; e < in_dim; ++e) sum = std::fma(x[t][e], widen(a[j][e]), sum);
      v[t * v_stride + j] = sum;
    }
  }
}

template <int kT, typename T>
void shrink_tokens(const float* const* x, const T* const* a, int rank, int64_t in_dim, float* v) {
  int j = 0;
  for (; j + kShrinkRanks <= rank; j += kShrinkRanks) shrink_block<kT, kShrinkRanks>(x, a + j, in_dim, v + j, rank);
  switch (rank - j) {
    case 3:
      shrink_block<kT, 3>(x, a + j, in_dim, v + j, rank);
      break;
    case 2:
      shrink_block<kT, 2>(x, a + j, in_dim, v + j, rank);
      break;
    case 1:
      shrink_block<kT, 1>(x, a + j, in_dim, v + j, rank);
      break;
    default:
      break;
  }
}

// y_t[c:c + kWidth lanes of Vec] += sum_j v[t * rank + j] * bt_j[same] for kT tokens, held in registers
// across the rank (bt rows fp32 or bf16)
template <int kT, int kWidth, typename Vec, typename T>
void expand_span(float* const* y, const float* v, const T* const* bt, int rank, int64_t c) {
  using Op = VecOps<Vec>;
  Vec acc[kT][kWidth];
  for (int t = 0; t < kT; ++t)
    for (int w = 0; w < kWidth; ++w) acc[t][w] = Op::load(y[t] + c + w * Op::kCount);
  for (int j = 0; j < rank; ++j) {
    Vec b[kWidth];
    for (int w = 0; w < kWidth; ++w) {
      b[w] = load_lanes<Vec>(bt[j] + c + w * Op::kCount);
      Op::pin(b[w]);
    }
    for (int t = 0; t < kT; ++t) {
      const Vec weight = Op::splat(v[t * rank + j]);
      for (int w = 0; w < kWidth; ++w) acc[t][w] = Op::fma(weight, b[w], acc[t][w]);
    }
  }
  for (int t = 0; t < kT; ++t)
    for (int w = 0; w < kWidth; ++w) Op::store(y[t] + c + w * Op::kCount, acc[t][w]);
}

// y_t[0:n] += sum_j v[t * rank + j] * bt_j[0:n] for kT tokens
template <int kT, typename T>
void expand_tokens(float* const* y, const float* v, const T* const* bt, int rank, int64_t n) {
  int64_t c = 0;
  for (; c + 2 * kWideLanes <= n; c += 2 * kWideLanes) expand_span<kT, 2, FW>(y, v, bt, rank, c);
  for (; c + kLanes <= n; c += kLanes) expand_span<kT, 1, F8>(y, v, bt, rank, c);  // a last 8-24 columns
  for (int t = 0; t < kT; ++t) {  // a last 0-7 columns
    for (int64_t col = c; col < n; ++col) {
      float acc = y[t][col];
      for (int j = 0; j < rank; ++j) acc = std::fma(v[t * rank + j], widen(bt[j][col]), acc);  // see the shrink
      y[t][col] = acc;
    }
  }
}

template <typename T>
void run_tile(const Problem& pb, const Tile& tile, std::vector<float>& v, std::vector<const T*>& rows) {
  const T* pool = static_cast<const T*>(pb.pool);
  const int64_t at = static_cast<int64_t>(tile.item) * pb.num_modules + tile.module;
  const int rank = pb.ranks[at];
  const int32_t* tokens = pb.token_ids + pb.item_starts[tile.item] + tile.first;
  const int64_t out_dim = pb.out_dims[tile.module], out_offset = pb.out_offsets[tile.module];
  const int num_tokens = tile.end - tile.first;
  v.resize(static_cast<size_t>(num_tokens) * rank);
  rows.resize(rank);
  const float* x[kTileTokens];
  float* y[kTileTokens];
  for (int k = 0; k < num_tokens; ++k) {
    x[k] = pb.x + tokens[k] * pb.x_stride;
    y[k] = pb.y + tokens[k] * pb.y_stride + out_offset;
  }

  for (int j = 0; j < rank; ++j) rows[j] = pool + pb.row_addr[pb.row_start_a[at] + j];
  int k = 0;
  for (; k + kShrinkTokens <= num_tokens; k += kShrinkTokens) {
    shrink_tokens<kShrinkTokens>(x + k, rows.data(), rank, pb.in_dim, v.data() + static_cast<size_t>(k) * rank);
  }
  if (k < num_tokens) shrink_tokens<1>(x + k, rows.data(), rank, pb.in_dim, v.data() + static_cast<size_t>(k) * rank);

  for (int j = 0; j < rank; ++j) rows[j] = pool + pb.row_addr[pb.row_start_b[at] + j];
  k = 0;
  for (; k + kExpandTokens <= num_tokens; k += kExpandTokens) {
    expand_tokens<kExpandTokens>(y + k, v.data() + static_cast<size_t>(k) * rank, rows.data(), rank, out_dim);
  }
  float* const* y_rest = y + k;
  const float* v_rest = v.data() + static_cast<size_t>(k) * rank;
  switch (num_tokens - k) {
    case 3:
      expand_tokens<3>(y_rest, v_rest, rows.data(), rank, out_dim);
      break;
    case 2:
      expand_tokens<2>(y_rest, v_rest, rows.data(), rank, out_dim);
      break;
    case 1:
      expand_tokens<1>(y_rest, v_rest, rows.data(), rank, out_dim);
      break;
    default:
      break;
  }
}

// Every tile on up to num_threads threads, each taking the next tile not yet taken.
template <typename T>
void run_tiles(const Problem& pb, const std::vector<Tile>& tiles, int64_t num_threads) {
  std::atomic<size_t> next{0};
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
    std::vector<float> v;
    std::vector<const T*> rows;
    for (size_t i = next.fetch_add(1, std::memory_order_relaxed); i < tiles.size();
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      run_tile<T>(pb, tiles[i], v, rows);
    }
  }
}

// The pool's element layer_offset (row addresses count the pool's own elements, fp32 or bf16).
const void* pool_at(const at::Tensor& storage, int64_t layer_offset) {
  if (storage.scalar_type() == at::kBFloat16) return storage.data_ptr<c10::BFloat16>() + layer_offset;
  return storage.data_ptr<float>() + layer_offset;
}

void check_int_tensor(const at::Tensor& t, at::ScalarType dtype, const char* name, at::IntArrayRef shape) {
  TORCH_CHECK_VALUE(t.scalar_type() == dtype && t.is_contiguous() && t.device().is_cpu(), "sgmv_fused: ", name,
                    " must be a contiguous ", dtype, " CPU tensor");
  TORCH_CHECK_VALUE(t.sizes() == at::IntArrayRef(shape), "sgmv_fused: ", name, " must have shape ", shape,
                    ", got ", t.sizes());
}

}  // namespace

void sgmv_fused(const at::Tensor& x, const at::Tensor& storage, int64_t layer_offset, const at::Tensor& token_ids,
                const at::Tensor& item_starts, const at::Tensor& row_start_a, const at::Tensor& row_start_b,
                const at::Tensor& ranks, const at::Tensor& row_addr, const at::Tensor& out_dims,
                const at::Tensor& out_offsets, const at::Tensor& y) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.stride(1) == 1,
                    "sgmv_fused: x must be a float32 CPU tensor [num_tokens, in_dim] with contiguous rows");
  TORCH_CHECK_VALUE(y.dim() == 2 && y.scalar_type() == at::kFloat && y.device().is_cpu() && y.stride(1) == 1 &&
                        y.size(0) == x.size(0),
                    "sgmv_fused: y must be a float32 CPU tensor [num_tokens, y_width] with contiguous rows");
  const bool bf16_pool = storage.scalar_type() == at::kBFloat16;
  TORCH_CHECK_VALUE((bf16_pool || storage.scalar_type() == at::kFloat) && storage.is_contiguous() &&
                        storage.device().is_cpu(),
                    "sgmv_fused: storage must be the contiguous float32 or bfloat16 page pool");
  const int64_t num_items = item_starts.numel() - 1, num_modules = out_dims.numel();
  TORCH_CHECK_VALUE(num_items >= 0 && num_modules >= 1, "sgmv_fused: need item_starts and one module at least");
  check_int_tensor(item_starts, at::kInt, "item_starts", {num_items + 1});
  check_int_tensor(row_start_a, at::kInt, "row_start_a", {num_items, num_modules});
  check_int_tensor(row_start_b, at::kInt, "row_start_b", {num_items, num_modules});
  check_int_tensor(ranks, at::kInt, "ranks", {num_items, num_modules});
  check_int_tensor(out_dims, at::kInt, "out_dims", {num_modules});
  check_int_tensor(out_offsets, at::kInt, "out_offsets", {num_modules});
  check_int_tensor(token_ids, at::kInt, "token_ids", {token_ids.numel()});
  check_int_tensor(row_addr, at::kLong, "row_addr", {row_addr.numel()});

  Problem pb{x.data_ptr<float>(),         x.stride(0),
             y.data_ptr<float>(),         y.stride(0),
             pool_at(storage, layer_offset),
             x.size(1),                   num_modules,
             token_ids.data_ptr<int32_t>(), item_starts.data_ptr<int32_t>(),
             row_start_a.data_ptr<int32_t>(), row_start_b.data_ptr<int32_t>(),
             ranks.data_ptr<int32_t>(),   row_addr.data_ptr<int64_t>(),
             out_dims.data_ptr<int32_t>(), out_offsets.data_ptr<int32_t>()};

  // Every address read must fall inside the pool and every token inside x: checked once per call.
  const int64_t pool_elems = storage.numel() - layer_offset, num_tokens = x.size(0), num_rows = row_addr.numel();
  TORCH_CHECK_VALUE(layer_offset >= 0 && pool_elems > 0, "sgmv_fused: layer_offset ", layer_offset,
                    " is outside the pool");
  TORCH_CHECK_VALUE(pb.item_starts[0] == 0 && pb.item_starts[num_items] == token_ids.numel(),
                    "sgmv_fused: item_starts must run from 0 to the number of token_ids");
  std::vector<Tile> tiles;
  int64_t macs = 0;
  for (int64_t i = 0; i < num_items; ++i) {
    const int32_t first = pb.item_starts[i], end = pb.item_starts[i + 1];
    TORCH_CHECK_VALUE(first <= end, "sgmv_fused: item_starts must not decrease");
    for (int32_t k = first; k < end; ++k) {
      TORCH_CHECK_VALUE(pb.token_ids[k] >= 0 && pb.token_ids[k] < num_tokens, "sgmv_fused: token id ",
                        pb.token_ids[k], " is outside x's ", num_tokens, " rows");
    }
    for (int64_t m = 0; m < num_modules; ++m) {
      const int64_t at = i * num_modules + m;
      const int rank = pb.ranks[at];
      if (rank == 0 || end == first) continue;
      const int64_t out_dim = pb.out_dims[m];
      TORCH_CHECK_VALUE(pb.out_offsets[m] >= 0 && pb.out_offsets[m] + out_dim <= y.size(1),
                        "sgmv_fused: module ", m, "'s columns fall outside y");
      for (int j = 0; j < rank; ++j) {
        const int64_t a_row = pb.row_start_a[at] + j, b_row = pb.row_start_b[at] + j;
        TORCH_CHECK_VALUE(a_row >= 0 && a_row < num_rows && b_row >= 0 && b_row < num_rows,
                          "sgmv_fused: item ", i, " module ", m, " reads rows outside row_addr");
        TORCH_CHECK_VALUE(pb.row_addr[a_row] >= 0 && pb.row_addr[a_row] + pb.in_dim <= pool_elems &&
                              pb.row_addr[b_row] >= 0 && pb.row_addr[b_row] + out_dim <= pool_elems,
                          "sgmv_fused: item ", i, " module ", m, " reads past the pool");
      }
      for (int32_t t = 0; t < end - first; t += kTileTokens) {
        tiles.push_back({static_cast<int32_t>(i), static_cast<int32_t>(m), t,
                         static_cast<int32_t>(std::min<int64_t>(t + kTileTokens, end - first))});
      }
      macs += static_cast<int64_t>(end - first) * rank * (pb.in_dim + out_dim);
    }
  }
  if (tiles.empty()) return;
  const int64_t num_threads =
      macs < kMinParallelMacs ? 1 : std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(tiles.size()));
  if (bf16_pool) {
    run_tiles<c10::BFloat16>(pb, tiles, num_threads);
  } else {
    run_tiles<float>(pb, tiles, num_threads);
  }
}

}  // namespace loraplex
