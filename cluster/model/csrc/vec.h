// Shared by the CPU kernels: element loads (one, or a vector at once, as float32), exp for a softmax,
// and a dispatch on small counts.
//
// The vector paths are written once against `tandem::simd`: float32 vectors of `kLanes` lanes,
// sixteen where the kernels are built for AVX-512, eight where they are built for AVX2 (with FMA
// and F16C). `TANDEM_SIMD` is defined where either is; elsewhere the kernels' plain loops run.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

// On a lambda that a loop calls with accumulators of its own: inlined, so they stay in registers
// (left to itself the compiler may call it, and every multiply-add goes through memory).
#define TANDEM_INLINE __attribute__((always_inline))

namespace tandem {

// Calls body(std::integral_constant<int, n>{}) for n in [1, Max], so loops over n unroll and their
// accumulators stay in registers.
template <int Max, typename Body>
inline void with_count(int64_t n, Body&& body) {
  if constexpr (Max > 1) {
    if (n < Max) return with_count<Max - 1>(n, body);
  }
  body(std::integral_constant<int, Max>{});
}

// 2^f for |f| <= 1/2 as a degree-6 polynomial, highest power first (every exp below uses it).
constexpr float kExp2Poly[7] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                                5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.f};

// exp(x) for the x <= 0 of a softmax (scores minus their maximum), vectorisable: 2^n times a
// degree-6 polynomial for 2^f, |f| <= 1/2; relative error about 2e-7, float32's own rounding.
inline float exp_nonpositive(float x) {
  const float t = std::max(x, -87.f) * 1.44269504088896341f;  // x / ln 2
  const float n = std::floor(t + 0.5f);
  const float f = t - n;
  float p = kExp2Poly[0];
  for (int i = 1; i < 7; ++i) p = p * f + kExp2Poly[i];
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return p * two_n;
}

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float widen(c10::Half x) { return static_cast<float>(x); }
inline float widen(int8_t x) { return static_cast<float>(x); }

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// exp(x) on sixteen lanes for the x <= 0 of a softmax: 2^n times a degree-6 polynomial for 2^f,
// |f| <= 1/2, 2^n applied by scaling; relative error about 2e-7. Lanes below -87 give about 1.6e-38.
inline __m512 exp16_nonpositive(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[i]));
  return _mm512_scalef_ps(p, n);
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define TANDEM_SIMD 1
namespace simd {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
using vfloat = __m512;
inline vfloat vzero() { return _mm512_setzero_ps(); }
inline vfloat vset1(float x) { return _mm512_set1_ps(x); }
template <typename T>
inline vfloat vload(const T* p) { return load16(p); }
inline void vstore(float* p, vfloat v) { _mm512_storeu_ps(p, v); }
inline vfloat vfmadd(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm512_sub_ps(a, b); }
inline vfloat vmax(vfloat a, vfloat b) { return _mm512_max_ps(a, b); }
inline float vsum(vfloat v) { return _mm512_reduce_add_ps(v); }
inline float vmaxval(vfloat v) { return _mm512_reduce_max_ps(v); }
inline vfloat vabs(vfloat v) { return _mm512_abs_ps(v); }
// v rounded to the nearest integers (ties to even, as std::nearbyint in the default rounding mode).
inline void vstore_rounded(int32_t* p, vfloat v) { _mm512_storeu_si512(p, _mm512_cvtps_epi32(v)); }
inline vfloat vexp_nonpositive(vfloat x) { return exp16_nonpositive(x); }
#else
constexpr int kLanes = 8;
using vfloat = __m256;
inline vfloat vzero() { return _mm256_setzero_ps(); }
inline vfloat vset1(float x) { return _mm256_set1_ps(x); }
inline vfloat vload(const float* p) { return _mm256_loadu_ps(p); }
inline vfloat vload(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline vfloat vload(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vfloat vload(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline void vstore(float* p, vfloat v) { _mm256_storeu_ps(p, v); }
inline vfloat vfmadd(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm256_add_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm256_sub_ps(a, b); }
inline vfloat vmax(vfloat a, vfloat b) { return _mm256_max_ps(a, b); }
inline float vsum(vfloat v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float vmaxval(vfloat v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline vfloat vabs(vfloat v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); }
inline void vstore_rounded(int32_t* p, vfloat v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_cvtps_epi32(v));
}
// exp16_nonpositive on eight lanes: 2^n applied through the exponent bits (n >= -126 here, since
// x >= -87, so 2^n stays a normal number).
inline vfloat vexp_nonpositive(vfloat x) {
  const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[i]));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

}  // namespace simd
#endif

}  // namespace tandem
