// Dense projections on bf16 weights with AMX tiles (semantics: loraplex_kernels/projection/linear_dot.py's
// linear_amx): the same pair panels as linear_dot.cpp's vdpbf16ps tiles, multiplied by the tile unit of CPUs with
// AMX-BF16 (Intel Sapphire Rapids and later).
//
// A pair panel row (one kp, kPanelWidth columns' pairs: 4 * kPanelWidth bytes) is exactly what a row of an
// AMX weight tile holds for 16 columns, so a 16-column block of 16 k pairs is a tile load from the panel with
// the panel row as its stride: no second packing. One tdpbf16ps then multiplies 16 activation rows by 32 k
// steps of 16 columns (8,192 products, fp32 sums), the k-steps in order. A unit of work is 2 row blocks x 2
// column blocks (the pair of blocks may straddle two panels), so each tile load feeds two multiplies; each
// thread takes a run of units in order. While a unit's first 32 rows load its weights, each k-step also
// prefetches the same k-step's 32 lines of the thread's next unit into L2, so that unit's tile loads find
// them there: the tile loads of a k-step wait on one another and on the multiplies before them, which keeps
// few misses in flight, and the prefetch gives the decode steps' projections more (figures:
// docs/benchmarks.md#native-kernel-constants-and-choices).
// The sums tiles store straight into the output where they cover only its rows and columns.
//
// linear_amx_silu_mul is the gated MLP's gate/up projection and its SiLU x up in one pass: a unit pairs
// gate's column block j with up's block j, and its sums become SiLU(gate) x up in the thread's scratch, so
// the [rows, 2 x intermediate] product is never written to memory nor read back by silu_mul.
//
// The activations are rounded to bf16 once per call into tile order (round_to_tiles), padded to whole tiles
// of 16 rows with zeros, so a row is computed the same way, in the same order, alone or in any batch: its
// result is the same bits. Tiles hold 16 rows, so a decode step of fewer rows computes zero rows too; its
// time is the weights' streaming anyway.
//
// Only a build for a CPU with AMX-BF16 (-march of such a CPU) compiles the tiles, and they run only once
// Linux has granted the process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM); elsewhere
// linear_amx_available() is false and the engine keeps the other panels.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx_tiles.h"
#include "bf16_pairs.h"
#include "linear_panels.h"
#include "ops.h"
#include "silu.h"
#include "vec_wide.h"

#if LORAPLEX_AMX
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace loraplex {
namespace {

#if LORAPLEX_AMX

constexpr int kBlockColumns = 16;  // output columns of a weight or sum tile: a column block
constexpr int64_t kTileValues = kTileRows16 * kTileRows16;  // pairs of an input tile: 16 rows x 16 pairs
constexpr int kPanelBlocks = kPanelWidth / kBlockColumns;
static_assert(kPanelWidth % kBlockColumns == 0, "a pair panel is whole column blocks");
constexpr int64_t kPanelRowBytes = kPanelWidth * static_cast<int64_t>(sizeof(Bf16Pair));
constexpr int kUnitSide = 2;  // a unit of work: up to 2 row blocks x 2 column blocks
constexpr int kUnitRows = kUnitSide * kTileRows16, kUnitColumns = kUnitSide * kBlockColumns;
// Rows a pass over the weights: the bf16 inputs of 512 rows (at most 1.5 MB for 1,536 features) stay in L2,
// and the weights stream once per 512 rows, fewer times than in passes of 128 (measured faster from 256 rows:
// docs/benchmarks.md).
constexpr int64_t kAmxRowsPerPass = 512;

// The tile registers (the intrinsics paste their numbers into the instruction, so the code spells them):
// tmm0-3 the sums of (row block, column block) (0, 0), (0, 1), (1, 0), (1, 1); tmm4-5 the two row blocks'
// activations of a k-step; tmm6-7 the two column blocks' weights. Each weight tile then serves two
// multiplies and each activation tile two: one tile load a multiply, half of them from L1.
constexpr int kTilesUsed = 8;

bool amx_bf16_granted() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
  constexpr unsigned kAmxBf16 = 1u << 22, kAmxTile = 1u << 24;  // CPUID.(7, 0):EDX
  if ((edx & kAmxBf16) == 0 || (edx & kAmxTile) == 0) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // asm/prctl.h, the tile data's bit
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// x [rows, K] fp32 rounded to bf16 (round_row) in tile order, [padded_rows / 16, pairs / 16, 16 rows, 16 pairs]
// int32: each tile of 16 rows x 16 pairs one contiguous KB, so a tile load reads 16 consecutive lines rather
// than 16 rows of the whole K; zero past K and past the rows. Each row's 32 values of a k-step are rounded
// straight into their tile row, the row blocks shared by the threads (a decode step's 64 rows too: one
// thread alone kept the other waiting at the GEMM; figures: docs/benchmarks.md).
at::Tensor round_to_tiles(const at::Tensor& x, int64_t pairs, int64_t padded_rows) {
  const int64_t rows = x.size(0), in_features = x.size(1), stride = x.stride(0), steps = pairs / kTileRows16;
  at::Tensor out = at::empty({padded_rows / kTileRows16, steps, kTileRows16, kTileRows16}, x.options().dtype(at::kInt));
  Bf16Pair* tiles = reinterpret_cast<Bf16Pair*>(out.data_ptr());
  const float* src = x.data_ptr<float>();
  constexpr int64_t kStepValues = 2 * kTileRows16;  // a tile row: 16 pairs
  at::parallel_for(0, padded_rows / kTileRows16, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin * kTileRows16; r < end * kTileRows16; ++r) {
      uint16_t* dst = reinterpret_cast<uint16_t*>(tiles + (r / kTileRows16) * steps * kTileValues +
                                                  (r % kTileRows16) * kTileRows16);
      for (int64_t s = 0; s < steps; ++s) {
        uint16_t* tile_row = dst + s * 2 * kTileValues;
        const int64_t k = s * kStepValues;
        const int64_t written = r < rows ? std::clamp<int64_t>(in_features - k, 0, kStepValues) : 0;
        if (written > 0) round_row(src + r * stride + k, tile_row, written);
        std::fill(tile_row + written, tile_row + kStepValues, uint16_t{0});
      }
    }
  });
  return out;
}

// Into L2 (prefetcht1): the 16 lines of k-step kp of a column block (a weight tile's rows, one panel row
// apart); nothing for a null block.
inline void prefetch_tile_rows(const Bf16Pair* block, int64_t kp) {
  if (block == nullptr) return;
  const char* line = reinterpret_cast<const char*>(block + kp * kPanelWidth);
  for (int r = 0; r < kTileRows16; ++r) _mm_prefetch(line + r * kPanelRowBytes, _MM_HINT_T1);
}

// out[RB * 16, CB * 16] (rows `out_stride` floats apart) = x[RB * 16 rows, 2 * pairs] @ the CB column
// blocks at `blocks`, on the loaded tile config; x the row blocks' first tile (round_to_tiles), the second
// row block's `x_block` pairs after the first's; pairs a multiple of 16.
template <int RB, int CB>
void unit_sums(const Bf16Pair* x, int64_t x_block, const Bf16Pair* const (&blocks)[kUnitSide],
               const Bf16Pair* const (&next)[kUnitSide], int64_t pairs, float* out, int64_t out_stride) {
  const Bf16Pair* x1 = x + x_block;
  _tile_zero(0);
  if constexpr (CB == 2) _tile_zero(1);
  if constexpr (RB == 2) _tile_zero(2);
  if constexpr (RB == 2 && CB == 2) _tile_zero(3);
  for (int64_t kp = 0; kp < pairs; kp += kTileRows16) {
    for (const Bf16Pair* block : next) prefetch_tile_rows(block, kp);
    _tile_loadd(6, blocks[0] + kp * kPanelWidth, kPanelRowBytes);
    if constexpr (CB == 2) _tile_loadd(7, blocks[1] + kp * kPanelWidth, kPanelRowBytes);
    _tile_loadd(4, x + kp * kTileRows16, kTileBytes);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (CB == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (RB == 2) {
      _tile_loadd(5, x1 + kp * kTileRows16, kTileBytes);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (CB == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  const int64_t stride_bytes = out_stride * static_cast<int64_t>(sizeof(float));
  float* second = out + kTileRows16 * out_stride;
  _tile_stored(0, out, stride_bytes);
  if constexpr (CB == 2) _tile_stored(1, out + kBlockColumns, stride_bytes);
  if constexpr (RB == 2) _tile_stored(2, second, stride_bytes);
  if constexpr (RB == 2 && CB == 2) _tile_stored(3, second + kBlockColumns, stride_bytes);
}

void unit_sums(int row_blocks, int column_blocks, const Bf16Pair* x, int64_t x_block,
               const Bf16Pair* const (&blocks)[kUnitSide], const Bf16Pair* const (&next)[kUnitSide], int64_t pairs,
               float* out, int64_t out_stride) {
  if (row_blocks == 2 && column_blocks == 2) return unit_sums<2, 2>(x, x_block, blocks, next, pairs, out, out_stride);
  if (row_blocks == 2) return unit_sums<2, 1>(x, x_block, blocks, next, pairs, out, out_stride);
  if (column_blocks == 2) return unit_sums<1, 2>(x, x_block, blocks, next, pairs, out, out_stride);
  unit_sums<1, 1>(x, x_block, blocks, next, pairs, out, out_stride);
}

// y[0:rows, 0:columns] = sums (rows kUnitColumns floats apart; y rows `y_stride`): a unit whose tiles reach
// past the output's rows or columns.
void copy_rows(const float* sums, int64_t rows, int64_t columns, float* y, int64_t y_stride) {
  for (int64_t r = 0; r < rows; ++r) std::memcpy(y + r * y_stride, sums + r * kUnitColumns, columns * sizeof(float));
}

// y[0:rows, 0:columns] += bias, rows `y_stride` apart.
void add_bias(const float* bias, int64_t rows, int64_t columns, float* y, int64_t y_stride) {
  for (int64_t r = 0; r < rows; ++r) {
    float* out = y + r * y_stride;
    int64_t c = 0;
    for (; c + kWideLanes <= columns; c += kWideLanes) storew(out + c, addw(loadw(out + c), loadw(bias + c)));
    for (; c < columns; ++c) out[c] += bias[c];
  }
}

// The 16 columns of column block b: panel b / kPanelBlocks, 16-column offset b % kPanelBlocks in it.
const Bf16Pair* column_block(const Bf16Pair* panels, int64_t pairs, int64_t b) {
  return panels + (b / kPanelBlocks) * pairs * kPanelWidth + (b % kPanelBlocks) * kBlockColumns;
}

// fn(u, next, row, unit_rows, x_unit, x_block, sums) for every unit u in [0, units) and every run of up to
// kUnitRows rows of x from `row`: x rounded once into tiles (x_unit the run's first tile, its second row
// block x_block pairs further), passes of kAmxRowsPerPass rows, each pass's units shared by the threads,
// each unit taking the pass's runs in order (its weights stay in cache); `next` is the unit whose weights
// to prefetch meanwhile (the thread's next unit, on a pass's first run only), or -1; `sums` is the
// thread's scratch of kUnitRows x kUnitColumns floats, and the tile config is loaded around the calls.
template <typename Fn>
void for_units(const at::Tensor& x, int64_t pairs, int64_t units, Fn&& fn) {
  const int64_t rows = x.size(0);
  const int64_t padded_rows = (rows + kTileRows16 - 1) / kTileRows16 * kTileRows16;
  const at::Tensor x_rounded = round_to_tiles(x, pairs, padded_rows);  // [padded_rows / 16, pairs / 16, 16, 16]
  const Bf16Pair* x_tiles = reinterpret_cast<const Bf16Pair*>(x_rounded.data_ptr());
  const int64_t x_block = pairs * kTileRows16;  // pairs of a row block's tiles
  for (int64_t first = 0; first < rows; first += kAmxRowsPerPass) {
    const int64_t pass_end = std::min(first + kAmxRowsPerPass, rows);
    at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
      load_full_tiles(kTilesUsed);  // the tile state is a thread's own
      alignas(64) float sums[kUnitRows * kUnitColumns];
      for (int64_t u = begin; u < end; ++u) {
        for (int64_t row = first; row < pass_end; row += kUnitRows) {
          const int64_t next = row == first && u + 1 < end ? u + 1 : -1;
          fn(u, next, row, std::min<int64_t>(kUnitRows, pass_end - row), x_tiles + row / kTileRows16 * x_block,
             x_block, sums);
        }
      }
      _tile_release();  // a switched-out thread then saves no tile state
    });
  }
}

// y = x @ the panels, + bias where `bias` is given (padded to whole panels): a unit is two neighbouring
// column blocks, its sums stored straight into y where they cover only y's rows and columns.
void run_amx_panels(const at::Tensor& x, const at::Tensor& packed, const float* bias, at::Tensor& y,
                    int64_t out_features) {
  const int64_t pairs = packed.size(1);
  const Bf16Pair* panels = reinterpret_cast<const Bf16Pair*>(packed.data_ptr());
  float* y_ptr = y.data_ptr<float>();
  const int64_t column_blocks = (out_features + kBlockColumns - 1) / kBlockColumns;
  const int64_t units = (column_blocks + kUnitSide - 1) / kUnitSide;
  // Column block b, or null past the blocks (a unit's second block at the edge; a next unit of -1).
  const auto block = [&](int64_t b) { return b < 0 || b >= column_blocks ? nullptr : column_block(panels, pairs, b); };
  for_units(x, pairs, units, [&](int64_t u, int64_t next_u, int64_t row, int64_t unit_rows, const Bf16Pair* x_unit,
                                 int64_t x_block, float* sums) {
    const int64_t b0 = u * kUnitSide;
    const int col_blocks = static_cast<int>(std::min<int64_t>(kUnitSide, column_blocks - b0));
    const Bf16Pair* const blocks[kUnitSide] = {block(b0), block(b0 + 1)};
    const Bf16Pair* const next[kUnitSide] = {block(next_u * kUnitSide), block(next_u * kUnitSide + 1)};
    const int64_t unit_columns = std::min<int64_t>(kUnitColumns, out_features - b0 * kBlockColumns);
    const int row_blocks = unit_rows > kTileRows16 ? 2 : 1;
    float* out = y_ptr + row * out_features + b0 * kBlockColumns;
    const bool whole = unit_rows == row_blocks * kTileRows16 && unit_columns == col_blocks * kBlockColumns;
    unit_sums(row_blocks, col_blocks, x_unit, x_block, blocks, next, pairs, whole ? out : sums,
              whole ? out_features : kUnitColumns);
    if (!whole) copy_rows(sums, unit_rows, unit_columns, out, out_features);
    if (bias != nullptr) add_bias(bias + b0 * kBlockColumns, unit_rows, unit_columns, out, out_features);
  });
}

// act = silu(x @ gate^T) * (x @ up^T), the panels holding gate's `intermediate` columns then up's: a unit is
// gate's column block j beside up's block j, its sums (rows of 16 gate then 16 up columns) through `sums`
// into act's columns of block j, so the gate/up product is never stored.
void run_amx_silu_mul(const at::Tensor& x, const at::Tensor& packed, at::Tensor& act, int64_t intermediate) {
  const int64_t pairs = packed.size(1);
  const Bf16Pair* panels = reinterpret_cast<const Bf16Pair*>(packed.data_ptr());
  float* act_ptr = act.data_ptr<float>();
  const int64_t gate_blocks = intermediate / kBlockColumns;
  for_units(x, pairs, gate_blocks, [&](int64_t j, int64_t next_j, int64_t row, int64_t unit_rows,
                                       const Bf16Pair* x_unit, int64_t x_block, float* sums) {
    const Bf16Pair* const blocks[kUnitSide] = {column_block(panels, pairs, j),
                                               column_block(panels, pairs, gate_blocks + j)};
    const Bf16Pair* const next[kUnitSide] = {
        next_j < 0 ? nullptr : column_block(panels, pairs, next_j),
        next_j < 0 ? nullptr : column_block(panels, pairs, gate_blocks + next_j)};
    unit_sums(unit_rows > kTileRows16 ? 2 : 1, 2, x_unit, x_block, blocks, next, pairs, sums, kUnitColumns);
    for (int64_t r = 0; r < unit_rows; ++r) {
      const float* sums_row = sums + r * kUnitColumns;
      silu_mul_row(sums_row, sums_row + kBlockColumns, act_ptr + (row + r) * intermediate + j * kBlockColumns,
                   kBlockColumns);
    }
  });
}

#endif  // LORAPLEX_AMX

}  // namespace

bool linear_amx_available() {
#if LORAPLEX_AMX
  static const bool available = amx_bf16_granted();
  return available;
#else
  return false;
#endif
}

namespace {

void check_amx(const char* op) {
  TORCH_CHECK_VALUE(linear_amx_available(), op,
                    ": the native kernels have no AMX tiles here (the CPU lacks amx_bf16, Linux refused the tile "
                    "state, or the library is built for another target); use linear_dot or the k-major panels "
                    "of pack_linear_weight");
}

}  // namespace

at::Tensor linear_amx(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                      int64_t out_features) {
  check_amx("linear_amx");
  check_pair_panels("linear_amx", x, packed, bias, out_features);
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());  // [num_rows, out_features]
  if (x.size(0) == 0) return y;
#if LORAPLEX_AMX
  const at::Tensor dense_bias = bias.has_value() ? bias->contiguous() : at::Tensor();
  run_amx_panels(x, packed, bias.has_value() ? dense_bias.data_ptr<float>() : nullptr, y, out_features);
#endif
  return y;
}

at::Tensor linear_amx_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t intermediate) {
  check_amx("linear_amx_silu_mul");
  TORCH_CHECK_VALUE(intermediate > 0 && intermediate % 16 == 0,
                    "linear_amx_silu_mul: intermediate must be a positive multiple of 16 (whole column blocks), "
                    "got ", intermediate);
  check_pair_panels("linear_amx_silu_mul", x, packed, std::nullopt, 2 * intermediate);
  at::Tensor act = at::empty({x.size(0), intermediate}, x.options());  // [num_rows, intermediate]
  if (x.size(0) == 0) return act;
#if LORAPLEX_AMX
  run_amx_silu_mul(x, packed, act, intermediate);
#endif
  return act;
}

}  // namespace loraplex
