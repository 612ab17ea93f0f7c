// Shared by the products over quantised weights (`quantized_linear.cpp`): the activations quantised
// to int8 a block of 32 columns at a time, as llama.cpp's Q8_0, and the plain sums over a row's last
// columns that fill no vector.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "vec.h"

namespace tandem::quant {

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

// One block of `width` inputs: its largest magnitude, returned, and each input times 127 / it rounded
// to an integer in `rounded` (ties to even, as std::nearbyint in the default rounding mode). A
// quantised product's call quantises its rows once, on one thread, before the others start.
template <typename T>
inline float round_block(const T* x, int64_t width, int32_t* rounded) {
#if defined(TANDEM_SIMD)
  if (width == kBlock) {
    using namespace tandem::simd;
    constexpr int kVectors = kBlock / kLanes;
    vfloat v[kVectors], most = vzero();
    for (int i = 0; i < kVectors; ++i) {
      v[i] = vload(x + i * kLanes);
      most = vmax(most, vabs(v[i]));
    }
    const float m = vmaxval(most);
    const vfloat inverse = vset1(m > 0.f ? 127.f / m : 0.f);
    for (int i = 0; i < kVectors; ++i) vstore_rounded(rounded + i * kLanes, vmul(v[i], inverse));
    return m;
  }
#endif
  float most = 0.f;
  for (int64_t i = 0; i < width; ++i) most = std::max(most, std::abs(widen(x[i])));
  const float inverse = most > 0.f ? 127.f / most : 0.f;
  for (int64_t i = 0; i < width; ++i) rounded[i] = static_cast<int32_t>(std::nearbyint(widen(x[i]) * inverse));
  return most;
}

template <typename T>
Quantised quantise(const T* x, int64_t rows, int64_t k, bool split, int64_t lane_columns) {
  Quantised a{k, (k + kBlock - 1) / kBlock, (k + lane_columns - 1) / lane_columns, {}, {}, {}, {}, {}};
  a.q.resize(rows * k);
  a.scale.resize(rows * a.blocks);
  a.lane.resize(rows * a.lanes);
  a.sums.resize(rows * a.blocks);
  a.lane_offset.resize(rows * a.lanes);
  int32_t rounded[kBlock];
  for (int64_t m = 0; m < rows; ++m) {
    const T* xr = x + m * k;
    int8_t* qr = a.q.data() + m * k;
    for (int64_t b = 0; b < a.blocks; ++b) {
      const int64_t c0 = b * kBlock, width = std::min(kBlock, k - c0);
      const float most = round_block(xr + c0, width, rounded);
      int32_t sum = 0;
      for (int64_t i = 0; i < width; ++i) sum += rounded[i];
      if (split)  // even columns first, then odd ones
        for (int64_t i = 0, c = c0; i < width; ++i, ++c)
          qr[(c & 1) * (k / 2) + c / 2] = static_cast<int8_t>(rounded[i]);
      else
        for (int64_t i = 0; i < width; ++i) qr[c0 + i] = static_cast<int8_t>(rounded[i]);
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
inline Quantised quantise(const at::Tensor& x, bool split, int64_t lane_columns, const char* name) {
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
inline const float* as_float(const at::Tensor& t, std::vector<float>& copy) {
  const at::Tensor c = t.contiguous();
  if (c.scalar_type() == at::kFloat && c.data_ptr() == t.data_ptr()) return t.data_ptr<float>();
  copy.resize(t.numel());
  switch (c.scalar_type()) {
    case at::kFloat: std::copy_n(c.data_ptr<float>(), copy.size(), copy.begin()); break;
    case at::kBFloat16: std::transform(c.data_ptr<c10::BFloat16>(), c.data_ptr<c10::BFloat16>() + copy.size(), copy.begin(), [](c10::BFloat16 v) { return widen(v); }); break;
    case at::kHalf: std::transform(c.data_ptr<c10::Half>(), c.data_ptr<c10::Half>() + copy.size(), copy.begin(), [](c10::Half v) { return widen(v); }); break;
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

}  // namespace tandem::quant
