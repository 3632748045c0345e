// The paged attention's tiled path on AMX tiles: bf16 pages on a CPU with AMX-BF16, an item of many query
// vectors per kv head (prefill chunks), head_dim a multiple of 32. The products run on the tile unit with
// the query vectors and the softmax weights rounded to bf16 (the keys and values are bf16 already); the
// scores, the softmax and the sums stay fp32.
//
// Both products come out transposed, keys or dims x query vectors, so the softmax and its rescaling run
// down columns sixteen vectors at a time with full-width vector ops (the max, exp2 and sums of sixteen
// vectors in one instruction each) and no tile of weights needs transposing:
//   S^T[32 keys, 16 vectors] = K[32 keys, head_dim] . Q^T       (A: K rows copied from the pages; B: Q^T in
//                                                                pairs, built once per item)
//   acc^T[head_dim, 16 vectors] += V^T . P^T                     (A: V^T in key pairs, built once per block;
//                                                                B: P^T in pairs, as the softmax writes it;
//                                                                the sums tiles loaded from acc^T, stored back)
// Each kv head's vectors start at a multiple of 16 in scratch (padding vectors have no live key, so their
// weights are zero and they add nothing). Online softmax as the fp32 paths: running max and sum a vector,
// log2 units; the sum adds the weights as rounded to bf16, the values the product used.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <vector>

#include "amx_tiles.h"
#include "attention_common.h"
#include "bf16_pairs.h"

#if LORAPLEX_AMX

namespace loraplex::attention {

// Per-thread scratch of the AMX path; `vectors` counts padded vectors (each kv head's from a multiple of 16).
struct AmxScratch {
  uint16_t* queries;  // [vectors, head_dim] bf16: the item's query vectors, pre-scaled
  Bf16Pair* queries_t;  // [vectors / 16, head_dim / 32, 16 pairs, 16 vectors]: Q^T in B tiles
  float* acc_t;  // [head_dim, vectors]: running sums of p * V, transposed
  float* row_max;  // [vectors]
  float* row_sum;  // [vectors]
  uint16_t* keys;  // [32 keys, head_dim] bf16: a block's K rows of one kv head
  Bf16Pair* values_t;  // [head_dim / 16, 16 dims, 16 key pairs]: its V^T in A tiles
  float* scores_t;  // [32 keys, 16 vectors]: one group's scores, transposed
  Bf16Pair* weights_t;  // [16 key pairs, 16 vectors]: its softmax weights in pairs, a B tile
};

// r[i][j] -> r[j][i] for a 16 x 16 matrix of 32-bit lanes.
inline void transpose16(__m512i (&r)[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(_mm512_castsi512_ps(r[2 * i]), _mm512_castsi512_ps(r[2 * i + 1]));
    t[2 * i + 1] = _mm512_unpackhi_ps(_mm512_castsi512_ps(r[2 * i]), _mm512_castsi512_ps(r[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_f32x4(u[8 * i + j], u[8 * i + j + 4], 0x88);
      t[8 * i + j + 4] = _mm512_shuffle_f32x4(u[8 * i + j], u[8 * i + j + 4], 0xdd);
    }
  }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_castps_si512(_mm512_shuffle_f32x4(t[j], t[j + 8], 0x88));
    r[j + 8] = _mm512_castps_si512(_mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd));
  }
}

struct AmxTilePath {
  static constexpr int kKeys = 2 * kTileRows16;  // keys a block: two sums tiles of S^T
  static constexpr int kGroup = kTileRows16;  // query vectors a tile
  static constexpr int kChunk = 2 * kTileRows16;  // head_dim a tile row holds (16 pairs)

  static int64_t padded(int64_t vectors) { return (vectors + kGroup - 1) / kGroup * kGroup; }

  // 2^x for 16 lanes, as exp2_8 computes it (the same polynomial, so the same values); below kExp2Min (and
  // -inf) 0.
  static __m512 exp2_16(__m512 x) {
    const __mmask16 in_range = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExp2Min), _CMP_GE_OQ);
    const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExp2Min)), _mm512_set1_ps(kExp2Max));
    const __m512 n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 y = _mm512_mul_ps(_mm512_sub_ps(xc, n), _mm512_set1_ps(0.69314718055994531f));
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) {
      p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(c));
    }
    const __m512i exponent = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(in_range, p, _mm512_castsi512_ps(exponent));
  }

  // The item's query vectors (bf16, pre-scaled, `vectors` padded rows, zero rows included) as Q^T tiles.
  static void transpose_queries(const AmxScratch& sc, int64_t vectors, int head_dim) {
    const int chunks = head_dim / kChunk;
    const Bf16Pair* q = reinterpret_cast<const Bf16Pair*>(sc.queries);  // [vectors, head_dim / 2]
    for (int64_t g = 0; g < vectors / kGroup; ++g) {
      for (int c = 0; c < chunks; ++c) {
        Bf16Pair* tile = sc.queries_t + (g * chunks + c) * kTileRows16 * kGroup;
        for (int v = 0; v < kGroup; ++v) {
          const Bf16Pair* row = q + (g * kGroup + v) * (head_dim / 2) + c * kTileRows16;
          for (int kp = 0; kp < kTileRows16; ++kp) tile[kp * kGroup + v] = row[kp];
        }
      }
    }
  }

  // A block's K rows of one kv head into sc.keys, its V rows as V^T tiles in key pairs (a 16 x 16 transpose
  // of each 16 dims' pairs).
  template <typename KV>
  static void gather(const KV* const* rows, int64_t head_offset, int64_t v_offset, const AmxScratch& sc,
                     int head_dim) {
    for (int n = 0; n < kKeys; ++n) {
      std::memcpy(sc.keys + n * head_dim, rows[n] + head_offset, head_dim * sizeof(uint16_t));
    }
    for (int d = 0; d < head_dim; d += kTileRows16) {
      __m512i pairs[kTileRows16];  // row kp: dims d .. d + 15 of keys 2kp (low halves) and 2kp + 1
      for (int kp = 0; kp < kKeys / 2; ++kp) {
        const auto* even = reinterpret_cast<const __m256i*>(rows[2 * kp] + head_offset + v_offset + d);
        const auto* odd = reinterpret_cast<const __m256i*>(rows[2 * kp + 1] + head_offset + v_offset + d);
        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(even));
        const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(odd));
        pairs[kp] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
      }
      transpose16(pairs);  // row: one dim's 16 key pairs
      Bf16Pair* dst = sc.values_t + d * kTileRows16;
      for (int r = 0; r < kTileRows16; ++r) _mm512_storeu_si512(dst + r * kTileRows16, pairs[r]);
    }
  }

  // S^T of the group of 16 vectors at padded index m0 against the block's 32 keys, into sc.scores_t.
  static void scores(const AmxScratch& sc, int64_t m0, int head_dim) {
    const int chunks = head_dim / kChunk;
    const int64_t key_bytes = head_dim * static_cast<int64_t>(sizeof(uint16_t));
    _tile_zero(0);
    _tile_zero(1);
    for (int c = 0; c < chunks; ++c) {
      _tile_loadd(4, sc.queries_t + ((m0 / kGroup) * chunks + c) * kTileRows16 * kGroup, kTileBytes);
      _tile_loadd(2, sc.keys + c * kChunk, key_bytes);
      _tile_dpbf16ps(0, 2, 4);
      _tile_loadd(3, sc.keys + kTileRows16 * head_dim + c * kChunk, key_bytes);
      _tile_dpbf16ps(1, 3, 4);
    }
    _tile_stored(0, sc.scores_t, kTileBytes);
    _tile_stored(1, sc.scores_t + kTileRows16 * kGroup, kTileBytes);
  }

  // The group's online softmax over the block: `last` holds each vector's last visible key position (-1
  // for padding), j0 the block's first. Rescales the group's columns of acc^T (`vectors` wide), advances
  // row_max and row_sum, and leaves the weights as a B tile in sc.weights_t.
  static void softmax(const AmxScratch& sc, int64_t m0, int64_t vectors, __m512i last, int j0, int head_dim) {
    const __m512 old_max = _mm512_loadu_ps(sc.row_max + m0);
    __m512 block_max = _mm512_set1_ps(kNegInf);
    __mmask16 live[kKeys];
    for (int n = 0; n < kKeys; ++n) {
      live[n] = _mm512_cmp_epi32_mask(_mm512_set1_epi32(j0 + n), last, _MM_CMPINT_LE);
      block_max = _mm512_mask_max_ps(block_max, live[n], block_max, _mm512_loadu_ps(sc.scores_t + n * kGroup));
    }
    const __m512 new_max = _mm512_max_ps(old_max, block_max);
    // A vector with no live key so far keeps max -inf: subtract 0 there, so exp2 sees -inf and gives 0.
    const __mmask16 seen = _mm512_cmp_ps_mask(new_max, _mm512_set1_ps(kNegInf), _CMP_NEQ_OQ);
    const __m512 base = _mm512_maskz_mov_ps(seen, new_max);
    const __m512 alpha = _mm512_mask_blend_ps(seen, _mm512_set1_ps(1.0f), exp2_16(_mm512_sub_ps(old_max, base)));
    __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(sc.row_sum + m0), alpha);
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int kp = 0; kp < kKeys / 2; ++kp) {
      const __m512 even = _mm512_maskz_mov_ps(
          live[2 * kp], exp2_16(_mm512_sub_ps(_mm512_loadu_ps(sc.scores_t + 2 * kp * kGroup), base)));
      const __m512 odd = _mm512_maskz_mov_ps(
          live[2 * kp + 1], exp2_16(_mm512_sub_ps(_mm512_loadu_ps(sc.scores_t + (2 * kp + 1) * kGroup), base)));
      // lanes 0-15 the even key's bf16, 16-31 the odd key's; interleaved: vector v's pair in 32-bit lane v
      const __m512i pairs = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(odd, even));
      _mm512_storeu_si512(sc.weights_t + kp * kGroup, pairs);
      sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)));  // the even weight, rounded
      sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(-65536))));
    }
    _mm512_storeu_ps(sc.row_sum + m0, sum);
    _mm512_storeu_ps(sc.row_max + m0, new_max);
    if (_mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.0f), _CMP_NEQ_OQ) != 0) {
      for (int d = 0; d < head_dim; ++d) {
        float* acc = sc.acc_t + d * vectors + m0;
        _mm512_storeu_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(acc), alpha));
      }
    }
  }

  // acc^T's columns m0 .. m0 + 15 (`vectors` wide) += V^T . P^T on the block's value tiles.
  static void accumulate(const AmxScratch& sc, int64_t m0, int64_t vectors, int head_dim) {
    const int64_t acc_bytes = vectors * static_cast<int64_t>(sizeof(float));
    constexpr int64_t kTilePairs = kTileRows16 * kTileRows16;
    _tile_loadd(4, sc.weights_t, kTileBytes);
    for (int d0 = 0; d0 < head_dim; d0 += 4 * kTileRows16) {  // four sums tiles of 16 dims at a time
      float* acc = sc.acc_t + d0 * vectors + m0;
      const Bf16Pair* values = sc.values_t + d0 * kTileRows16;
      const int tiles = std::min(4, (head_dim - d0) / kTileRows16);
      const int64_t next_dims = kTileRows16 * vectors;
      _tile_loadd(0, acc, acc_bytes);
      _tile_loadd(5, values, kTileBytes);
      _tile_dpbf16ps(0, 5, 4);
      _tile_stored(0, acc, acc_bytes);
      if (tiles > 1) {
        _tile_loadd(1, acc + next_dims, acc_bytes);
        _tile_loadd(6, values + kTilePairs, kTileBytes);
        _tile_dpbf16ps(1, 6, 4);
        _tile_stored(1, acc + next_dims, acc_bytes);
      }
      if (tiles > 2) {
        _tile_loadd(2, acc + 2 * next_dims, acc_bytes);
        _tile_loadd(5, values + 2 * kTilePairs, kTileBytes);
        _tile_dpbf16ps(2, 5, 4);
        _tile_stored(2, acc + 2 * next_dims, acc_bytes);
      }
      if (tiles > 3) {
        _tile_loadd(3, acc + 3 * next_dims, acc_bytes);
        _tile_loadd(6, values + 3 * kTilePairs, kTileBytes);
        _tile_dpbf16ps(3, 6, 4);
        _tile_stored(3, acc + 3 * next_dims, acc_bytes);
      }
    }
  }
};

// A thread's state for the AMX path: its scratch, sized for items of up to `max_vectors` query vectors over
// `num_kv_heads` kv heads (each head's padded to a multiple of 16), and the tile configuration, loaded while
// it lives (a thread switched out after it saves no tile state).
class AmxThread {
 public:
  AmxThread(int max_vectors, int num_kv_heads, int head_dim) {
    const int64_t vectors = AmxTilePath::padded(max_vectors) + int64_t{AmxTilePath::kGroup} * num_kv_heads;
    const int64_t keys = AmxTilePath::kKeys, group = AmxTilePath::kGroup;
    // floats of each part, in AmxScratch's order
    const int64_t parts[] = {vectors * head_dim / 2, vectors * head_dim / 2, vectors * head_dim, vectors, vectors,
                             keys * head_dim / 2, keys / 2 * head_dim, keys * group, keys / 2 * group};
    int64_t floats = kLineFloats;  // room to align the first part
    for (const int64_t part : parts) floats += lines(part);
    buffer_.resize(floats);
    float* next = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer_.data()) + 63) / 64 * 64);
    float* taken[std::size(parts)];
    for (size_t i = 0; i < std::size(parts); ++i) {
      taken[i] = next;
      next += lines(parts[i]);
    }
    scratch_ = {reinterpret_cast<uint16_t*>(taken[0]), reinterpret_cast<Bf16Pair*>(taken[1]), taken[2], taken[3],
                taken[4], reinterpret_cast<uint16_t*>(taken[5]), reinterpret_cast<Bf16Pair*>(taken[6]), taken[7],
                reinterpret_cast<Bf16Pair*>(taken[8])};  // the parts in AmxScratch's order
    load_full_tiles(kTilesUsed);
  }
  ~AmxThread() { _tile_release(); }
  AmxThread(const AmxThread&) = delete;
  AmxThread& operator=(const AmxThread&) = delete;

  const AmxScratch& scratch() const { return scratch_; }

 private:
  static constexpr int64_t kLineFloats = 16;
  static constexpr int kTilesUsed = 7;  // tmm0-6
  static int64_t lines(int64_t floats) { return (floats + kLineFloats - 1) / kLineFloats * kLineFloats; }

  std::vector<float> buffer_;
  AmxScratch scratch_{};
};

// One item on the tile unit, as attend() in paged_attention.cpp does it on fp32 vectors: its kv heads'
// query vectors (each head's padded to a multiple of 16) against every key they see, 32 keys at a time.
// Runs on a thread that holds an AmxThread.
inline void attend_amx(const Problem& pb, const WorkItem& item, const AmxScratch& sc) {
  using KV = c10::BFloat16;
  constexpr int kKeys = AmxTilePath::kKeys, kGroup = AmxTilePath::kGroup;
  const int group = pb.group, head_dim = pb.head_dim;
  const int q_begin = pb.query_start_loc[item.seq];
  const int q_len = pb.query_start_loc[item.seq + 1] - q_begin;
  const int num_rows = item.row_end - item.row_begin;
  const int num_heads = item.kv_head_end - item.kv_head_begin;
  const int vectors_per_head = num_rows * group;  // vector r * group + g of each head
  const int64_t head_stride = AmxTilePath::padded(vectors_per_head);
  const int64_t vectors = num_heads * head_stride;
  const int first_pos = pb.seq_lens[item.seq] - q_len + item.row_begin;
  const int last_pos = first_pos + num_rows - 1;
  const auto vector_of = [&](int h, int r, int g) { return h * head_stride + r * group + g; };

  std::fill(sc.queries, sc.queries + vectors * head_dim, uint16_t{0});
  for (int h = 0; h < num_heads; ++h) {
    for (int r = 0; r < num_rows; ++r) {
      const float* row = pb.q + static_cast<int64_t>(q_begin + item.row_begin + r) * pb.q_token_stride;
      for (int g = 0; g < group; ++g) {
        const int head = (item.kv_head_begin + h) * group + g;
        float* scaled = sc.acc_t;  // scratch until the sums start
        scale_copy(scaled, row + static_cast<int64_t>(head) * pb.q_head_stride, pb.scale_log2, head_dim);
        round_row(scaled, sc.queries + vector_of(h, r, g) * head_dim, head_dim);
      }
    }
  }
  AmxTilePath::transpose_queries(sc, vectors, head_dim);
  reset_sums(sc.acc_t, sc.row_max, sc.row_sum, vectors, head_dim);  // acc^T: the same floats, transposed

  const auto block = [&](int j0, const KV* const* k_rows) {
    const int r_first = std::max(0, j0 - first_pos);  // rows before position j0 see none of these keys
    for (int h = 0; h < num_heads; ++h) {
      AmxTilePath::gather(k_rows, static_cast<int64_t>(item.kv_head_begin + h) * head_dim, pb.v_offset, sc, head_dim);
      const int64_t head_first = h * head_stride;
      for (int64_t m0 = head_first + r_first * group / kGroup * kGroup; m0 < head_first + vectors_per_head;
           m0 += kGroup) {
        alignas(64) int32_t last[kGroup];  // each vector's last visible position; -1 for padding
        for (int v = 0; v < kGroup; ++v) {
          const int64_t local = m0 - head_first + v;
          last[v] = local < vectors_per_head ? first_pos + static_cast<int>(local) / group : -1;
        }
        AmxTilePath::scores(sc, m0, head_dim);
        AmxTilePath::softmax(sc, m0, vectors, _mm512_load_si512(last), j0, head_dim);
        AmxTilePath::accumulate(sc, m0, vectors, head_dim);
      }
    }
  };
  walk_key_blocks<kKeys, KV>(pb, item, last_pos, block);

  // out = acc^T's columns / row_sum, transposed back 16 vectors x 16 dims at a time
  for (int h = 0; h < num_heads; ++h) {
    for (int local0 = 0; local0 < vectors_per_head; local0 += kGroup) {
      const int64_t m0 = h * head_stride + local0;
      const int count = std::min(kGroup, vectors_per_head - local0);
      for (int d = 0; d < head_dim; d += kTileRows16) {
        __m512i sums[kTileRows16];  // row: one dim of the 16 vectors
        for (int i = 0; i < kTileRows16; ++i) sums[i] = _mm512_loadu_si512(sc.acc_t + (d + i) * vectors + m0);
        transpose16(sums);  // row: one vector's 16 dims
        for (int v = 0; v < count; ++v) {
          const int local = local0 + v, r = local / group, g = local % group;
          const int head = (item.kv_head_begin + h) * group + g;
          const int64_t token = q_begin + item.row_begin + r;
          float* dst = pb.out + (token * pb.num_heads + head) * head_dim + d;
          const __m512 inverse = _mm512_set1_ps(1.0f / sc.row_sum[m0 + v]);
          _mm512_storeu_ps(dst, _mm512_mul_ps(_mm512_castsi512_ps(sums[v]), inverse));
        }
      }
    }
  }
}

}  // namespace loraplex::attention

#endif  // LORAPLEX_AMX
