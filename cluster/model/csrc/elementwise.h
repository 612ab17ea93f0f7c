// A decoder layer's element-wise steps for eager CPU passes, each one pass over its rows: RMSNorm,
// the rotary embedding, and SwiGLU's silu(gate) * up. Torch runs them as four to nine ops each, every
// op a dispatch and a trip through memory; an eager SmolLM2 step makes about 600 of them. A compiled
// graph fuses the same steps itself and never calls these.
//
// Each rounds where torch's ops round: in a bfloat16 or float16 model, to that dtype after every op
// (RMSNorm normalises in float32 first, as the reference does), so eager results stay where they were.
// Sums and exp differ from torch's in float32's last bits only.
//
// Included by `skinny_linear.cpp`, which registers them.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "vec.h"

namespace tandem::elementwise {

// Elements a thread takes at least: below it, one thread does the whole pass (a decode row).
constexpr int64_t kMinTaskElements = 32 * 1024;

// v rounded to T's precision and widened again, as storing a T and loading it would.
inline float rounded(float v, float) { return v; }
inline float rounded(float v, c10::BFloat16) { return widen(c10::BFloat16(v)); }
inline float rounded(float v, c10::Half) { return widen(c10::Half(v)); }

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

#if defined(TANDEM_SIMD)
using namespace tandem::simd;

#if defined(__AVX512F__)
inline vfloat round_bf16(vfloat v) {  // to nearest even, NaN kept quiet: c10::BFloat16's rule
  const __m512i b = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  return _mm512_castsi512_ps(r);
}
inline void store(c10::BFloat16* p, vfloat v) {  // rounded to nearest even
  const __m512i high = _mm512_srli_epi32(_mm512_castps_si512(round_bf16(v)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(high));
}
inline vfloat round_half(vfloat v) { return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT)); }
inline void store(c10::Half* p, vfloat v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline vfloat vdiv(vfloat a, vfloat b) { return _mm512_div_ps(a, b); }
inline vfloat where_nonnegative(vfloat g, vfloat yes, vfloat no) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ), no, yes);
}
#else
inline vfloat round_bf16(vfloat v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  r = _mm256_and_si256(r, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u)));
  const __m256 quiet_nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000));
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), quiet_nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}
inline void store(c10::BFloat16* p, vfloat v) {
  const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(round_bf16(v)), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline vfloat round_half(vfloat v) { return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT)); }
inline void store(c10::Half* p, vfloat v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline vfloat vdiv(vfloat a, vfloat b) { return _mm256_div_ps(a, b); }
inline vfloat where_nonnegative(vfloat g, vfloat yes, vfloat no) {
  return _mm256_blendv_ps(no, yes, _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ));
}
#endif
inline void store(float* p, vfloat v) { vstore(p, v); }
inline vfloat vrounded(vfloat v, float) { return v; }
inline vfloat vrounded(vfloat v, c10::BFloat16) { return round_bf16(v); }
inline vfloat vrounded(vfloat v, c10::Half) { return round_half(v); }

// silu(g) = g * sigmoid(g), through exp(-|g|) <= 1 (the softmax's exp): g / (1 + e) for g >= 0,
// g * e / (1 + e) below.
inline vfloat vsilu(vfloat g) {
  const vfloat e = vexp_nonpositive(vsub(vzero(), vabs(g)));
  return vdiv(vmul(g, where_nonnegative(g, vset1(1.f), e)), vadd(vset1(1.f), e));
}
#endif

// Rows [0, rows) of `per_row` elements each, split across threads when there are enough of them.
template <typename Body>
void over_rows(int64_t rows, int64_t per_row, Body&& body) {
  const int64_t grain = std::max<int64_t>(1, kMinTaskElements / std::max<int64_t>(per_row, 1));
  if (rows <= grain) return body(0, rows);
  at::parallel_for(0, rows, grain, body);
}

// out = weight * (x / sqrt(mean(x^2) + eps)), the normalised row rounded to T before the scaling.
template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t dim, float eps) {
  over_rows(rows, dim, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * dim;
      T* yr = out + r * dim;
      int64_t c = 0;
      float squares = 0.f;
#if defined(TANDEM_SIMD)
      vfloat acc = vzero();
      for (; c + kLanes <= dim; c += kLanes) {
        const vfloat v = vload(xr + c);
        acc = vfmadd(v, v, acc);
      }
      squares = vsum(acc);
#endif
      for (int64_t i = c; i < dim; ++i) squares += widen(xr[i]) * widen(xr[i]);
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(dim) + eps);
      c = 0;
#if defined(TANDEM_SIMD)
      for (; c + kLanes <= dim; c += kLanes)
        store(yr + c, vmul(vload(w + c), vrounded(vmul(vload(xr + c), vset1(inv)), T{})));
#endif
      for (int64_t i = c; i < dim; ++i) yr[i] = T(widen(w[i]) * rounded(widen(xr[i]) * inv, T{}));
    }
  });
}

// out[i] = x[i] * cos[i] + x[(i + dim / 2) % dim] * sin[i] along each head's `dim` (sin negated in
// its first half by the caller), each product rounded to T, then the sum.
template <typename T>
void rope_rows(const T* x, int64_t row_stride, const T* cos, const T* sin, T* out, int64_t tokens, int64_t heads,
               int64_t dim) {
  const int64_t half = dim / 2;
  over_rows(tokens, heads * dim, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* ct = cos + t * dim;
      const T* st = sin + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xh = x + t * row_stride + h * dim;
        T* yh = out + (t * heads + h) * dim;
        int64_t i = 0;
#if defined(TANDEM_SIMD)
        if (half % kLanes == 0) {
          for (; i < dim; i += kLanes) {
            const int64_t j = i < half ? i + half : i - half;
            const vfloat a = vrounded(vmul(vload(xh + i), vload(ct + i)), T{});
            const vfloat b = vrounded(vmul(vload(xh + j), vload(st + i)), T{});
            store(yh + i, vadd(a, b));
          }
        }
#endif
        for (; i < dim; ++i) {
          const int64_t j = i < half ? i + half : i - half;
          yh[i] = T(rounded(widen(xh[i]) * widen(ct[i]), T{}) + rounded(widen(xh[j]) * widen(st[i]), T{}));
        }
      }
    }
  });
}

// out[r] = silu(gate_up[r, :width]) * gate_up[r, width:], silu rounded to T before the product.
template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t width) {
  over_rows(rows, width, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = gate_up + r * 2 * width;
      const T* u = g + width;
      T* y = out + r * width;
      int64_t c = 0;
#if defined(TANDEM_SIMD)
      for (; c + kLanes <= width; c += kLanes)
        store(y + c, vmul(vrounded(vsilu(vload(g + c)), T{}), vload(u + c)));
#endif
      for (; c < width; ++c) y[c] = T(rounded(silu(widen(g[c])), T{}) * widen(u[c]));
    }
  });
}

template <typename Body>
void with_dtype(const at::Tensor& x, const char* name, Body&& body) {
  switch (x.scalar_type()) {
    case at::kFloat: return body(float{});
    case at::kBFloat16: return body(c10::BFloat16{});
    case at::kHalf: return body(c10::Half{});
    default: TORCH_CHECK(false, name, " takes float32, bfloat16 or float16, not ", x.scalar_type());
  }
}

// x [rows, dim], weight [dim] of x's dtype.
inline at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1), "rms_norm: x [rows, dim], weight [dim]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight and x differ in dtype");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty_like(xc);
  with_dtype(x, "rms_norm", [&](auto zero) {
    using T = decltype(zero);
    rms_norm_rows(xc.data_ptr<T>(), wc.data_ptr<T>(), out.data_ptr<T>(), x.size(0), x.size(1),
                  static_cast<float>(eps));
  });
  return out;
}

// x [tokens, heads, dim] (each head's `dim` contiguous, heads adjacent: a view of a fused projection's
// columns), cos and sin [tokens, 1, dim] of x's dtype; a contiguous [tokens, heads, dim].
inline at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0, "rope: x [tokens, heads, even dim]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), "rope: dtypes differ");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(cos.numel() == tokens * dim && sin.numel() == tokens * dim, "rope: cos and sin [tokens, 1, dim]");
  const at::Tensor xc = x.stride(2) == 1 && x.stride(1) == dim ? x : x.contiguous();
  const at::Tensor cc = cos.contiguous(), sc = sin.contiguous();
  at::Tensor out = at::empty({tokens, heads, dim}, x.options());
  with_dtype(x, "rope", [&](auto zero) {
    using T = decltype(zero);
    rope_rows(xc.data_ptr<T>(), xc.stride(0), cc.data_ptr<T>(), sc.data_ptr<T>(), out.data_ptr<T>(), tokens, heads,
              dim);
  });
  return out;
}

// gate_up [rows, 2 * width] (gate, then up); [rows, width].
inline at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_mul: gate_up [rows, 2 * width]");
  const at::Tensor gc = gate_up.contiguous();
  const int64_t rows = gc.size(0), width = gc.size(1) / 2;
  at::Tensor out = at::empty({rows, width}, gc.options());
  with_dtype(gc, "silu_mul", [&](auto zero) {
    using T = decltype(zero);
    silu_mul_rows(gc.data_ptr<T>(), out.data_ptr<T>(), rows, width);
  });
  return out;
}

}  // namespace tandem::elementwise
