// A prompt chunk's products on AMX tiles, y = x @ W^T in bfloat16: tens to hundreds of rows against
// weights packed once (`tile_pack`) into the layout the tiles' multiply reads.
//
// oneDNN runs these products on the same tiles, from its own packed layout. Here a thread takes 32
// output columns at a time: two row tiles by two column tiles of sums, the weight tiles asked for a
// few steps ahead of their loads, then kept in cache for the other row tiles.
//
// Packed layout, [n / 16, k / 32, 16, 32] bfloat16 (n and k multiples of 32): tile (j, b) holds
// output columns 16j to 16j + 15 over input columns 32b to 32b + 31, as `tdpbf16ps` reads its second
// operand: row r holds input columns 32b + 2r and 32b + 2r + 1 of the sixteen weight rows, pair after
// pair. A tile is 1 KB, and a column range's tiles follow one another, so the weights are read in one
// sequential stream.
//
// `tile_linear` multiplies through the tiles where it can (`amx`: the kernels built with AVX512-BF16,
// a CPU with AMX tiles, and their state granted by Linux), else through plain loops over the same
// layout, which check its arithmetic on every CPU. Included by `skinny_linear.cpp`, which registers
// the ops; `prefill_attention.cpp` runs its own products on the tiles through `amx`,
// `configure_tiles` and `release_tiles`.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512BF16__) && defined(__linux__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define TANDEM_TILES 1
#endif

#include "vec.h"

namespace tandem::tiles {

constexpr int64_t kCols = 16;   // output columns a tile covers
constexpr int64_t kDepth = 32;  // input columns a tile covers (16 pairs)
constexpr int64_t kRows = 16;   // input rows a tile covers
constexpr int64_t kLine = 64;
// Steps of the depth loop ahead that the weight tiles are asked for: left to the hardware, each tile
// load waits on memory and the tiles' multiplies wait on it (16 rows, 30 layers: 30.7 ms a pass,
// 22.0 with the hints, one thread). Past a range's last tile they ask for the next range's first.
constexpr int64_t kAhead = 4;

// `weight` [n, k] in bfloat16, packed as the tiles read it (see above).
inline at::Tensor tile_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "tile_pack takes a bfloat16 weight [n, k]");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % (2 * kCols) == 0 && k % kDepth == 0, "tile_pack takes n a multiple of ", 2 * kCols, " and k of ", kDepth,
              ", not [", n, ", ", k, "]");
  const at::Tensor w = weight.contiguous();
  at::Tensor packed = at::empty({n / kCols, k / kDepth, kDepth / 2, 2 * kCols}, w.options());
  const auto* src = w.data_ptr<c10::BFloat16>();
  auto* dst = packed.data_ptr<c10::BFloat16>();
  at::parallel_for(0, n / kCols, 1, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j)
      for (int64_t b = 0; b < k / kDepth; ++b) {
        c10::BFloat16* tile = dst + (j * (k / kDepth) + b) * kCols * kDepth;
        for (int64_t r = 0; r < kDepth / 2; ++r)
          for (int64_t c = 0; c < kCols; ++c)
            for (int64_t e = 0; e < 2; ++e) tile[r * 2 * kCols + 2 * c + e] = src[(j * kCols + c) * k + b * kDepth + 2 * r + e];
      }
  });
  return packed;
}

#if defined(TANDEM_TILES)
// Whether this process may use the tiles: the CPU has them (CPUID leaf 7: AMX-BF16, AMX-TILE), Linux
// grants their state on request (asked once), and TANDEM_CPU_TILES is not 0 (the tests run the other
// paths on such a CPU that way).
inline bool tiles_granted() {
  static const bool granted = [] {
    const char* wanted = std::getenv("TANDEM_CPU_TILES");
    if (wanted != nullptr && std::string(wanted) == "0") return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return false;
    constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kTileData = 18;               // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-7 of 16 rows of 64 bytes, for this thread. The configuration is a constant built once: GCC
// 12 has dropped the stores of a configuration built on the stack just before `ldtilecfg` read it.
__attribute__((target("amx-tile"))) inline void configure_tiles() {
  static const TileConfig config = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.colsb[t] = kLine;
      c.rows[t] = kRows;
    }
    return c;
  }();
  _tile_loadconfig(&config);
}

// Gives this thread's tile state back (configured again by `configure_tiles` before the next use).
__attribute__((target("amx-tile"))) inline void release_tiles() { _tile_release(); }

// Output columns [32 j0, 32 j1) (pairs of 16-column tiles) for every row of `x` (`rows_padded` rows,
// a multiple of 16, zero past `rows`): two row tiles by two column tiles at a time, the four sums in
// tiles 0-3, the row tiles in 4-5, the weight tiles in 6-7.
__attribute__((target("amx-tile,amx-bf16"))) inline void tile_columns(const c10::BFloat16* x, int64_t rows,
                                                                      int64_t rows_padded, int64_t k,
                                                                      const c10::BFloat16* packed, int64_t j0,
                                                                      int64_t j1, c10::BFloat16* y, int64_t n) {
  configure_tiles();
  const int64_t depth = k / kDepth, tile_elems = kCols * kDepth, x_stride = k * 2;
  alignas(64) float sums[2 * kRows][2 * kCols];
  for (int64_t j = j0; j < j1; ++j) {
    const c10::BFloat16* w0 = packed + 2 * j * depth * tile_elems;
    const c10::BFloat16* w1 = w0 + depth * tile_elems;
    for (int64_t m = 0; m < rows_padded; m += 2 * kRows) {
      const bool two = m + kRows < rows_padded;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t b = 0; b < depth; ++b) {
        if (m == 0)  // the first row pair asks for the tiles kAhead steps on; the others find them in cache
          for (int64_t line = 0; line < tile_elems * 2; line += kLine) {
            _mm_prefetch(reinterpret_cast<const char*>(w0 + (b + kAhead) * tile_elems) + line, _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(w1 + (b + kAhead) * tile_elems) + line, _MM_HINT_T0);
          }
        _tile_loadd(6, w0 + b * tile_elems, kLine);
        _tile_loadd(7, w1 + b * tile_elems, kLine);
        _tile_loadd(4, x + m * k + b * kDepth, x_stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
          _tile_loadd(5, x + (m + kRows) * k + b * kDepth, x_stride);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, &sums[0][0], sizeof(sums[0]));
      _tile_stored(1, &sums[0][kCols], sizeof(sums[0]));
      if (two) {
        _tile_stored(2, &sums[kRows][0], sizeof(sums[0]));
        _tile_stored(3, &sums[kRows][kCols], sizeof(sums[0]));
      }
      for (int64_t r = 0; r < std::min(2 * kRows, rows - m); ++r) {
        const __m256bh out = _mm512_cvtneps_pbh(_mm512_load_ps(&sums[r][0]));
        const __m256bh out2 = _mm512_cvtneps_pbh(_mm512_load_ps(&sums[r][kCols]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (m + r) * n + 2 * j * kCols), (__m256i)out);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (m + r) * n + (2 * j + 1) * kCols), (__m256i)out2);
      }
    }
  }
  release_tiles();
}
#endif

// Plain loops over the packed layout: the tiles' arithmetic (float32 sums of bfloat16 products,
// rounded to bfloat16 once), column tiles [j0, j1).
inline void plain_columns(const c10::BFloat16* x, int64_t rows, int64_t k, const c10::BFloat16* packed, int64_t j0,
                          int64_t j1, c10::BFloat16* y, int64_t n) {
  const int64_t depth = k / kDepth;
  std::vector<float> sums(kCols);
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t m = 0; m < rows; ++m) {
      std::fill(sums.begin(), sums.end(), 0.f);
      for (int64_t b = 0; b < depth; ++b) {
        const c10::BFloat16* tile = packed + (j * depth + b) * kCols * kDepth;
        for (int64_t r = 0; r < kDepth / 2; ++r)
          for (int64_t c = 0; c < kCols; ++c)
            for (int64_t e = 0; e < 2; ++e)
              sums[c] += widen(x[m * k + b * kDepth + 2 * r + e]) * widen(tile[r * 2 * kCols + 2 * c + e]);
      }
      for (int64_t c = 0; c < kCols; ++c) y[m * n + j * kCols + c] = c10::BFloat16(sums[c]);
    }
}

// Whether `tile_linear` runs on the tiles here.
inline bool amx() {
#if defined(TANDEM_TILES)
  return tiles_granted();
#else
  return false;
#endif
}

// x [rows, k] @ W^T for W packed by `tile_pack` ([n / 16, k / 32, 16, 32]): y [rows, n], bfloat16.
inline at::Tensor tile_linear(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "tile_linear takes bfloat16 x [rows, k]");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.size(0) % 2 == 0 &&
                  packed.size(2) == kDepth / 2 && packed.size(3) == 2 * kCols && packed.is_contiguous(),
              "tile_linear takes a weight packed by tile_pack [n / ", kCols, ", k / ", kDepth, ", ", kDepth / 2, ", ",
              2 * kCols, "]");
  TORCH_CHECK(x.size(1) == packed.size(1) * kDepth, "tile_linear: x has ", x.size(1), " columns, the weight ",
              packed.size(1) * kDepth);
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "tile_linear runs on CPU tensors");
  const int64_t rows = x.size(0), k = x.size(1), n = packed.size(0) * kCols;
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return y;
  const auto* wp = packed.data_ptr<c10::BFloat16>();
  auto* yp = y.data_ptr<c10::BFloat16>();
#if defined(TANDEM_TILES)
  if (amx()) {
    // rows up to a whole tile, zero past the last (copied here: torch's cat and zeros cost 20 µs a call)
    const int64_t padded = (rows + kRows - 1) / kRows * kRows;
    at::Tensor xp = x.contiguous();
    if (padded != rows) {
      at::Tensor whole = at::empty({padded, k}, x.options());
      auto* dst = whole.data_ptr<c10::BFloat16>();
      std::memcpy(dst, xp.data_ptr<c10::BFloat16>(), rows * k * sizeof(c10::BFloat16));
      std::memset(dst + rows * k, 0, (padded - rows) * k * sizeof(c10::BFloat16));
      xp = whole;
    }
    const auto* xd = xp.data_ptr<c10::BFloat16>();
    at::parallel_for(0, n / (2 * kCols), 1, [&](int64_t j0, int64_t j1) {
      tile_columns(xd, rows, padded, k, wp, j0, j1, yp, n);
    });
    return y;
  }
#endif
  const at::Tensor xc = x.contiguous();
  const auto* xd = xc.data_ptr<c10::BFloat16>();
  at::parallel_for(0, n / kCols, 1, [&](int64_t j0, int64_t j1) { plain_columns(xd, rows, k, wp, j0, j1, yp, n); });
  return y;
}

}  // namespace tandem::tiles
