// What linear_amx.cpp's GEMM on AMX tiles needs besides its own code: whether this build compiles it
// (LORAPLEX_AMX: a -march with AMX-BF16, and AVX512-BF16 as every such CPU has), and the tile
// configuration it loads. Every register it uses is 16 rows of 64 bytes: 16 rows x 16 bf16 pairs, or 16 rows x 16 fp32 sums.
#pragma once

#include <cstdint>

#include "vec_wide.h"

#if LORAPLEX_AVX512 && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define LORAPLEX_AMX 1
#include <immintrin.h>
#else
#define LORAPLEX_AMX 0
#endif

namespace loraplex {

#if LORAPLEX_AMX

constexpr int kTileRows16 = 16;  // rows of a tile: 16 rows of inputs or sums, or 16 k pairs of a weight tile
constexpr int kTileBytes = 64;   // bytes of a tile row: 16 pairs, or 16 fp32 sums

// The layout _tile_loadconfig reads (palette 1): each register's rows and bytes a row.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Configures this thread's tmm0 .. tmm(count - 1) as 16 rows of 64 bytes (the rest unused).
inline void load_full_tiles(int count) {
  TileConfig config;
  for (int t = 0; t < count; ++t) {
    config.rows[t] = kTileRows16;
    config.bytes_per_row[t] = kTileBytes;
  }
  // GCC does not count ldtilecfg's read of the config as a use of it and may drop the stores above (an
  // invalid config then faults): the empty asm, which may read any memory, keeps them.
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

#endif  // LORAPLEX_AMX

}  // namespace loraplex
