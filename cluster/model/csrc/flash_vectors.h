// Flash attention in float32 vectors for one sequence's prompt chunk over a paged float32, bfloat16
// or float16 cache (AVX2 or AVX-512, `vec.h`): `prefill_attention.cpp`'s kernel for every float cache
// without its own (all but bfloat16 on AVX512-BF16), with or without a sliding window.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "vec.h"

#if defined(TANDEM_SIMD)
namespace tandem {

// Flash attention in float32 vectors, for any float cache: as `prefill_attention.cpp`'s AVX512-BF16
// `flash_sequence` (a task is one KV head and kRowBlock query positions of its query heads, walking
// key blocks with an online softmax), with keys packed per head as [key block][dim][kKeys] floats (a
// vector holds one dim of kLanes consecutive keys) and values as [key][dim] floats. Both products are
// register-tiled: four rows by two vectors of keys (scores) or of dims (output) at a time.
namespace generic {
using namespace simd;

constexpr int64_t kRowBlock = 32;       // query positions per task
constexpr int64_t kKeys = 4 * kLanes;   // keys per step of the walk
constexpr int kTileRows = 4;            // rows per micro-kernel
constexpr int64_t kTileCols = 2 * kLanes;  // keys (scores) or dims (output) per micro-kernel

template <typename T>
void pack_head(const T* k_cache, const T* v_cache, const int64_t* table, int64_t block_size, int64_t kv_heads,
               int64_t h, int64_t dim, int64_t ctx, int64_t padded, float* kt, float* vr) {
  std::fill(kt, kt + padded * dim, 0.f);
  std::fill(vr, vr + padded * dim, 0.f);
  for (int64_t j = 0; j < ctx; ++j) {
    const int64_t row = ((table[j / block_size] * block_size + j % block_size) * kv_heads + h) * dim;
    float* kb = kt + (j / kKeys) * dim * kKeys + j % kKeys;
    for (int64_t d = 0; d < dim; ++d) {
      kb[d * kKeys] = widen(k_cache[row + d]);
      vr[j * dim + d] = widen(v_cache[row + d]);
    }
  }
}

// s[r][c] = <q[r], key c> for four rows and 2 * kLanes keys of a packed block (`kt`, from key c0).
inline void score_tile(const float* q, int64_t dim, const float* kt, int64_t c0, float* s) {
  vfloat acc[kTileRows][2];
  for (int r = 0; r < kTileRows; ++r) acc[r][0] = acc[r][1] = vzero();
  for (int64_t d = 0; d < dim; ++d) {
    const vfloat k0 = vload(kt + d * kKeys + c0), k1 = vload(kt + d * kKeys + c0 + kLanes);
    for (int r = 0; r < kTileRows; ++r) {
      const vfloat x = vset1(q[r * dim + d]);
      acc[r][0] = vfmadd(x, k0, acc[r][0]);
      acc[r][1] = vfmadd(x, k1, acc[r][1]);
    }
  }
  for (int r = 0; r < kTileRows; ++r) {
    vstore(s + r * kKeys + c0, acc[r][0]);
    vstore(s + r * kKeys + c0 + kLanes, acc[r][1]);
  }
}

// o[r][d0, d0 + 2 kLanes) += sum over the block's keys c of p[r][c] * value c, four rows.
inline void output_tile(const float* p, const float* v, int64_t dim, int64_t d0, float* o) {
  vfloat acc[kTileRows][2];
  for (int r = 0; r < kTileRows; ++r) {
    acc[r][0] = vload(o + r * dim + d0);
    acc[r][1] = vload(o + r * dim + d0 + kLanes);
  }
  for (int64_t c = 0; c < kKeys; ++c) {
    const vfloat v0 = vload(v + c * dim + d0), v1 = vload(v + c * dim + d0 + kLanes);
    for (int r = 0; r < kTileRows; ++r) {
      const vfloat w = vset1(p[r * kKeys + c]);
      acc[r][0] = vfmadd(w, v0, acc[r][0]);
      acc[r][1] = vfmadd(w, v1, acc[r][1]);
    }
  }
  for (int r = 0; r < kTileRows; ++r) {
    vstore(o + r * dim + d0, acc[r][0]);
    vstore(o + r * dim + d0 + kLanes, acc[r][1]);
  }
}

// One row's online-softmax step over a block of kKeys scores, of which [first, end) are seen: raises
// the running maximum (rescaling the running sum and output row to it) and turns the scores into
// weights.
inline void softmax_row(float* s, int64_t first, int64_t end, float* top, float* sum, float* o, int64_t dim) {
  first = std::clamp<int64_t>(first, 0, kKeys);
  end = std::clamp<int64_t>(end, first, kKeys);
  float block_top = -std::numeric_limits<float>::infinity();
  for (int64_t c = first; c < end; ++c) block_top = std::max(block_top, s[c]);
  const float new_top = std::max(*top, block_top);
  std::fill(s, s + first, 0.f);  // unseen keys weigh exactly zero
  std::fill(s + end, s + kKeys, 0.f);
  if (new_top == -std::numeric_limits<float>::infinity()) return;  // nothing seen yet
  const float rescale = *top == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(*top - new_top);
  const vfloat tops = vset1(new_top);
  vfloat sums = vzero();
  int64_t c = first;
  for (; c + kLanes <= end; c += kLanes) {
    const vfloat e = vexp_nonpositive(vsub(vload(s + c), tops));
    vstore(s + c, e);
    sums = vadd(sums, e);
  }
  float total = vsum(sums);
  for (; c < end; ++c) {
    s[c] = tandem::exp_nonpositive(s[c] - new_top);
    total += s[c];
  }
  *sum = *sum * rescale + total;
  *top = new_top;
  if (rescale != 1.f)
    for (int64_t d = 0; d < dim; ++d) o[d] *= rescale;
}

// One sequence's queries at positions [cached, cached + n) over its keys; with a `window`, a query
// at position p sees the keys in (p - window, p], else all up to p.
// Queries and output in T, the cache in C (T, or a 16-bit type under float32 queries).
template <typename T, typename C>
void flash_sequence(const T* q, const C* k_cache, const C* v_cache, const int64_t* table, int64_t block_size,
                    int64_t n, int64_t cached, int64_t heads, int64_t kv_heads, int64_t dim, float scale,
                    std::optional<int64_t> window, T* out) {
  const int64_t ctx = cached + n, padded = (ctx + kKeys - 1) / kKeys * kKeys;
  const int64_t groups = heads / kv_heads, q_blocks = (n + kRowBlock - 1) / kRowBlock;
  std::vector<float> kt(kv_heads * padded * dim), vr(kv_heads * padded * dim);
  at::parallel_for(0, kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h)
      pack_head(k_cache, v_cache, table, block_size, kv_heads, h, dim, ctx, padded, &kt[h * padded * dim],
                &vr[h * padded * dim]);
  });
  const int64_t max_rows = (groups * kRowBlock + kTileRows - 1) / kTileRows * kTileRows;
  at::parallel_for(0, kv_heads * q_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(max_rows * dim), s(max_rows * kKeys), o(max_rows * dim), top(max_rows), sum(max_rows);
    std::vector<int64_t> position(max_rows);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / q_blocks, first = task % q_blocks * kRowBlock;
      const int64_t nq = std::min(kRowBlock, n - first), rows = groups * nq;
      const int64_t padded_rows = (rows + kTileRows - 1) / kTileRows * kTileRows;
      for (int64_t r = 0; r < padded_rows; ++r) {  // row r: query head h * groups + r / nq, position r % nq
        position[r] = r < rows ? cached + first + r % nq : -1;
        const T* src = q + ((first + r % nq) * heads + h * groups + r / nq) * dim;
        for (int64_t d = 0; d < dim; ++d) qf[r * dim + d] = r < rows ? widen(src[d]) * scale : 0.f;
      }
      std::fill(o.begin(), o.end(), 0.f);
      std::fill(top.begin(), top.end(), -std::numeric_limits<float>::infinity());
      std::fill(sum.begin(), sum.end(), 0.f);
      const float* kh = &kt[h * padded * dim];
      const float* vh = &vr[h * padded * dim];
      const int64_t last = cached + first + nq - 1;  // the task's last position: keys past it are unseen
      const int64_t earliest = window ? std::max<int64_t>(0, cached + first - *window + 1) : 0;  // and before this
      for (int64_t key0 = earliest / kKeys * kKeys; key0 <= last; key0 += kKeys) {
        const float* kb = kh + key0 * dim;  // the block's packed keys
        for (int64_t r = 0; r < padded_rows; r += kTileRows)
          for (int64_t c = 0; c < kKeys; c += kTileCols) score_tile(&qf[r * dim], dim, kb, c, &s[r * kKeys]);
        for (int64_t r = 0; r < padded_rows; ++r) {  // keys up to the row's own position (within the window) are seen
          const int64_t from = window ? position[r] - *window + 1 : 0;
          softmax_row(&s[r * kKeys], from - key0, position[r] - key0 + 1, &top[r], &sum[r], &o[r * dim], dim);
        }
        for (int64_t r = 0; r < padded_rows; r += kTileRows)
          for (int64_t d = 0; d < dim; d += kTileCols) output_tile(&s[r * kKeys], vh + key0 * dim, dim, d, &o[r * dim]);
      }
      for (int64_t r = 0; r < rows; ++r) {
        T* dst = out + ((first + r % nq) * heads + h * groups + r / nq) * dim;
        const float inv = sum[r] > 0.f ? 1.f / sum[r] : 0.f;
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(o[r * dim + d] * inv);
      }
    }
  });
}
}  // namespace generic

}  // namespace tandem
#endif
