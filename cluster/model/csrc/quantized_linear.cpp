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
// `cluster/model/cpu_kernels.py` defines, builds and loads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "skinny.h"
#include "vec.h"

namespace {

using namespace tandem::skinny;

constexpr int64_t kBlock = 32;  // inputs quantised with one scale

// Rows of inputs quantised to int8 with a scale per block of `kBlock` columns.
struct Quantised {
  int64_t k, blocks, lanes;  // lanes: `lane_columns`-column lanes per row, each scaled by its block
  std::vector<int8_t> q;     // [rows, k]; split: each row's even columns, then its odd ones
  std::vector<float> scale;  // [rows, blocks]
  std::vector<float> lane;   // [rows, lanes]: each lane's block scale, for vectors of lanes
  std::vector<float> sums;   // [rows, blocks]: each block's quantised inputs summed, times its scale
  std::vector<float> lane_offset;  // [rows, lanes]: 128 * its block's sum, spread evenly over the block's lanes
};

template <typename T>
Quantised quantise(const T* x, int64_t rows, int64_t k, bool split, int64_t lane_columns) {
  Quantised a{k, (k + kBlock - 1) / kBlock, (k + lane_columns - 1) / lane_columns, {}, {}, {}, {}, {}};
  a.q.resize(rows * k);
  a.scale.resize(rows * a.blocks);
  a.lane.resize(rows * a.lanes);
  a.sums.resize(rows * a.blocks);
  a.lane_offset.resize(rows * a.lanes);
  float block[kBlock];
  for (int64_t m = 0; m < rows; ++m) {
    const T* xr = x + m * k;
    int8_t* qr = a.q.data() + m * k;
    for (int64_t b = 0; b < a.blocks; ++b) {
      const int64_t c0 = b * kBlock, width = std::min(kBlock, k - c0);
      float most = 0.f;
      for (int64_t i = 0; i < width; ++i) {
        block[i] = tandem::widen(xr[c0 + i]);
        most = std::max(most, std::abs(block[i]));
      }
      const float inverse = most > 0.f ? 127.f / most : 0.f;
      int32_t sum = 0;
      for (int64_t i = 0, c = c0; i < width; ++i, ++c) {
        const int8_t v = static_cast<int8_t>(std::nearbyint(block[i] * inverse));
        qr[split ? (c & 1) * (k / 2) + c / 2 : c] = v;
        sum += v;
      }
      a.scale[m * a.blocks + b] = most / 127.f;
      a.sums[m * a.blocks + b] = a.scale[m * a.blocks + b] * static_cast<float>(sum);
    }
    for (int64_t l = 0; l < a.lanes; ++l) {
      const int64_t b = l * lane_columns / kBlock;
      a.lane[m * a.lanes + l] = a.scale[m * a.blocks + b];
      a.lane_offset[m * a.lanes + l] = 128.f * a.sums[m * a.blocks + b] * lane_columns / kBlock;
    }
  }
  return a;
}

// `x` [rows, k] in float32, bfloat16 or float16, quantised (`quantise`).
Quantised quantise(const at::Tensor& x, bool split, int64_t lane_columns, const char* name) {
  const at::Tensor xc = x.contiguous();
  const int64_t rows = x.size(0), k = x.size(1);
  switch (x.scalar_type()) {
    case at::kFloat: return quantise(xc.data_ptr<float>(), rows, k, split, lane_columns);
    case at::kBFloat16: return quantise(xc.data_ptr<c10::BFloat16>(), rows, k, split, lane_columns);
    case at::kHalf: return quantise(xc.data_ptr<c10::Half>(), rows, k, split, lane_columns);
    default: TORCH_CHECK(false, name, " takes float32, bfloat16 or float16 activations");
  }
}

// `t` [n] as float32: its own data where it is float32, else a converted copy in `copy`.
const float* as_float(const at::Tensor& t, std::vector<float>& copy) {
  const at::Tensor c = t.contiguous();
  if (c.scalar_type() == at::kFloat && c.data_ptr() == t.data_ptr()) return t.data_ptr<float>();
  copy.resize(t.numel());
  switch (c.scalar_type()) {
    case at::kFloat: std::copy_n(c.data_ptr<float>(), copy.size(), copy.begin()); break;
    case at::kBFloat16: std::transform(c.data_ptr<c10::BFloat16>(), c.data_ptr<c10::BFloat16>() + copy.size(), copy.begin(), [](c10::BFloat16 v) { return tandem::widen(v); }); break;
    case at::kHalf: std::transform(c.data_ptr<c10::Half>(), c.data_ptr<c10::Half>() + copy.size(), copy.begin(), [](c10::Half v) { return tandem::widen(v); }); break;
    default: TORCH_CHECK(false, "scales must be float32, bfloat16 or float16");
  }
  return copy.data();
}

#if defined(__AVX512VNNI__)
// Masks of the first `n` bytes of 64, and of the first `n` lanes of 16 (all of them from 64 and 16 on).
inline __mmask64 bytes_from(int64_t n) { return n >= 64 ? ~__mmask64{0} : (__mmask64{1} << n) - 1; }
inline __mmask16 lanes_from(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << n) - 1); }
#endif

#if defined(__AVX2__)
// Eight int32 lanes, each the sum of four products of unsigned bytes u with signed bytes s.
inline __m256i dot4(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

// <a, b> over n float32s.
inline float dot_f32(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
  }
  sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  sum = sum8(acc);
#endif
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// Sum over the blocks from column c0 (a block's first) of scale[b] * <q, w> over the block, times
// the weights' own scale of the block where they have one (`wblock`, else nullptr).
inline float dot_int8(const int8_t* q, const float* scale, const int8_t* w, const float* wblock, int64_t c0,
                      int64_t k) {
  float sum = 0.f;
  for (int64_t c = c0; c < k; c += kBlock) {
    int32_t dot = 0;
    for (int64_t i = c; i < std::min(k, c + kBlock); ++i) dot += int32_t{q[i]} * int32_t{w[i]};
    sum += scale[c / kBlock] * (wblock != nullptr ? wblock[c / kBlock] : 1.f) * static_cast<float>(dot);
  }
  return sum;
}

// The same over 4-bit values from byte b0 (a block's first): `qe`, `qo` the even and odd inputs,
// `s` the weight row's group scales.
inline float dot_int4(const int8_t* qe, const int8_t* qo, const float* scale, const uint8_t* row, const float* s,
                      int64_t b0, int64_t half, int64_t group) {
  float sum = 0.f;
  for (int64_t b = b0; b < half; b += kBlock / 2) {
    int32_t dot = 0;
    for (int64_t i = b; i < b + kBlock / 2; ++i) dot += qe[i] * (row[i] & 0xF) + qo[i] * (row[i] >> 4);
    sum += s[2 * b / group] * scale[2 * b / kBlock] * static_cast<float>(dot);
  }
  return sum;
}

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
  for (int64_t n = n0; n < n1; ++n) {
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
  // A block a vector; even and odd blocks into accumulators of their own, so that one block's
  // multiply-add need not wait for the last one's (a single chain bound a row of one input).
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
    int64_t c = 0;
    for (; c + 2 * kBlock <= vector_end; c += 2 * kBlock) {
      prefetch_ahead(row + c);
      block(c, even);
      block(c + kBlock, odd);
    }
    if (c < vector_end) block(c, even);
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
  for (int64_t n = n0; n < n1; ++n) {
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
      const int64_t g = (2 * b) >> group_shift;
      const __m512 gs = group >= 128 ? _mm512_set1_ps(s[g])
                                     : _mm512_permutexvar_ps(group_of_lane, _mm512_maskz_loadu_ps(lanes_from((2 * (half - b)) >> group_shift), s + g));
      for (int m = 0; m < Rows; ++m) {
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), even, _mm512_maskz_loadu_epi8(bytes, q + m * k + b));
        dot = _mm512_dpbusd_epi32(dot, odd, _mm512_maskz_loadu_epi8(bytes, q + m * k + half + b));
        const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_maskz_loadu_ps(lanes, lane + m * a.lanes + b / 4));
        acc[m] = _mm512_fmadd_ps(scaled, gs, acc[m]);
      }
    }
    for (int m = 0; m < Rows; ++m) total[m] = _mm512_reduce_add_ps(acc[m]);
#elif defined(__AVX2__)
    // Vectors alternate between two sets of accumulators, as in `product_int8`.
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
    int64_t b = 0;
    for (; b + 2 * kStep <= vector_end; b += 2 * kStep) {
      prefetch_ahead(row + b);
      step(b, first);
      step(b + kStep, second);
    }
    if (b < vector_end) step(b, first);
    for (int m = 0; m < Rows; ++m) total[m] = sum8(_mm256_add_ps(first[m], second[m]));
#endif
    for (int m = 0; m < Rows; ++m) {
      const float minimums = dot_f32(l, xsum + m * groups, groups);
      const float tail = dot_int4(q + m * k, q + m * k + half, scale + m * a.blocks, row, s, vector_end, half, group);
      y[m * ldy + n] = static_cast<Y>(total[m] + tail + minimums);
    }
  }
}

at::Tensor skinny_linear_int8(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "skinny_linear_int8 takes x [rows, k] and weight [n, k]");
  TORCH_CHECK(weight.scalar_type() == at::kChar, "skinny_linear_int8 takes int8 weights");
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0);
  const bool blocks = scales.dim() == 2;
  TORCH_CHECK(scales.size(0) == n && (scales.dim() == 1 || (blocks && k % kBlock == 0 && scales.size(1) == k / kBlock)),
              "skinny_linear_int8 takes a scale per weight row [n], or per block of ", kBlock, " columns [n, k / ",
              kBlock, "]");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "skinny_linear_int8 runs on CPU tensors");
  TORCH_CHECK(rows <= kMaxRows, "skinny_linear_int8 takes at most ", kMaxRows, " rows, not ", rows);
  const at::Tensor w = weight.contiguous();
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return y;
  const Quantised a = quantise(x, /*split=*/false, /*lane_columns=*/4, "skinny_linear_int8");
  std::vector<float> scale_copy;
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = as_float(scales, scale_copy);
  over_weight_rows(y, wp, std::max<int64_t>(1, k), "skinny_linear_int8",
                   [&](auto r, int64_t m, int64_t t0, int64_t t1, auto* yp) {
                     if (blocks)
                       product_int8<decltype(r)::value, true>(a, m, wp, sp, t0, t1, yp + m * n, n);
                     else
                       product_int8<decltype(r)::value, false>(a, m, wp, sp, t0, t1, yp + m * n, n);
                   });
  return y;
}

at::Tensor skinny_linear_int4(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scales,
                              const at::Tensor& minimums, int64_t group_size) {
  TORCH_CHECK(x.dim() == 2 && nibbles.dim() == 2 && x.size(1) == 2 * nibbles.size(1),
              "skinny_linear_int4 takes x [rows, k] and nibbles [n, k / 2]");
  TORCH_CHECK(nibbles.scalar_type() == at::kByte, "skinny_linear_int4 takes uint8 nibbles, two to a byte");
  const int64_t rows = x.size(0), k = x.size(1), n = nibbles.size(0);
  TORCH_CHECK(group_size > 0 && group_size % kBlock == 0 && k % group_size == 0 && (group_size & (group_size - 1)) == 0,
              "skinny_linear_int4: the group size must be a multiple of ", kBlock, " dividing k, and a power of two");
  const int64_t groups = k / group_size;
  TORCH_CHECK(scales.sizes() == minimums.sizes() && scales.dim() == 2 && scales.size(0) == n &&
                  scales.size(1) == groups,
              "skinny_linear_int4 takes scales and minimums [n, k / group_size]");
  TORCH_CHECK(x.device().is_cpu() && nibbles.device().is_cpu(), "skinny_linear_int4 runs on CPU tensors");
  TORCH_CHECK(rows <= kMaxRows, "skinny_linear_int4 takes at most ", kMaxRows, " rows, not ", rows);
  const at::Tensor q = nibbles.contiguous();
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return y;
  const Quantised a = quantise(x, /*split=*/true, /*lane_columns=*/8, "skinny_linear_int4");
  std::vector<float> group_sums(rows * groups, 0.f);  // the quantised inputs' sums over each group
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t b = 0; b < a.blocks; ++b) group_sums[m * groups + b * kBlock / group_size] += a.sums[m * a.blocks + b];
  std::vector<float> scale_copy, low_copy;
  const float *sp = as_float(scales, scale_copy), *lp = as_float(minimums, low_copy);
  const float* xs = group_sums.data();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  over_weight_rows(y, qp, std::max<int64_t>(1, k / 2), "skinny_linear_int4",
                   [&](auto r, int64_t m, int64_t t0, int64_t t1, auto* yp) {
                     product_int4<decltype(r)::value>(a, m, xs, qp, sp, lp, group_size, t0, t1, yp + m * n, n);
                   });
  return y;
}

// The weights dequantised, [n, k] in `dtype`: scale * value a row (int8 with `scales` [n]) or a
// block of 32 (int8 with [n, k / 32]), minimum + value * scale a group (int4); computed in float32
// and rounded once to `dtype`. A prompt's chunk multiplies them dense (`quant.Int8Linear.dense`):
// one pass over the weights, where torch's element-wise expressions made three or more.
template <typename Body>
at::Tensor dequantized(int64_t n, int64_t k, at::ScalarType dtype, Body&& body) {
  at::Tensor out = at::empty({n, k}, at::TensorOptions().dtype(dtype));
  const auto run = [&](auto zero) {
    using Y = decltype(zero);
    Y* yp = out.data_ptr<Y>();
    at::parallel_for(0, n, std::max<int64_t>(1, kMinTaskBytes / std::max<int64_t>(1, k)), [&](int64_t n0, int64_t n1) {
      for (int64_t r = n0; r < n1; ++r) body(r, yp + r * k);
    });
  };
  switch (dtype) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "dequantize takes float32, bfloat16 or float16");
  }
  return out;
}

at::Tensor dequantize_int8(const at::Tensor& weight, const at::Tensor& scales, at::ScalarType dtype) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar, "dequantize_int8 takes int8 weights [n, k]");
  const int64_t n = weight.size(0), k = weight.size(1);
  const bool blocks = scales.dim() == 2;
  TORCH_CHECK(scales.size(0) == n && (scales.dim() == 1 || (blocks && k % kBlock == 0 && scales.size(1) == k / kBlock)),
              "dequantize_int8 takes a scale per weight row [n], or per block of ", kBlock, " columns");
  const at::Tensor w = weight.contiguous();
  std::vector<float> scale_copy;
  const float* s = as_float(scales, scale_copy);
  const int8_t* wp = w.data_ptr<int8_t>();
  return dequantized(n, k, dtype, [&](int64_t r, auto* out) {
    using Y = std::remove_pointer_t<decltype(out)>;
    const int8_t* row = wp + r * k;
    for (int64_t c = 0; c < k; ++c)
      out[c] = static_cast<Y>(static_cast<float>(row[c]) * (blocks ? s[r * (k / kBlock) + c / kBlock] : s[r]));
  });
}

at::Tensor dequantize_int4(const at::Tensor& nibbles, const at::Tensor& scales, const at::Tensor& minimums,
                           int64_t group_size, at::ScalarType dtype) {
  TORCH_CHECK(nibbles.dim() == 2 && nibbles.scalar_type() == at::kByte, "dequantize_int4 takes uint8 nibbles [n, k / 2]");
  const int64_t n = nibbles.size(0), k = 2 * nibbles.size(1);
  TORCH_CHECK(group_size > 0 && k % group_size == 0 && scales.sizes() == minimums.sizes() && scales.dim() == 2 &&
                  scales.size(0) == n && scales.size(1) == k / group_size,
              "dequantize_int4 takes scales and minimums [n, k / group_size]");
  const at::Tensor q = nibbles.contiguous();
  std::vector<float> scale_copy, low_copy;
  const float *s = as_float(scales, scale_copy), *l = as_float(minimums, low_copy);
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const int64_t groups = k / group_size;
  return dequantized(n, k, dtype, [&](int64_t r, auto* out) {
    using Y = std::remove_pointer_t<decltype(out)>;
    const uint8_t* row = qp + r * (k / 2);
    for (int64_t g = 0; g < groups; ++g) {
      const float scale = s[r * groups + g], low = l[r * groups + g];
      const uint8_t* bytes = row + g * group_size / 2;
      Y* values = out + g * group_size;
      for (int64_t i = 0; i < group_size / 2; ++i) {
        values[2 * i] = static_cast<Y>(low + static_cast<float>(bytes[i] & 0xF) * scale);
        values[2 * i + 1] = static_cast<Y>(low + static_cast<float>(bytes[i] >> 4) * scale);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("skinny_linear_int8", &skinny_linear_int8);
  m.impl("skinny_linear_int4", &skinny_linear_int4);
  m.impl("dequantize_int8", &dequantize_int8);
  m.impl("dequantize_int4", &dequantize_int4);
}
