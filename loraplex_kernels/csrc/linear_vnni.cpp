// Dense projections on int8 weights with AVX512-VNNI's integer dot product (semantics:
// loraplex_kernels/projection/linear_vnni.py); the third panel format beside linear_packed.cpp's k-major panels and
// linear_dot.cpp's bf16 pairs.
//
// The weight [N, K] int8 is packed once into panels of kPanelWidth output columns with k in quads:
// packed[p][kq][4c + j] = weight[p * kPanelWidth + c][4kq + j], zero past N and past K (K padded to whole
// blocks of kBlock). Each 32-bit lane of a panel row holds one column's four weights, the operand layout of
// vpdpbusd, which adds four u8 x s8 products to an int32 lane: 64 multiply-adds an instruction, four times
// an fp32 FMA's sixteen, at the FMAs' issue rate on the Xeon measured in docs/precision.md.
//
// The activations are quantized once per call, per row and block of kBlock k: s = max|x| / 127 and
// q = round(x * (127 / max|x|)) in [-127, 127] (ties to even), stored as q + 128 (u8, vpdpbusd's unsigned
// operand). A block's integer sum is exact: it starts from -128 * sum(w) over the block (the panel's block
// offsets, packed beside it), which takes the 128 back out. The block's sum, converted to fp32, is then scaled
// by the row's block scale into the fp32 sums, blocks in k order; the column's weight scale and the bias
// end the sum: y = scale * sum_b s[b] * isum[b] + bias.
//
// Each output is one chain of blocks in order, whatever the number of rows: a row's result is the same
// bits alone or in any batch. Only an AVX-512 build with AVX512-VNNI compiles the tile; elsewhere
// linear_vnni_available() is false and the engine keeps the other panels.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "linear_panels.h"
#include "ops.h"
#include "vec_wide.h"

#if LORAPLEX_AVX512 && defined(__AVX512VNNI__)
#define LORAPLEX_VNNI 1
#else
#define LORAPLEX_VNNI 0
#endif

namespace loraplex {
namespace {

constexpr int kBlock = 32;                          // k a block: one activation scale per row and block
constexpr int kQuadsPerBlock = kBlock / 4;          // panel rows of four k a block
constexpr int kQuadRowBytes = 4 * kPanelWidth;      // one panel row of k quads: four bytes a column
// Rows a tile: 12 int32 sums of the current block, 3 panel vectors and a broadcast in registers; the 12 fp32
// sums, touched once a block, stay in L1 (8 rows, with 24 int32 sums, measured slower: docs/benchmarks.md).
constexpr int kVnniTileRows = 4;
constexpr int kActivationOffset = 128;              // q + 128 makes the activations vpdpbusd's unsigned bytes
// Rows a thread quantizes at least: a decode batch's 64 rows shared by the threads (they would otherwise
// wait at the GEMM while one thread quantized them all).
constexpr int64_t kQuantizeGrain = 16;

int64_t blocks_of(int64_t in_features) { return (in_features + kBlock - 1) / kBlock; }

#if LORAPLEX_VNNI

// One panel: its quads, its block offsets and its scales and bias.
struct QuadPanel {
  const int8_t* weights;   // [blocks * kQuadsPerBlock, kQuadRowBytes]
  const int32_t* offsets;  // [blocks, kPanelWidth]: -128 * the block's column sums
  const float* bias;       // [kPanelWidth], zero past the real columns
  const float* scales;     // [kPanelWidth]
  const int8_t* prefetch;  // the next panel this thread computes, or nullptr
  int64_t blocks;
  int64_t columns;  // real columns, <= kPanelWidth
};

// y[0:R, 0:columns] for R rows of quantized activations (`x_stride` quads apart, their block scales
// `s_stride` apart).
template <int R>
void vnni_tile(const uint32_t* x, int64_t x_stride, const float* x_scales, int64_t s_stride,
               const QuadPanel& panel, float* y, int64_t y_stride, PrefetchCursor<uint32_t>& cursor) {
  PrefetchCursor<uint32_t> next = cursor;
  FW acc[R][kPanelVectors];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < kPanelVectors; ++j) acc[i][j] = zerow();
  for (int64_t b = 0; b < panel.blocks; ++b) {
    __m512i sums[R][kPanelVectors];
    for (int i = 0; i < R; ++i)  // loaded for each row (L1): three registers more for the sums' use
      for (int j = 0; j < kPanelVectors; ++j)
        sums[i][j] = _mm512_loadu_si512(panel.offsets + b * kPanelWidth + j * kWideLanes);
    const int8_t* block = panel.weights + b * kQuadsPerBlock * kQuadRowBytes;
#pragma GCC unroll 8
    for (int q = 0; q < kQuadsPerBlock; ++q) {
      __m512i w[kPanelVectors];
      for (int j = 0; j < kPanelVectors; ++j) w[j] = _mm512_loadu_si512(block + q * kQuadRowBytes + j * 64);
      next.step();
      for (int i = 0; i < R; ++i) {
        const __m512i a = _mm512_set1_epi32(static_cast<int>(x[i * x_stride + b * kQuadsPerBlock + q]));
        for (int j = 0; j < kPanelVectors; ++j) sums[i][j] = _mm512_dpbusd_epi32(sums[i][j], a, w[j]);
      }
    }
    for (int i = 0; i < R; ++i) {
      const __m512 s = _mm512_set1_ps(x_scales[i * s_stride + b]);
      for (int j = 0; j < kPanelVectors; ++j)
        acc[i][j].v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[i][j]), s, acc[i][j].v);
    }
  }
  cursor = next;
  finish_sums(acc, panel.bias, panel.scales, panel.columns, y, y_stride);
}

template <int R>
void vnni_tail_tile(int rows, const uint32_t* x, int64_t x_stride, const float* x_scales, int64_t s_stride,
                    const QuadPanel& panel, float* y, int64_t y_stride, PrefetchCursor<uint32_t>& next) {
  if constexpr (R > 0) {
    if (rows == R) return vnni_tile<R>(x, x_stride, x_scales, s_stride, panel, y, y_stride, next);
    vnni_tail_tile<R - 1>(rows, x, x_stride, x_scales, s_stride, panel, y, y_stride, next);
  }
}

// x [rows, K] fp32 quantized per row and block: quads [rows, blocks * kQuadsPerBlock] of q + 128 (zero
// past K is q = 0, stored 128) and scales [rows, blocks].
void quantize_rows(const at::Tensor& x, int64_t blocks, std::vector<uint32_t>& quads, std::vector<float>& scales) {
  const int64_t rows = x.size(0), in_features = x.size(1), stride = x.stride(0);
  const int64_t row_bytes = blocks * kBlock;
  quads.resize(static_cast<size_t>(rows * blocks * kQuadsPerBlock));
  scales.resize(static_cast<size_t>(rows * blocks));
  const float* src = x.data_ptr<float>();
  at::parallel_for(0, rows, kQuantizeGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      uint8_t* dst = reinterpret_cast<uint8_t*>(quads.data()) + r * row_bytes;
      const float* row = src + r * stride;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t first = b * kBlock, count = std::min<int64_t>(kBlock, in_features - first);
        const __mmask16 low = count >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1);
        const __mmask16 high =
            count <= 16 ? 0 : count >= 32 ? 0xFFFF : static_cast<__mmask16>((1u << (count - 16)) - 1);
        const __m512 v0 = _mm512_maskz_loadu_ps(low, row + first);
        const __m512 v1 = _mm512_maskz_loadu_ps(high, row + first + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const bool finite = !_mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) && !_mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q) &&
                            amax <= std::numeric_limits<float>::max();
        const float inv = finite && amax > 0.0f ? 127.0f / amax : 0.0f;
        // A NaN or infinite input makes the block's scale NaN, so the row's outputs are NaN, as the fp32
        // panels' would not be finite either.
        scales[r * blocks + b] = finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN();
        const __m512 m = _mm512_set1_ps(inv);
        const __m512i offset = _mm512_set1_epi32(kActivationOffset);
        const __m512i q0 = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v0, m)), offset);  // nearest even
        const __m512i q1 = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v1, m)), offset);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + first), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + first + 16), _mm512_cvtepi32_epi8(q1));
      }
    }
  });
}

void run_quad_panels(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& offsets, const float* bias,
                     int64_t bias_step, const float* scales, at::Tensor& y, int64_t out_features) {
  const int64_t rows = x.size(0), panels = packed.size(0), blocks = offsets.size(1);
  std::vector<uint32_t> x_quads;
  std::vector<float> x_scales;
  quantize_rows(x, blocks, x_quads, x_scales);
  const int64_t x_stride = blocks * kQuadsPerBlock;
  const int8_t* w_ptr = packed.data_ptr<int8_t>();
  const int32_t* o_ptr = offsets.data_ptr<int32_t>();
  float* y_ptr = y.data_ptr<float>();
  const int64_t panel_bytes = blocks * kQuadsPerBlock * kQuadRowBytes;
  for (int64_t first = 0; first < rows; first += kRowsPerPass) {
    const int64_t pass_rows = std::min(kRowsPerPass, rows - first);
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const QuadPanel panel{w_ptr + p * panel_bytes,
                              o_ptr + p * blocks * kPanelWidth,
                              bias + p * bias_step,
                              scales + p * kPanelWidth,
                              p + 1 < end ? w_ptr + (p + 1) * panel_bytes : nullptr,
                              blocks,
                              std::min<int64_t>(kPanelWidth, out_features - p * kPanelWidth)};
        const uint32_t* prefetch = reinterpret_cast<const uint32_t*>(panel.prefetch);
        const int64_t tiles = (pass_rows + kVnniTileRows - 1) / kVnniTileRows;
        PrefetchCursor<uint32_t> next(prefetch, blocks * kQuadsPerBlock, tiles);
        const uint32_t* x_pass = x_quads.data() + first * x_stride;
        const float* s_pass = x_scales.data() + first * blocks;
        float* y_pass = y_ptr + first * out_features + p * kPanelWidth;
        int64_t m = 0;
        for (; m + kVnniTileRows <= pass_rows; m += kVnniTileRows) {
          vnni_tile<kVnniTileRows>(x_pass + m * x_stride, x_stride, s_pass + m * blocks, blocks, panel,
                                   y_pass + m * out_features, out_features, next);
        }
        if (m < pass_rows) {
          vnni_tail_tile<kVnniTileRows - 1>(static_cast<int>(pass_rows - m), x_pass + m * x_stride, x_stride,
                                            s_pass + m * blocks, blocks, panel, y_pass + m * out_features,
                                            out_features, next);
        }
      }
    });
  }
}

#endif  // LORAPLEX_VNNI

}  // namespace

bool linear_vnni_available() {
#if LORAPLEX_VNNI
  static const bool available = __builtin_cpu_supports("avx512vnni");
  return available;
#else
  return false;
#endif
}

std::vector<at::Tensor> pack_linear_quads(const at::Tensor& weight) {
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.device().is_cpu(),
                    "pack_linear_quads: weight must be an int8 CPU tensor [out_features, in_features]");
  const at::Tensor w = weight.contiguous();
  const int64_t out_features = w.size(0), in_features = w.size(1);
  const int64_t panels = (out_features + kPanelWidth - 1) / kPanelWidth, blocks = blocks_of(in_features);
  const int64_t quads = blocks * kQuadsPerBlock;
  at::Tensor packed = at::zeros({panels, quads, kQuadRowBytes}, w.options());  // zero past N and K
  at::Tensor offsets = at::zeros({panels, blocks, kPanelWidth}, w.options().dtype(at::kInt));
  const int8_t* src = w.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  int32_t* off = offsets.data_ptr<int32_t>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t columns = std::min<int64_t>(kPanelWidth, out_features - p * kPanelWidth);
      int8_t* panel = dst + p * quads * kQuadRowBytes;
      for (int64_t c = 0; c < columns; ++c) {
        const int8_t* column = src + (p * kPanelWidth + c) * in_features;
        for (int64_t k = 0; k < in_features; ++k) {
          panel[(k / 4) * kQuadRowBytes + 4 * c + k % 4] = column[k];
          off[(p * blocks + k / kBlock) * kPanelWidth + c] -= kActivationOffset * column[k];
        }
      }
    }
  });
  return {packed, offsets};
}

at::Tensor linear_vnni(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& offsets,
                       const std::optional<at::Tensor>& bias, int64_t out_features, const at::Tensor& scales) {
  TORCH_CHECK_VALUE(linear_vnni_available(),
                    "linear_vnni: the native kernels have no AVX512-VNNI dot products here (the CPU lacks "
                    "avx512_vnni, or the library is built for another target); use the k-major panels of "
                    "pack_linear_weight");
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.stride(1) == 1,
                    "linear_vnni: x must be a float32 CPU tensor [num_rows, in_features] with contiguous rows");
  const int64_t rows = x.size(0), in_features = x.size(1);
  TORCH_CHECK_VALUE(packed.dim() == 3 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                        packed.size(2) == kQuadRowBytes && offsets.dim() == 3 &&
                        offsets.scalar_type() == at::kInt && offsets.is_contiguous() &&
                        offsets.size(0) == packed.size(0) && offsets.size(2) == kPanelWidth &&
                        packed.size(1) == offsets.size(1) * kQuadsPerBlock,
                    "linear_vnni: packed and offsets must come from pack_linear_quads of this build (panels of ",
                    kPanelWidth, " columns in k quads), got ", packed.sizes(), " and ", offsets.sizes());
  const int64_t panels = packed.size(0);
  TORCH_CHECK_VALUE(offsets.size(1) == blocks_of(in_features), "linear_vnni: x has ", in_features,
                    " features, the weight takes ", (offsets.size(1) - 1) * kBlock + 1, " to ",
                    offsets.size(1) * kBlock);
  TORCH_CHECK_VALUE(out_features > (panels - 1) * kPanelWidth && out_features <= panels * kPanelWidth,
                    "linear_vnni: out_features ", out_features, " does not match ", panels, " panels");
  check_bias_and_scales("linear_vnni", bias, scales, true, out_features);
  at::Tensor y = at::empty({rows, out_features}, x.options());  // [num_rows, out_features]
  if (rows == 0) return y;
#if LORAPLEX_VNNI
  const PanelBias panel_biases = panel_bias(bias, panels, x);  // every tile reads kPanelWidth values
  const at::Tensor scale_panels = pad_to_panels(scales, panels, x);
  run_quad_panels(x, packed, offsets, panel_biases.values, panel_biases.stride, scale_panels.data_ptr<float>(), y,
                  out_features);
#endif
  return y;
}

}  // namespace loraplex
