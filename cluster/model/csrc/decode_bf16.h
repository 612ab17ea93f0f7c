// Decode attention's scores for a bfloat16 cache where the CPU has AVX512-BF16 (`decode_attention.cpp`):
// pair products (`vdpbf16ps`) of the query and the raw key rows, which need no widening.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

#include "cache_rows.h"
#include "vec.h"

#if defined(__AVX512BF16__)
namespace tandem::bf16 {

constexpr int64_t kTile = 16;  // positions scored together, one score lane each

// Sixteen vectors -> one: lane j holds the sum of v[j]'s lanes. Pairs, then quads, are summed within
// each 128-bit lane, then the four lanes are summed across.
inline __m512 sum16(const __m512* v) {
  __m512 pairs[8], quads[4];
  for (int j = 0; j < 8; ++j)
    pairs[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {
    const __m512d a = _mm512_castps_pd(pairs[2 * j]), b = _mm512_castps_pd(pairs[2 * j + 1]);
    quads[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // quads[k]'s 128-bit lane L holds v[4k..4k+3]'s sums over their lane L.
  const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88), _mm512_shuffle_f32x4(quads[0], quads[1], 0xdd));
  const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88), _mm512_shuffle_f32x4(quads[2], quads[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, 0x88), _mm512_shuffle_f32x4(x01, x23, 0xdd));
}

// `score` for bfloat16 keys with head_dim 32 * Vectors: pair products of the raw rows (AVX512-BF16),
// which need no widening. A tile of sixteen positions at a time, one query head after another: the
// sixteen positions' products are sixteen independent sums (a query head's products one after another
// would wait on each other's latency), and `sum16` turns them into the tile's sixteen scores at once.
// The tile's key rows stay in the first-level cache for the query heads that share them.
template <int Vectors>
void score_bf16(const PlainRows<c10::BFloat16>& keys, const int64_t* rows, int64_t n, const float* qf,
                int64_t kv_heads, int64_t groups, float scale, float* scores, int64_t stride) {
  constexpr int64_t dim = 32 * Vectors;
  const int64_t position_bytes = kv_heads * keys.stride_bytes();
  const __m512 scale16 = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < std::min(n, kTile); ++i) prefetch_row(keys, rows[i], position_bytes);
  for (int64_t i0 = 0; i0 < n; i0 += kTile) {
    const int64_t m = std::min(kTile, n - i0);
    for (int64_t i = i0 + kTile; i < std::min(n, i0 + 2 * kTile); ++i) prefetch_row(keys, rows[i], position_bytes);
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t qh = h * groups; qh < (h + 1) * groups; ++qh) {
        __m512bh q[Vectors];  // the query back in bfloat16 (exact: it came from it)
        for (int v = 0; v < Vectors; ++v)
          q[v] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(qf + qh * dim + 32 * v + 16), _mm512_loadu_ps(qf + qh * dim + 32 * v));
        __m512 dots[kTile];
        for (int p = 0; p < kTile; ++p) {  // past the end, the last position again (its score is not stored)
          const c10::BFloat16* r = keys.row(rows[i0 + std::min<int64_t>(p, m - 1)] + h);
          dots[p] = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], (__m512bh)_mm512_loadu_si512(r));
          for (int v = 1; v < Vectors; ++v) dots[p] = _mm512_dpbf16_ps(dots[p], q[v], (__m512bh)_mm512_loadu_si512(r + 32 * v));
        }
        const __mmask16 lanes = static_cast<__mmask16>((1u << m) - 1);
        _mm512_mask_storeu_ps(scores + qh * stride + i0, lanes, _mm512_mul_ps(sum16(dots), scale16));
      }
  }
}

}  // namespace tandem::bf16
#endif
