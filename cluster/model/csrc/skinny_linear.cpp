// Products of a few rows with a weight matrix, y = x @ W^T, on CPU: decode's matrix products.
//
// With one to eight rows a product is bound by reading the weights, not by arithmetic, and torch's
// GEMM kernels read them at a fraction of the machine's bandwidth (`benchmarks/decode_roofline.py`).
// Here each thread streams its own contiguous range of weight rows once, converts them to float32 in
// registers, and accumulates every input row against them, so a step with eight rows (a batch of
// eight, or one sequence verifying seven draft tokens) reads the weights as often as a step with one.
// Each row's sums alternate between two accumulators, vector by vector (`skinny.h`'s `alternate`).
//
// Products over int8 and int4 weights are in `quantized_linear.cpp`.
//
// The CPU implementation of `tandem_cpu::skinny_linear`, and the registration of `elementwise.h`'s
// `rms_norm`, `rope` and `silu_mul` and `tile_linear.h`'s `tile_pack`, `tile_linear` and `tile_amx`,
// which `cluster/model/cpu_kernels.py` defines, builds and loads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "elementwise.h"
#include "skinny.h"
#include "tile_linear.h"
#include "vec.h"

namespace {

using namespace tandem::skinny;
using tandem::widen;
#if defined(TANDEM_SIMD)
using namespace tandem::simd;
#endif

// y[m * ldy + n] = <x[m], w[n]> for n in [n0, n1), with x in float32, `Rows` rows of length k;
// accumulated in float32, stored as Y.
template <int Rows, typename W, typename Y>
void product(const float* x, const W* w, int64_t k, int64_t n0, int64_t n1, Y* y, int64_t ldy) {
#if defined(TANDEM_SIMD)
  if (k % kLanes == 0) {
    for (int64_t n = n0; n < n1; ++n) {
      const W* row = w + n * k;
      vfloat even[Rows], odd[Rows];
      for (int m = 0; m < Rows; ++m) even[m] = odd[m] = vzero();
      const auto lanes = [&](int64_t c, vfloat* acc) TANDEM_INLINE {
        const vfloat wv = vload(row + c);
        for (int m = 0; m < Rows; ++m) acc[m] = vfmadd(vload(x + m * k + c), wv, acc[m]);
      };
      const auto ahead = [&](int64_t c) TANDEM_INLINE {
        if ((c * sizeof(W)) % 64 == 0) prefetch_ahead(row + c);  // one hint per 64-byte line
        if ((kLanes * sizeof(W)) % 64 == 0) prefetch_ahead(row + c + kLanes);
      };
      alternate(k, kLanes, even, odd, ahead, lanes);
      for (int m = 0; m < Rows; ++m) y[m * ldy + n] = static_cast<Y>(vsum(vadd(even[m], odd[m])));
    }
    return;
  }
#endif
  for (int64_t n = n0; n < n1; ++n) {
    for (int m = 0; m < Rows; ++m) {
      float sum = 0.f;
      for (int64_t c = 0; c < k; ++c) sum += x[m * k + c] * widen(w[n * k + c]);
      y[m * ldy + n] = static_cast<Y>(sum);
    }
  }
}

#if defined(__AVX512BF16__)
// The same with bfloat16 rows and weights: each instruction multiplies 32 pairs and adds them in
// pairs into 16 float32 lanes, half the arithmetic of widening first (which more rows need).
template <int Rows>
void product_bf16(const c10::BFloat16* x, const c10::BFloat16* w, int64_t k, int64_t n0, int64_t n1,
                  c10::BFloat16* y, int64_t ldy) {
  for (int64_t n = n0; n < n1; ++n) {
    const c10::BFloat16* row = w + n * k;
    __m512 acc[Rows];
    for (int m = 0; m < Rows; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t c = 0; c < k; c += 32) {
      prefetch_ahead(row + c);
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(row + c);
      for (int m = 0; m < Rows; ++m)
        acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_loadu_si512(x + m * k + c), wv);
    }
    for (int m = 0; m < Rows; ++m) y[m * ldy + n] = static_cast<c10::BFloat16>(_mm512_reduce_add_ps(acc[m]));
  }
}
#endif

// Whether bfloat16 weights multiply bfloat16 inputs as they are (AVX512-BF16 pair products) rather
// than the inputs widened to float32 first.
inline bool bf16_pairs(at::ScalarType weights, int64_t k) {
#if defined(__AVX512BF16__)
  return weights == at::kBFloat16 && k % 32 == 0;
#else
  (void)weights, (void)k;
  return false;
#endif
}

// One thread's share [n0, n1) of y [rows, n] = x @ W^T, W [n, k] of the inputs' dtype: `xf` the
// inputs widened to float32, or (`bf16_pairs`) `x` as they are.
template <typename W>
void float_rows(const float* xf, const W* x, const W* w, int64_t rows, int64_t k, int64_t n, int64_t n0, int64_t n1,
                W* y) {
  const int64_t row_bytes = std::max<int64_t>(1, k * static_cast<int64_t>(sizeof(W)));
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<W, c10::BFloat16>) {
    if (bf16_pairs(at::kBFloat16, k)) {
      weight_rows(rows, n0, n1, w, row_bytes, [&](auto r, int64_t m, int64_t t0, int64_t t1) {
        product_bf16<decltype(r)::value>(x + m * k, w, k, t0, t1, y + m * n, n);
      });
      return;
    }
  }
#endif
  (void)x;
  weight_rows(rows, n0, n1, w, row_bytes, [&](auto r, int64_t m, int64_t t0, int64_t t1) {
    product<decltype(r)::value>(xf + m * k, w, k, t0, t1, y + m * n, n);
  });
}

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "skinny_linear takes x [rows, k] and weight [n, k]");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "skinny_linear runs on CPU tensors");
  TORCH_CHECK(x.size(0) <= kMaxRows, "skinny_linear takes at most ", kMaxRows, " rows, not ", x.size(0));
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight must share a dtype");
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0);
  const at::Tensor w = weight.contiguous();
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return y;
  const bool pairs = bf16_pairs(w.scalar_type(), k);
  const at::Tensor xc = x.contiguous(), xf = pairs ? xc : x.to(at::kFloat).contiguous();
  with_output(y, "skinny_linear", [&](auto zero) {
    using W = decltype(zero);  // the weights' dtype, the output's
    const float* xp = pairs ? nullptr : xf.data_ptr<float>();
    over_weight_rows(n, std::max<int64_t>(1, k * w.element_size()), [&](int64_t n0, int64_t n1) {
      float_rows(xp, xc.data_ptr<W>(), w.data_ptr<W>(), rows, k, n, n0, n1, y.data_ptr<W>());
    });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("skinny_linear", &skinny_linear);
  m.impl("rms_norm", &tandem::elementwise::rms_norm);
  m.impl("rope", &tandem::elementwise::rope);
  m.impl("silu_mul", &tandem::elementwise::silu_mul);
  m.impl("tile_pack", &tandem::tiles::tile_pack);
  m.impl("tile_linear", &tandem::tiles::tile_linear);
}

TORCH_LIBRARY_IMPL(tandem_cpu, CatchAll, m) { m.impl("tile_amx", [] { return tandem::tiles::amx(); }); }
