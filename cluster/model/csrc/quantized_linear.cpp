// Few-row products over quantised weights, y = x @ W^T: int8 weights with a scale per weight row
// (`cluster.model.quant.Int8Linear`), and 4-bit values two to a byte with a scale and a minimum per
// group of input columns (`Int4Linear`).
//
// A decode step reads one byte a weight (int8) or half a byte (int4). Widening every weight to
// float32 to multiply it there costs more than reading it, so these products multiply in integers.
// As a call begins, each block of 32 inputs of a row is quantised to int8 with its own scale
// (max |x| / 127), as llama.cpp quantises activations for its quantised products (Q8_0). A weight
// row's product with a block is then a sum of byte products in int32, exact:
// - AVX512-VNNI: `vpdpbusd` multiplies 64 pairs of bytes and sums them four at a time into sixteen
//   int32 lanes, one instruction for 64 weights. Its first operand is unsigned: int8 weights go in
//   offset by 128 (their sign bit flipped), and 128 times each row's sum of inputs is taken off once;
//   4-bit values are unsigned as they are.
// - AVX2, and AVX-512 without VNNI: `vpmaddubsw` multiplies 32 pairs of bytes into sixteen-bit sums
//   of two, `vpmaddwd` adds those pairs into eight int32 lanes. Its sums of two saturate past 32,767,
//   so int8 weights go in as |w|, with the inputs' signs flipped where w < 0 (2 * 128 * 127 fits).
// - Elsewhere, and for a row's last columns that fill no vector, the same sums in plain loops.
// Each lane's sum is converted to float32 once, scaled by its block's scale (and for int4 by its
// group's), and accumulated in float32 lanes, summed when the row ends.
//
// The 4-bit values sit two to a byte, the even column in the low nibble. The inputs are split into
// their even and odd columns as they are quantised, so the low nibbles of a vector of bytes multiply
// the even inputs and the high nibbles the odd ones, four of each in a lane, with no reordering. The
// minimum's part, minimum * (the group's sum of inputs), takes the sums of the inputs as quantised:
// the values are 0 to 15, not centred, and their product with the inputs' rounding would not cancel
// against the minimum's with exact sums (8 % of SmolLM2's logits, where these sums keep it at the
// int8 weights' share). The product is then exactly the dequantised weights' with the quantised
// inputs, as llama.cpp's Q4_1 with Q8_1 inputs computes it.
//
// The CPU implementations of `tandem_cpu::skinny_linear_int8` and `_int4`, which
// `cluster/model/cpu_kernels.py` defines, builds and loads, with `dequantize_int8` and `_int4`
// (`dequantize.h`): their weights written out dense for a prompt's products.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "dequantize.h"
#include "quantise.h"
#include "skinny.h"
#include "vec.h"

namespace {

using namespace tandem::quant;
using namespace tandem::skinny;

// y[m * ldy + n] = <x[m], w[n]> for n in [n0, n1), x as quantised (`a`, from row `m0`), times the
// weights' scales: one a row (`wscale[n]`), or with `Blocks` one a block of 32 columns
// (`wscale[n * blocks + b]`, GGUF's Q8_0).
template <int Rows, bool Blocks, typename Y>
void product_int8(const Quantised& a, int64_t m0, const int8_t* w, const float* wscale, int64_t n0, int64_t n1, Y* y,
                  int64_t ldy) {
  const int64_t k = a.k;
  const int8_t* q = a.q.data() + m0 * k;
  const float* scale = a.scale.data() + m0 * a.blocks;
  const auto row_scale = [&](int64_t n) { return Blocks ? 1.f : wscale[n]; };
  const auto blocks_of = [&](int64_t n) { return Blocks ? wscale + n * a.blocks : nullptr; };
#if defined(__AVX512VNNI__)
  // `vpdpbusd` takes the weights offset by 128: 128 * the row's quantised inputs comes off again,
  // once a row (one scale a row), or block by block before the weights' scale (one a block).
  const float* lane = a.lane.data() + m0 * a.lanes;
  const float* lane_offset = a.lane_offset.data() + m0 * a.lanes;
  const float* sums = a.sums.data() + m0 * a.blocks;
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i block_of_lane = _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 3);
  float row_offset[Rows];  // with a scale a row: the same for every weight row
  for (int m = 0; m < Rows; ++m) {
    row_offset[m] = 0.f;
    for (int64_t b = 0; !Blocks && b < a.blocks; ++b) row_offset[m] += 128.f * sums[m * a.blocks + b];
  }
  int64_t n = n0;
  if (Rows <= 4 && k % 64 == 0) {
    // Decode's few rows: four weight rows at a time share the loads of the inputs and their scales,
    // and their 4 * Rows sums keep more weight lines in flight. A row at a time read the weights
    // 15-20 % below the machine's rate through a whole decode step's products.
    for (; n + 4 <= n1; n += 4) {
      __m512 acc[4][Rows];
      for (int j = 0; j < 4; ++j)
        for (int m = 0; m < Rows; ++m) acc[j][m] = _mm512_setzero_ps();
      for (int64_t c = 0; c < k; c += 64) {
        __m512i x[Rows];
        __m512 xs[Rows], offset[Rows];
        for (int m = 0; m < Rows; ++m) {
          x[m] = _mm512_loadu_si512(q + m * k + c);
          xs[m] = _mm512_loadu_ps(lane + m * a.lanes + c / 4);
          offset[m] = Blocks ? _mm512_loadu_ps(lane_offset + m * a.lanes + c / 4) : _mm512_setzero_ps();
        }
        for (int j = 0; j < 4; ++j) {
          const int8_t* row = w + (n + j) * k;
          prefetch_ahead(row + c);
          const __m512i offset_w = _mm512_xor_si512(_mm512_loadu_si512(row + c), sign);
          const __m512 ws = Blocks ? _mm512_permutexvar_ps(block_of_lane, _mm512_maskz_loadu_ps(0x3, blocks_of(n + j) + c / kBlock))
                                   : _mm512_setzero_ps();
          for (int m = 0; m < Rows; ++m) {
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), offset_w, x[m]));
            acc[j][m] = Blocks ? _mm512_fmadd_ps(_mm512_fmsub_ps(dot, xs[m], offset[m]), ws, acc[j][m])
                               : _mm512_fmadd_ps(dot, xs[m], acc[j][m]);
          }
        }
      }
      for (int j = 0; j < 4; ++j)
        for (int m = 0; m < Rows; ++m)
          y[m * ldy + n + j] = static_cast<Y>(row_scale(n + j) * (_mm512_reduce_add_ps(acc[j][m]) - row_offset[m]));
    }
  }
  for (; n < n1; ++n) {
    const int8_t* row = w + n * k;
    const float* wblock = blocks_of(n);
    __m512 acc[Rows];
    for (int m = 0; m < Rows; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t c = 0; c < k; c += 64) {
      prefetch_ahead(row + c);
      const __mmask64 bytes = bytes_from(k - c);
      const __mmask16 lanes = lanes_from((k - c + 3) / 4);
      // w + 128, unsigned; masked-off columns are 0 in x, so they add nothing
      const __m512i offset_w = _mm512_xor_si512(_mm512_maskz_loadu_epi8(bytes, row + c), sign);
      __m512 ws = _mm512_set1_ps(1.f);
      if constexpr (Blocks) {  // two blocks a vector, eight lanes each
        const __mmask16 two = lanes_from(std::min<int64_t>(2, (k - c) / kBlock));
        ws = _mm512_permutexvar_ps(block_of_lane, _mm512_maskz_loadu_ps(two, wblock + c / kBlock));
      }
      for (int m = 0; m < Rows; ++m) {
        const __m512i x = _mm512_maskz_loadu_epi8(bytes, q + m * k + c);
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), offset_w, x);
        const __m512 xs = _mm512_maskz_loadu_ps(lanes, lane + m * a.lanes + c / 4);
        if constexpr (Blocks) {
          const __m512 offset = _mm512_maskz_loadu_ps(lanes, lane_offset + m * a.lanes + c / 4);
          acc[m] = _mm512_fmadd_ps(_mm512_fmsub_ps(_mm512_cvtepi32_ps(dot), xs, offset), ws, acc[m]);
        } else
          acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), xs, acc[m]);
      }
    }
    for (int m = 0; m < Rows; ++m) {
      y[m * ldy + n] = static_cast<Y>(row_scale(n) * (_mm512_reduce_add_ps(acc[m]) - row_offset[m]));
    }
  }
#elif defined(__AVX2__)
  // A block a vector; even and odd blocks into accumulators of their own (`alternate`).
  const int64_t vector_end = k - k % kBlock;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w + n * k;
    const float* wblock = blocks_of(n);
    __m256 even[Rows], odd[Rows];
    for (int m = 0; m < Rows; ++m) even[m] = odd[m] = _mm256_setzero_ps();
    const auto block = [&](int64_t c, __m256* acc) TANDEM_INLINE {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c));
      const __m256i magnitude = _mm256_abs_epi8(wv);
      const float ws = Blocks ? wblock[c / kBlock] : 1.f;
      for (int m = 0; m < Rows; ++m) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + m * k + c));
        const __m256i dot = dot4(magnitude, _mm256_sign_epi8(x, wv));
        const __m256 block_scale = _mm256_set1_ps(scale[m * a.blocks + c / kBlock] * ws);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), block_scale, acc[m]);
      }
    };
    alternate(vector_end, kBlock, even, odd, [&](int64_t c) TANDEM_INLINE { prefetch_ahead(row + c); }, block);
    for (int m = 0; m < Rows; ++m) {
      const float tail = dot_int8(q + m * k, scale + m * a.blocks, row, wblock, vector_end, k);
      y[m * ldy + n] = static_cast<Y>(row_scale(n) * (sum8(_mm256_add_ps(even[m], odd[m])) + tail));
    }
  }
#else
  for (int64_t n = n0; n < n1; ++n)
    for (int m = 0; m < Rows; ++m) {
      const float dot = dot_int8(q + m * k, scale + m * a.blocks, w + n * k, blocks_of(n), 0, k);
      y[m * ldy + n] = static_cast<Y>(row_scale(n) * dot);
    }
#endif
}

#if defined(__AVX512VNNI__)
// The sums of four vectors' lanes, into `out[0..3]`.
inline void reduce4(const __m512* v, float* out) {
  // Halves, then quarters, of each pair added: lanes of v0 and v1 (then v2 and v3) side by side.
  const __m512 a = _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x44), _mm512_shuffle_f32x4(v[0], v[1], 0xEE));
  const __m512 c = _mm512_add_ps(_mm512_shuffle_f32x4(v[2], v[3], 0x44), _mm512_shuffle_f32x4(v[2], v[3], 0xEE));
  // Each 128-bit quarter now holds four partial sums of one vector: v0, v1, v2, v3 in order.
  __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(a, c, 0x88), _mm512_shuffle_f32x4(a, c, 0xDD));
  s = _mm512_add_ps(s, _mm512_permute_ps(s, 0x4E));
  s = _mm512_add_ps(s, _mm512_permute_ps(s, 0xB1));
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, s);
  for (int j = 0; j < 4; ++j) out[j] = lanes[4 * j];
}

#endif

// y[m * ldy + n] = sum over groups g of scale[n, g] * <x[m], q[n]> over g + low[n, g] * xsum[m, g],
// for n in [n0, n1): `nibbles` rows of k 4-bit values two to a byte, x as quantised (`a`, split into
// even and odd columns, from row `m0`), `xsum` [rows, k / group] the inputs' exact sums over each group.
template <int Rows, typename Y>
void product_int4(const Quantised& a, int64_t m0, const float* xsum, const uint8_t* nibbles, const float* wscale,
                  const float* low, int64_t group, int64_t n0, int64_t n1, Y* y, int64_t ldy) {
  const int64_t k = a.k, half = k / 2, groups = k / group;
  const int group_shift = __builtin_ctzll(group);  // a power of two: the group of a column is a shift, not a division
  const int8_t* q = a.q.data() + m0 * k;
  const float* scale = a.scale.data() + m0 * a.blocks;
  const float* lane = a.lane.data() + m0 * a.lanes;
  xsum += m0 * groups;
#if defined(__AVX512VNNI__)
  // A vector of 64 bytes covers 128 columns, lane l columns 8l to 8l + 7: groups of 32 and 64 put
  // several groups in a vector, whose scales are spread over their lanes.
  constexpr int64_t kStep = 64;
  const __m512i four_bits = _mm512_set1_epi8(0x0F);
  const __m512i group_of_lane = _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                  group == 32 ? 2 : 3);
  const int64_t vector_end = half;  // the last vector masked
#elif defined(__AVX2__)
  constexpr int64_t kStep = 32;  // bytes, 64 columns, lane l columns 8l to 8l + 7
  const __m256i four_bits = _mm256_set1_epi8(0x0F);
  const int64_t vector_end = half - half % kStep;
#else
  const int64_t vector_end = 0;  // plain loops only
  (void)lane;
  (void)group_shift;
#endif
  int64_t n = n0;
#if defined(__AVX512VNNI__)
  // A vector's group scales: one for all its lanes, or (groups of 32 and 64) spread over them.
  const auto group_scales = [&](const float* s, int64_t b) TANDEM_INLINE {
    const int64_t g = (2 * b) >> group_shift;
    return group >= 128 ? _mm512_set1_ps(s[g])
                        : _mm512_permutexvar_ps(group_of_lane, _mm512_maskz_loadu_ps(lanes_from((2 * (half - b)) >> group_shift), s + g));
  };
  if (Rows == 1) {
    // One input row (decode at batch 1): four weight rows at a time share the loads of the inputs
    // and their scales, as `product_int8` does. Whole vectors load unmasked (a masked byte load
    // costs an extra uop); the minimums' part joins the sums in vectors, and the four rows' sums
    // are reduced together.
    const int64_t full = half - half % kStep;
    for (; n + 4 <= n1; n += 4) {
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      const auto vector = [&](int64_t b, __m512i xe, __m512i xo, __m512 xs, auto load) TANDEM_INLINE {
        for (int j = 0; j < 4; ++j) {
          const uint8_t* row = nibbles + (n + j) * half;
          prefetch_ahead(row + b);
          const __m512i wv = load(row + b);
          const __m512i even = _mm512_and_si512(wv, four_bits);
          const __m512i odd = _mm512_and_si512(_mm512_srli_epi16(wv, 4), four_bits);
          const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), even, xe), odd, xo);
          const __m512 scales = group_scales(wscale + (n + j) * groups, b);
          acc[j] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), xs), scales, acc[j]);
        }
      };
      int64_t b = 0;
      for (; b < full; b += kStep)
        vector(b, _mm512_loadu_si512(q + b), _mm512_loadu_si512(q + half + b), _mm512_loadu_ps(lane + b / 4),
               [](const uint8_t* p) TANDEM_INLINE { return _mm512_loadu_si512(p); });
      if (b < half) {
        const __mmask64 bytes = bytes_from(half - b);
        vector(b, _mm512_maskz_loadu_epi8(bytes, q + b), _mm512_maskz_loadu_epi8(bytes, q + half + b),
               _mm512_maskz_loadu_ps(lanes_from((half - b) / 4), lane + b / 4),
               [bytes](const uint8_t* p) TANDEM_INLINE { return _mm512_maskz_loadu_epi8(bytes, p); });
      }
      for (int64_t g = 0; g < groups; g += 16) {
        const __mmask16 some = lanes_from(groups - g);
        const __m512 sums = _mm512_maskz_loadu_ps(some, xsum + g);
        for (int j = 0; j < 4; ++j)
          acc[j] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(some, low + (n + j) * groups + g), sums, acc[j]);
      }
      float total[4];
      reduce4(acc, total);
      for (int j = 0; j < 4; ++j) y[n + j] = static_cast<Y>(total[j]);
    }
  }
#endif
  for (; n < n1; ++n) {
    const uint8_t* row = nibbles + n * half;
    const float* s = wscale + n * groups;
    const float* l = low + n * groups;
    float total[Rows];
    for (int m = 0; m < Rows; ++m) total[m] = 0.f;
#if defined(__AVX512VNNI__)
    __m512 acc[Rows];
    for (int m = 0; m < Rows; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < vector_end; b += kStep) {
      prefetch_ahead(row + b);
      const __mmask64 bytes = bytes_from(half - b);
      const __mmask16 lanes = lanes_from((half - b) / 4);
      const __m512i wv = _mm512_maskz_loadu_epi8(bytes, row + b);
      const __m512i even = _mm512_and_si512(wv, four_bits), odd = _mm512_and_si512(_mm512_srli_epi16(wv, 4), four_bits);
      const __m512 gs = group_scales(s, b);
      for (int m = 0; m < Rows; ++m) {
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), even, _mm512_maskz_loadu_epi8(bytes, q + m * k + b));
        dot = _mm512_dpbusd_epi32(dot, odd, _mm512_maskz_loadu_epi8(bytes, q + m * k + half + b));
        const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_maskz_loadu_ps(lanes, lane + m * a.lanes + b / 4));
        acc[m] = _mm512_fmadd_ps(scaled, gs, acc[m]);
      }
    }
    for (int m = 0; m < Rows; ++m) total[m] = _mm512_reduce_add_ps(acc[m]);
#elif defined(__AVX2__)
    // Vectors alternate between two sets of accumulators (`alternate`).
    __m256 first[Rows], second[Rows];
    for (int m = 0; m < Rows; ++m) first[m] = second[m] = _mm256_setzero_ps();
    const auto step = [&](int64_t b, __m256* acc) TANDEM_INLINE {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b));
      const __m256i even = _mm256_and_si256(wv, four_bits), odd = _mm256_and_si256(_mm256_srli_epi16(wv, 4), four_bits);
      const int64_t g = (2 * b) >> group_shift;
      const __m256 gs = group >= 64 ? _mm256_broadcast_ss(s + g)
                                    : _mm256_set_m128(_mm_broadcast_ss(s + g + 1), _mm_broadcast_ss(s + g));
      for (int m = 0; m < Rows; ++m) {
        const __m256i xe = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + m * k + b));
        const __m256i xo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + m * k + half + b));
        // Sixteen-bit sums of two products of at most 15 * 127: the even and odd ones added still fit.
        const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(even, xe), _mm256_maddubs_epi16(odd, xo));
        const __m256i dot = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
        const __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_loadu_ps(lane + m * a.lanes + b / 4));
        acc[m] = _mm256_fmadd_ps(scaled, gs, acc[m]);
      }
    };
    alternate(vector_end, kStep, first, second, [&](int64_t b) TANDEM_INLINE { prefetch_ahead(row + b); }, step);
    for (int m = 0; m < Rows; ++m) total[m] = sum8(_mm256_add_ps(first[m], second[m]));
#endif
    for (int m = 0; m < Rows; ++m) {
      const float minimums = dot_f32(l, xsum + m * groups, groups);
      const float tail = dot_int4(q + m * k, q + m * k + half, scale + m * a.blocks, row, s, vector_end, half, group);
      y[m * ldy + n] = static_cast<Y>(total[m] + tail + minimums);
    }
  }
}

// One thread's share [n0, n1) of y [rows, n] = x @ W^T over int8 weights [n, k], x quantised as
// `a`; a scale per weight row, or (`blocks`) per block of 32 columns.
template <typename Y>
void int8_rows(const Quantised& a, int64_t rows, const int8_t* w, const float* scales, bool blocks, int64_t n,
               int64_t n0, int64_t n1, Y* y) {
  weight_rows(rows, n0, n1, w, std::max<int64_t>(1, a.k), [&](auto r, int64_t m, int64_t t0, int64_t t1) {
    if (blocks)
      product_int8<decltype(r)::value, true>(a, m, w, scales, t0, t1, y + m * n, n);
    else
      product_int8<decltype(r)::value, false>(a, m, w, scales, t0, t1, y + m * n, n);
  });
}

// The same over 4-bit weights (`nibbles` [n, k / 2]) in groups of `group` columns, x quantised (split
// into even and odd columns) as `a`, `xsum` its sums over each group (`int4_group_sums`).
template <typename Y>
void int4_rows(const Quantised& a, int64_t rows, const float* xsum, const uint8_t* nibbles, const float* scales,
               const float* minimums, int64_t group, int64_t n, int64_t n0, int64_t n1, Y* y) {
  weight_rows(rows, n0, n1, nibbles, std::max<int64_t>(1, a.k / 2), [&](auto r, int64_t m, int64_t t0, int64_t t1) {
    product_int4<decltype(r)::value>(a, m, xsum, nibbles, scales, minimums, group, t0, t1, y + m * n, n);
  });
}

// The quantised inputs' sums over each group of `group` columns, [rows, k / group].
inline std::vector<float> int4_group_sums(const Quantised& a, int64_t rows, int64_t group) {
  const int64_t groups = a.k / group;
  std::vector<float> sums(rows * groups, 0.f);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t b = 0; b < a.blocks; ++b) sums[m * groups + b * kBlock / group] += a.sums[m * a.blocks + b];
  return sums;
}

void check_int8(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "skinny_linear_int8 takes x [rows, k] and weight [n, k]");
  TORCH_CHECK(weight.scalar_type() == at::kChar, "skinny_linear_int8 takes int8 weights");
  const int64_t k = x.size(1), n = weight.size(0);
  TORCH_CHECK(scales.size(0) == n && (scales.dim() == 1 || (scales.dim() == 2 && k % kBlock == 0 && scales.size(1) == k / kBlock)),
              "skinny_linear_int8 takes a scale per weight row [n], or per block of ", kBlock, " columns [n, k / ",
              kBlock, "]");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "skinny_linear_int8 runs on CPU tensors");
  TORCH_CHECK(x.size(0) <= kMaxRows, "skinny_linear_int8 takes at most ", kMaxRows, " rows, not ", x.size(0));
}

void check_int4(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scales, const at::Tensor& minimums,
                int64_t group_size) {
  TORCH_CHECK(x.dim() == 2 && nibbles.dim() == 2 && x.size(1) == 2 * nibbles.size(1),
              "skinny_linear_int4 takes x [rows, k] and nibbles [n, k / 2]");
  TORCH_CHECK(nibbles.scalar_type() == at::kByte, "skinny_linear_int4 takes uint8 nibbles, two to a byte");
  const int64_t k = x.size(1), n = nibbles.size(0);
  TORCH_CHECK(group_size > 0 && group_size % kBlock == 0 && k % group_size == 0 && (group_size & (group_size - 1)) == 0,
              "skinny_linear_int4: the group size must be a multiple of ", kBlock, " dividing k, and a power of two");
  TORCH_CHECK(scales.sizes() == minimums.sizes() && scales.dim() == 2 && scales.size(0) == n &&
                  scales.size(1) == k / group_size,
              "skinny_linear_int4 takes scales and minimums [n, k / group_size]");
  TORCH_CHECK(x.device().is_cpu() && nibbles.device().is_cpu(), "skinny_linear_int4 runs on CPU tensors");
  TORCH_CHECK(x.size(0) <= kMaxRows, "skinny_linear_int4 takes at most ", kMaxRows, " rows, not ", x.size(0));
}

at::Tensor skinny_linear_int8(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  check_int8(x, weight, scales);
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0);
  const at::Tensor w = weight.contiguous();
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return y;
  const Quantised a = quantise(x, /*split=*/false, /*lane_columns=*/4, "skinny_linear_int8");
  std::vector<float> scale_copy;
  const float* sp = as_float(scales, scale_copy);
  with_output(y, "skinny_linear_int8", [&](auto zero) {
    using Y = decltype(zero);
    over_weight_rows(n, std::max<int64_t>(1, k), [&](int64_t n0, int64_t n1) {
      int8_rows(a, rows, w.data_ptr<int8_t>(), sp, scales.dim() == 2, n, n0, n1, y.data_ptr<Y>());
    });
  });
  return y;
}

at::Tensor skinny_linear_int4(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scales,
                              const at::Tensor& minimums, int64_t group_size) {
  check_int4(x, nibbles, scales, minimums, group_size);
  const int64_t rows = x.size(0), k = x.size(1), n = nibbles.size(0);
  const at::Tensor q = nibbles.contiguous();
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return y;
  const Quantised a = quantise(x, /*split=*/true, /*lane_columns=*/8, "skinny_linear_int4");
  const std::vector<float> xsum = int4_group_sums(a, rows, group_size);
  std::vector<float> scale_copy, low_copy;
  const float *sp = as_float(scales, scale_copy), *lp = as_float(minimums, low_copy);
  with_output(y, "skinny_linear_int4", [&](auto zero) {
    using Y = decltype(zero);
    over_weight_rows(n, std::max<int64_t>(1, k / 2), [&](int64_t n0, int64_t n1) {
      int4_rows(a, rows, xsum.data(), q.data_ptr<uint8_t>(), sp, lp, group_size, n, n0, n1, y.data_ptr<Y>());
    });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("skinny_linear_int8", &skinny_linear_int8);
  m.impl("skinny_linear_int4", &skinny_linear_int4);
  m.impl("dequantize_int8", &tandem::dequant::dequantize_int8);
  m.impl("dequantize_int4", &tandem::dequant::dequantize_int4);
}
