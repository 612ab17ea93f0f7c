// Paged attention for prompt chunks (several new tokens per sequence) on CPU.
//
// Each sequence attends on its own, at its own length: padding every sequence of a pass to the
// longest one, as one batched call would, costs up to (longest / mean)^2 times the arithmetic for
// prompts of mixed lengths. bfloat16 caches without a sliding window (head_dim a multiple of 64) go
// through the flash kernel below, which runs both products on AMX tiles where the CPU has them and
// Linux grants them (`tandem::tiles::amx()`), else as AVX512-BF16 pair products (about 5x torch's CPU
// flash attention on 512-token prompts). On the tiles it outruns torch's flash attention, whose
// products run on the same tiles (oneDNN's brgemm), 1.4-2.2x (72 new tokens after 496 cached: 0.41
// against 0.70 ms a layer on an Intel Xeon, one thread), where the pair products ran 2.0-2.4x slower
// than torch's. Other float32, bfloat16 and float16 caches, with a sliding window or without, go
// through a flash kernel in float32 vectors (AVX2 or AVX-512; `flash_vectors.h`): 1.5x torch's on a
// 512-token prompt on an AVX2 machine (AMD Zen 3), packing included. With `torch_flash` (an AMX CPU
// whose tiles these kernels cannot use) bfloat16 goes through torch's flash attention. An int8 cache
// is gathered and dequantised, and goes through torch's flash attention: with its causal rule for a
// chunk that starts at position 0, else with an explicit mask (query i, at position num_cached + i,
// sees the keys at or before it, and within the window).
//
// The CPU implementation of `tandem_cpu::prefill_attention`, which `cluster/model/cpu_kernels.py` defines,
// builds and loads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "cache_rows.h"
#include "flash_vectors.h"
#include "tile_linear.h"
#include "vec.h"

namespace {

using tandem::kScaleBytes;
#if defined(TANDEM_SIMD)
namespace generic = tandem::generic;
#endif

#if defined(__AVX512F__)
using tandem::exp16_nonpositive;
#endif


#if defined(__AVX512BF16__)
// Flash attention for one sequence's bfloat16 queries over its bfloat16 keys and values, causal,
// the queries at positions [cached, cached + n). Keys and values are first packed per KV head into
// pair-interleaved tiles, so that both products run as AVX512-BF16 pair products: scores = Q K^T
// over sixteen keys per vector, out += P V over sixteen dims per vector, with P rounded to bfloat16
// as flash attention's second product does. A task is one KV head and kQueryBlock query positions
// of each of the query heads sharing it; it walks the key blocks up to its last position, keeping
// a running maximum and sum per row (online softmax).
constexpr int64_t kQueryBlock = 32;  // positions per task
constexpr int64_t kKeyBlock = 64;    // keys per step of the walk
constexpr int64_t kScoreRows = 8;    // rows per score micro-kernel (x 32 keys: 16 accumulators)
constexpr int64_t kOutRows = 4;      // rows per output micro-kernel (x 64 dims: 16 accumulators)

// Keys of one head as [key tile of 16][dim pair][16] pairs: one vector holds a dim pair of 16 keys.
// Values as [key pair][dim] pairs: one vector holds two keys' values of 16 dims. Zero past ctx.
// A key tile's dim pairs are gathered sixteen keys at a time; two keys' values are interleaved by
// one permutation per 32 dims.
void pack_head(const c10::BFloat16* k_cache, const c10::BFloat16* v_cache, const int64_t* table, int64_t block_size,
               int64_t kv_heads, int64_t h, int64_t dim, int64_t ctx, int64_t padded, uint32_t* kp, uint32_t* vp) {
  const int64_t pairs = dim / 2;
  const auto row = [&](int64_t j) {  // position j's row of this head, in bfloat16s from the cache's start
    return ((table[j / block_size] * block_size + j % block_size) * kv_heads + h) * dim;
  };
  const auto* keys = reinterpret_cast<const int*>(k_cache);
  for (int64_t j0 = 0; j0 < padded; j0 += 16) {
    alignas(64) int64_t at[16] = {};  // each key's row, in pairs (64-bit: a large cache passes 2^31 of them)
    const __mmask16 real = j0 >= ctx ? 0 : ctx - j0 >= 16 ? 0xffff : static_cast<__mmask16>((1u << (ctx - j0)) - 1);
    for (int64_t i = 0; i < 16 && j0 + i < ctx; ++i) at[i] = row(j0 + i) / 2;
    const __m512i first = _mm512_load_si512(at), second = _mm512_load_si512(at + 8);
    const __m256i zero = _mm256_setzero_si256();
    uint32_t* kt = kp + j0 * pairs;
    for (int64_t d = 0; d < pairs; ++d) {
      const __m512i step = _mm512_set1_epi64(d);
      const __m256i a = _mm512_mask_i64gather_epi32(zero, real & 0xff, _mm512_add_epi64(first, step), keys, 4);
      const __m256i b = _mm512_mask_i64gather_epi32(zero, real >> 8, _mm512_add_epi64(second, step), keys, 4);
      _mm512_storeu_si512(kt + d * 16, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
    }
  }
  // the even key's value in a pair's low half: lanes 0-15 of the two rows for the first 32 dims, 16-31 next
  const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                       39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  const __m512i none = _mm512_setzero_si512();
  for (int64_t j = 0; j < padded; j += 2) {
    const c10::BFloat16* even = j < ctx ? v_cache + row(j) : nullptr;
    const c10::BFloat16* odd = j + 1 < ctx ? v_cache + row(j + 1) : nullptr;
    uint32_t* vt = vp + j / 2 * dim;
    for (int64_t d = 0; d < dim; d += 32) {
      const __m512i a = even ? _mm512_loadu_si512(even + d) : none, b = odd ? _mm512_loadu_si512(odd + d) : none;
      _mm512_storeu_si512(vt + d, _mm512_permutex2var_epi16(a, low, b));
      _mm512_storeu_si512(vt + d + 16, _mm512_permutex2var_epi16(a, high, b));
    }
  }
}

// s[r][0, 32) = <q row r, keys [key0, key0 + 32)> for kScoreRows rows.
inline void score_rows(const uint32_t* const* q, const uint32_t* kp, int64_t pairs, int64_t key0, float* s,
                       int64_t s_stride) {
  __m512 acc[kScoreRows][2];
  for (int r = 0; r < kScoreRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const uint32_t* t0 = kp + (key0 / 16) * pairs * 16;
  const uint32_t* t1 = t0 + pairs * 16;
  for (int64_t d = 0; d < pairs; ++d) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(t0 + d * 16), k1 = (__m512bh)_mm512_loadu_si512(t1 + d * 16);
#pragma GCC unroll 8
    for (int r = 0; r < kScoreRows; ++r) {
      const __m512bh qr = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(q[r][d]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qr, k0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qr, k1);
    }
  }
  for (int r = 0; r < kScoreRows; ++r) {
    _mm512_storeu_ps(s + r * s_stride, acc[r][0]);
    _mm512_storeu_ps(s + r * s_stride + 16, acc[r][1]);
  }
}

// o[r][0, 64) += sum over key pairs of p[r][pair] * values, for kOutRows rows.
inline void accumulate_rows(const uint32_t* p, int64_t p_stride, const uint32_t* vp, int64_t dim, int64_t pairs,
                            float* o, int64_t o_stride) {
  __m512 acc[kOutRows][4];
  for (int r = 0; r < kOutRows; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_loadu_ps(o + r * o_stride + 16 * c);
  for (int64_t j = 0; j < pairs; ++j) {
    __m512bh v[4];
    for (int c = 0; c < 4; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vp + j * dim + 16 * c);
#pragma GCC unroll 4
    for (int r = 0; r < kOutRows; ++r) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(p[r * p_stride + j]));
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], v[c], w);
    }
  }
  for (int r = 0; r < kOutRows; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o + r * o_stride + 16 * c, acc[r][c]);
}

// One row's step of the online softmax over a block of kKeyBlock scores, of which the first
// `visible` are seen: scales them, raises the running maximum `top` (rescaling the running `sum` and
// output row `o` to it), and leaves the block's weights exp(score - top) in `p` as bfloat16 pairs.
inline void softmax_block_row(float* scores, int64_t visible, float scale, float* top, float* sum, uint32_t* p,
                              float* o, int64_t dim) {
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), scale16 = _mm512_set1_ps(scale);
  __m512 vmax = minus_inf;
  for (int64_t k = 0; k < kKeyBlock; k += 16) {
    const __mmask16 seen = visible - k >= 16 ? 0xffff : visible - k <= 0 ? 0 : (1u << (visible - k)) - 1;
    const __m512 x = _mm512_mask_mul_ps(minus_inf, seen, _mm512_loadu_ps(scores + k), scale16);
    _mm512_storeu_ps(scores + k, x);
    vmax = _mm512_max_ps(vmax, x);
  }
  const float new_top = std::max(*top, _mm512_reduce_max_ps(vmax));
  if (new_top == -std::numeric_limits<float>::infinity()) {  // nothing seen yet
    std::fill(p, p + kKeyBlock / 2, 0u);
    return;
  }
  const float rescale = *top == -std::numeric_limits<float>::infinity() ? 0.f
                        : *top == new_top                                 ? 1.f
                                                                          : std::exp(*top - new_top);
  const __m512 top16 = _mm512_set1_ps(new_top);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t k = 0; k < kKeyBlock; k += 32) {
    const __m512 x0 = _mm512_loadu_ps(scores + k), x1 = _mm512_loadu_ps(scores + k + 16);
    // Unseen keys (-inf) weigh exactly zero.
    const __m512 e0 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x0, minus_inf, _CMP_NEQ_OQ),
                                          exp16_nonpositive(_mm512_sub_ps(x0, top16)));
    const __m512 e1 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x1, minus_inf, _CMP_NEQ_OQ),
                                          exp16_nonpositive(_mm512_sub_ps(x1, top16)));
    vsum = _mm512_add_ps(vsum, _mm512_add_ps(e0, e1));
    _mm512_storeu_si512(p + k / 2, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
  }
  *sum = *sum * rescale + _mm512_reduce_add_ps(vsum);
  *top = new_top;
  if (rescale != 1.f)
    for (int64_t d = 0; d < dim; d += 16)
      _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), _mm512_set1_ps(rescale)));
}

#if defined(TANDEM_TILES)
// The same two products on AMX tiles, sixteen rows at a time (rows padded to a multiple of 16, the
// queries gathered into `q` [rows, dim]): all eight tiles 16 rows of 64 bytes; 0 the rows' tile, 1 a
// keys' or values' tile, 4-7 sums. The packed keys are the tiles' right-hand layout as they are
// (a dim pair of 16 keys a line), and so are the values (two keys' values of 16 dims a line).

// s[r][0, kKeyBlock) = <q row r, keys [key0, key0 + kKeyBlock)>, rows [0, padded_rows).
__attribute__((target("amx-tile,amx-bf16"))) inline void tile_scores(const c10::BFloat16* q, int64_t padded_rows,
                                                                     const uint32_t* kp, int64_t dim, int64_t key0,
                                                                     float* s) {
  static_assert(kKeyBlock == 64, "a block's scores: four tiles of 16 keys");
  const int64_t pairs = dim / 2;
  for (int64_t r = 0; r < padded_rows; r += 16) {
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t c = 0; c < dim; c += 32) {  // 32 dims a step: 16 pairs
      _tile_loadd(0, q + r * dim + c, dim * 2);
      const uint32_t* keys = kp + key0 / 16 * pairs * 16 + c / 2 * 16;
      _tile_loadd(1, keys, 64);
      _tile_dpbf16ps(4, 0, 1);
      _tile_loadd(1, keys + pairs * 16, 64);
      _tile_dpbf16ps(5, 0, 1);
      _tile_loadd(1, keys + 2 * pairs * 16, 64);
      _tile_dpbf16ps(6, 0, 1);
      _tile_loadd(1, keys + 3 * pairs * 16, 64);
      _tile_dpbf16ps(7, 0, 1);
    }
    _tile_stored(4, s + r * kKeyBlock, kKeyBlock * 4);
    _tile_stored(5, s + r * kKeyBlock + 16, kKeyBlock * 4);
    _tile_stored(6, s + r * kKeyBlock + 32, kKeyBlock * 4);
    _tile_stored(7, s + r * kKeyBlock + 48, kKeyBlock * 4);
  }
}

// o[r][0, dim) += sum over the block's key pairs of p[r][pair] * values, rows [0, padded_rows).
__attribute__((target("amx-tile,amx-bf16"))) inline void tile_accumulate(const uint32_t* p, int64_t padded_rows,
                                                                         const uint32_t* vp, int64_t dim, float* o) {
  for (int64_t r = 0; r < padded_rows; r += 16)
    for (int64_t d = 0; d < dim; d += 64) {  // 64 dims: four tiles of sums
      float* sums = o + r * dim + d;
      _tile_loadd(4, sums, dim * 4);
      _tile_loadd(5, sums + 16, dim * 4);
      _tile_loadd(6, sums + 32, dim * 4);
      _tile_loadd(7, sums + 48, dim * 4);
      for (int64_t j = 0; j < kKeyBlock / 2; j += 16) {  // 32 keys a step: 16 pairs
        _tile_loadd(0, p + r * kKeyBlock / 2 + j, kKeyBlock / 2 * 4);
        const uint32_t* values = vp + j * dim + d;
        _tile_loadd(1, values, dim * 4);
        _tile_dpbf16ps(4, 0, 1);
        _tile_loadd(1, values + 16, dim * 4);
        _tile_dpbf16ps(5, 0, 1);
        _tile_loadd(1, values + 32, dim * 4);
        _tile_dpbf16ps(6, 0, 1);
        _tile_loadd(1, values + 48, dim * 4);
        _tile_dpbf16ps(7, 0, 1);
      }
      _tile_stored(4, sums, dim * 4);
      _tile_stored(5, sums + 16, dim * 4);
      _tile_stored(6, sums + 32, dim * 4);
      _tile_stored(7, sums + 48, dim * 4);
    }
}

#endif

void flash_sequence(const c10::BFloat16* q, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                    const int64_t* table, int64_t block_size, int64_t n, int64_t cached, int64_t heads,
                    int64_t kv_heads, int64_t dim, float scale, c10::BFloat16* out) {
#if defined(TANDEM_TILES)
  const bool tiles = tandem::tiles::amx();
#else
  const bool tiles = false;
#endif
  const int64_t ctx = cached + n, padded = (ctx + kKeyBlock - 1) / kKeyBlock * kKeyBlock, pairs = dim / 2;
  const int64_t groups = heads / kv_heads, q_blocks = (n + kQueryBlock - 1) / kQueryBlock;
  std::vector<uint32_t> kp(kv_heads * padded * pairs), vp(kv_heads * padded * pairs);
  at::parallel_for(0, kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h)
      pack_head(k_cache, v_cache, table, block_size, kv_heads, h, dim, ctx, padded, &kp[h * padded * pairs],
                &vp[h * padded * pairs]);
  });
  const int64_t row_step = tiles ? 16 : kScoreRows;  // rows a product takes at a time
  const int64_t max_rows = (groups * kQueryBlock + row_step - 1) / row_step * row_step;
  at::parallel_for(0, kv_heads * q_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(max_rows * kKeyBlock), o(max_rows * dim), top(max_rows), sum(max_rows);
    std::vector<uint32_t> p(max_rows * kKeyBlock / 2), zero(pairs, 0u);
    std::vector<const uint32_t*> q_rows(max_rows);
    std::vector<c10::BFloat16> q_tiles(tiles ? max_rows * dim : 0);  // the rows gathered, for the tiles
    std::vector<int64_t> position(max_rows);
#if defined(TANDEM_TILES)
    if (tiles) tandem::tiles::configure_tiles();
#endif
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / q_blocks, first = task % q_blocks * kQueryBlock;
      const int64_t nq = std::min(kQueryBlock, n - first), rows = groups * nq;
      const int64_t padded_rows = (rows + row_step - 1) / row_step * row_step;
      for (int64_t r = 0; r < padded_rows; ++r) {  // row r: query head h * groups + r / nq, position r % nq
        const bool real = r < rows;
        position[r] = real ? cached + first + r % nq : -1;
        q_rows[r] = real ? reinterpret_cast<const uint32_t*>(q + ((first + r % nq) * heads + h * groups + r / nq) * dim)
                         : zero.data();
        if (tiles) std::memcpy(&q_tiles[r * dim], q_rows[r], dim * sizeof(c10::BFloat16));
      }
      std::fill(o.begin(), o.end(), 0.f);
      std::fill(top.begin(), top.end(), -std::numeric_limits<float>::infinity());
      std::fill(sum.begin(), sum.end(), 0.f);
      const uint32_t* kh = &kp[h * padded * pairs];
      const uint32_t* vh = &vp[h * padded * pairs];
      const int64_t last = cached + first + nq - 1;  // the task's last position: keys past it are unseen
      for (int64_t key0 = 0; key0 <= last; key0 += kKeyBlock) {
#if defined(TANDEM_TILES)
        if (tiles)
          tile_scores(q_tiles.data(), padded_rows, kh, dim, key0, s.data());
        else
#endif
          for (int64_t r = 0; r < padded_rows; r += kScoreRows)
            for (int64_t k = 0; k < kKeyBlock; k += 32)
              score_rows(&q_rows[r], kh, pairs, key0 + k, &s[r * kKeyBlock + k], kKeyBlock);
        for (int64_t r = 0; r < rows; ++r)  // keys up to the row's own position are seen
          softmax_block_row(&s[r * kKeyBlock], std::min(kKeyBlock, position[r] - key0 + 1), scale, &top[r], &sum[r],
                            &p[r * kKeyBlock / 2], &o[r * dim], dim);
        for (int64_t r = rows; r < padded_rows; ++r) std::fill(&p[r * kKeyBlock / 2], &p[(r + 1) * kKeyBlock / 2], 0u);
#if defined(TANDEM_TILES)
        if (tiles)
          tile_accumulate(p.data(), padded_rows, vh + key0 / 2 * dim, dim, o.data());
        else
#endif
          for (int64_t r = 0; r < padded_rows; r += kOutRows)
            for (int64_t d = 0; d < dim; d += 64)
              accumulate_rows(&p[r * kKeyBlock / 2], kKeyBlock / 2, vh + key0 / 2 * dim + d, dim, kKeyBlock / 2,
                              &o[r * dim + d], dim);
      }
      for (int64_t r = 0; r < rows; ++r) {
        c10::BFloat16* dst = out + ((first + r % nq) * heads + h * groups + r / nq) * dim;
        const float inv = sum[r] > 0.f ? 1.f / sum[r] : 0.f;
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<c10::BFloat16>(o[r * dim + d] * inv);
      }
    }
#if defined(TANDEM_TILES)
    if (tiles) tandem::tiles::release_tiles();
#endif
  });
}
#endif


// One sequence's first `ctx` positions of a cache, [kv_heads, ctx, head_dim] in `dtype`.
at::Tensor gather(const at::Tensor& cache, const at::Tensor& blocks, int64_t ctx, int64_t dim, at::ScalarType dtype) {
  at::Tensor rows = cache.index_select(0, blocks);  // [blocks, block_size, kv_heads, row]
  rows = rows.view({-1, cache.size(2), cache.size(3)}).narrow(0, 0, ctx);
  if (cache.scalar_type() == at::kByte) {
    at::Tensor values = rows.narrow(2, 0, dim).view(at::kChar).to(at::kFloat);
    at::Tensor scales = rows.narrow(2, dim, kScaleBytes).contiguous().view(at::kFloat);
    rows = (values * scales).to(dtype);
  }
  return rows.to(dtype).transpose(0, 1);  // a 16-bit cache under float32 queries: widened
}

// One sequence through torch's flash attention: its n queries [n, heads, dim] at positions
// [cached, cached + n) over its gathered blocks; [n, heads, dim].
at::Tensor torch_sequence(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& blocks, int64_t cached, int64_t dim, double scale,
                          std::optional<int64_t> window) {
  const int64_t n = q.size(0), ctx = cached + n;
  const at::Tensor keys = gather(k_cache, blocks, ctx, dim, q.scalar_type()).unsqueeze(0);
  const at::Tensor values = gather(v_cache, blocks, ctx, dim, q.scalar_type()).unsqueeze(0);
  const bool causal = cached == 0 && !window;
  std::optional<at::Tensor> mask;
  if (!causal) {  // query i, at position cached + i, sees the keys at or before it (and within the window)
    const at::Tensor q_pos = at::arange(cached, ctx, blocks.options()).unsqueeze(1);
    const at::Tensor k_pos = at::arange(ctx, blocks.options()).unsqueeze(0);
    at::Tensor m = k_pos <= q_pos;
    if (window) m = m & (q_pos - k_pos < *window);
    mask = m;
  }
  const at::Tensor o = at::scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys, values, mask, 0.0,
                                                        causal, scale, /*enable_gqa=*/true);  // [1, heads, n, dim]
  return o[0].transpose(0, 1);
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& block_tables, at::IntArrayRef num_new, at::IntArrayRef num_cached,
                             double scale, std::optional<int64_t> window, bool torch_flash) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad attention shapes");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "prefill_attention runs on CPU tensors");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2, "block tables must be [S, blocks]");
  const int64_t num_seqs = block_tables.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(static_cast<int64_t>(num_new.size()) == num_seqs && static_cast<int64_t>(num_cached.size()) == num_seqs,
              "num_new and num_cached need one entry per sequence");
  TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  const bool int8 = k_cache.scalar_type() == at::kByte;
  if (!int8) tandem::check_kv_types(q.scalar_type(), k_cache.scalar_type());
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "keys and values must share a dtype");
  TORCH_CHECK(k_cache.size(3) == (int8 ? dim + kScaleBytes : dim),
              "the cache's rows must hold head_dim values (int8: and their scale)");
  TORCH_CHECK(!window || *window > 0, "a sliding window must be positive");
  int64_t total = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(num_new[s] > 0 && num_cached[s] >= 0, "sequence ", s, " has no new tokens");
    TORCH_CHECK((num_cached[s] + num_new[s] + block_size - 1) / block_size <= block_tables.size(1),
                "sequence ", s, "'s block table is too short for its positions");
    total += num_new[s];
  }
  TORCH_CHECK(total == q.size(0), "num_new adds up to ", total, " tokens, q has ", q.size(0));
  const at::Tensor tables = block_tables.to(at::kCPU).contiguous();
  const int64_t cache_blocks = k_cache.size(0);
  TORCH_CHECK(tables.numel() == 0 || (tables.min().item<int64_t>() >= 0 && tables.max().item<int64_t>() < cache_blocks),
              "a block table entry lies outside the cache's ", cache_blocks, " blocks");

  at::Tensor out = at::empty({q.size(0), heads * dim}, q.options());
  const bool ours = !int8 && !(torch_flash && q.scalar_type() == at::kBFloat16);  // else torch's flash attention
  const bool plain = ours && !window && k_cache.is_contiguous() && v_cache.is_contiguous();
#if defined(__AVX512BF16__)
  const bool flash = plain && q.scalar_type() == at::kBFloat16 && dim % 64 == 0;
#else
  const bool flash = false;
#endif
#if defined(TANDEM_SIMD)
  const bool vector_flash = ours && k_cache.is_contiguous() && v_cache.is_contiguous() && !flash &&
                            dim % generic::kTileCols == 0 && dim <= 256;
#else
  const bool vector_flash = false;
#endif
  const at::Tensor qc = flash || vector_flash ? q.contiguous() : q;
  int64_t start = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t n = num_new[s], cached = num_cached[s];
    const int64_t* table = tables.data_ptr<int64_t>() + s * tables.size(1);
#if defined(__AVX512BF16__)
    if (flash) {
      flash_sequence(qc.data_ptr<c10::BFloat16>() + start * heads * dim, k_cache.data_ptr<c10::BFloat16>(),
                     v_cache.data_ptr<c10::BFloat16>(), table, block_size, n, cached, heads, kv_heads, dim,
                     static_cast<float>(scale), out.data_ptr<c10::BFloat16>() + start * heads * dim);
      start += n;
      continue;
    }
#endif
#if defined(TANDEM_SIMD)
    if (vector_flash) {
      tandem::with_kv_types(q.scalar_type(), k_cache.scalar_type(), "prefill_attention", [&](auto query, auto element) {
        using T = decltype(query);
        using C = decltype(element);
        generic::flash_sequence(qc.data_ptr<T>() + start * heads * dim, k_cache.data_ptr<C>(), v_cache.data_ptr<C>(),
                                table, block_size, n, cached, heads, kv_heads, dim, static_cast<float>(scale),
                                window, out.data_ptr<T>() + start * heads * dim);
      });
      start += n;
      continue;
    }
#endif
    const at::Tensor blocks = tables[s].narrow(0, 0, (cached + n + block_size - 1) / block_size);
    out.narrow(0, start, n).view({n, heads, dim}).copy_(
        torch_sequence(q.narrow(0, start, n), k_cache, v_cache, blocks, cached, dim, scale, window));
    start += n;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
