// Products of a few rows with a weight matrix, y = x @ W^T, on CPU: decode's matrix products.
//
// With one to eight rows a product is bound by reading the weights, not by arithmetic, and torch's
// GEMM kernels read them at a fraction of the machine's bandwidth (`benchmarks/decode_roofline.py`).
// Here each thread streams its own contiguous range of weight rows once, converts them to float32 in
// registers, and accumulates every input row against them, so a step with eight rows (a batch of
// eight, or one sequence verifying seven draft tokens) reads the weights as often as a step with one.
// Several weight rows are in flight at a time to keep independent accumulator chains busy.
//
// `skinny_linear_int8` is the same product over int8 weights with a scale per weight row (per output
// channel, `cluster.model.quant.Int8Linear`): each row is widened in registers and its sum scaled
// once, so a step reads one byte a weight. `skinny_linear_int4` reads half a byte a weight
// (`Int4Linear`: two to a byte, a scale and a minimum per group of input columns): a group's products
// with the 4-bit values are summed, then scaled, and the minimum times the group's sum of inputs is
// added. The inputs are split once into their even and odd columns, so a vector of bytes widens
// into the low nibbles and the high ones, each multiplied against its half of the inputs without
// reordering.
//
// The CPU implementation of `tandem_cpu::skinny_linear`, which `cluster/model/cpu_kernels.py` defines,
// builds and loads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

using tandem::nibble;
using tandem::widen;
#if defined(TANDEM_SIMD)
using namespace tandem::simd;
#endif

constexpr int64_t kMaxRows = 64;
constexpr int kGroupRows = 8;                  // input rows accumulated against a weight row together
constexpr int64_t kTileBytes = 32 * 1024;      // weight rows a group pass covers, then re-read from cache
constexpr int64_t kMinTaskBytes = 32 * 1024;  // weight bytes per thread below which forking costs more
// Weight bytes a thread asks for ahead of the line it multiplies: left to the hardware prefetcher
// alone, too few lines are in flight to read at the machine's bandwidth, the more so in the short
// products of one layer.
constexpr int64_t kPrefetchBytes = 8192;

// A hint for the cache line `kPrefetchBytes` past p: past the end of the weights it loads a line
// nothing needs, and it never faults.
inline void prefetch_ahead(const void* p) { __builtin_prefetch(static_cast<const char*>(p) + kPrefetchBytes, 0, 3); }

// Hints for the first `kPrefetchBytes` of a thread's `bytes` of weights, which no line before them
// asks for.
inline void prefetch_first(const void* p, int64_t bytes) {
  const char* first = static_cast<const char*>(p);
  for (int64_t b = 0; b < std::min(bytes, kPrefetchBytes); b += 64) __builtin_prefetch(first + b, 0, 3);
}

// y[m * ldy + n] = <x[m], w[n]> (times scale[n] where `scale` is given) for n in [n0, n1), with x in
// float32, `Rows` rows of length k; accumulated in float32, stored as Y.
template <int Rows, typename W, typename Y>
void product(const float* x, const W* w, int64_t k, int64_t n0, int64_t n1, Y* y, int64_t ldy,
             const float* scale = nullptr) {
#if defined(TANDEM_SIMD)
  if (k % kLanes == 0) {
    for (int64_t n = n0; n < n1; ++n) {
      const W* row = w + n * k;
      vfloat acc[Rows];
      for (int m = 0; m < Rows; ++m) acc[m] = vzero();
      for (int64_t c = 0; c < k; c += kLanes) {
        if ((c * sizeof(W)) % 64 == 0) prefetch_ahead(row + c);  // one hint per 64-byte line
        const vfloat wv = vload(row + c);
        for (int m = 0; m < Rows; ++m) acc[m] = vfmadd(vload(x + m * k + c), wv, acc[m]);
      }
      const float s = scale != nullptr ? scale[n] : 1.f;
      for (int m = 0; m < Rows; ++m) y[m * ldy + n] = static_cast<Y>(vsum(acc[m]) * s);
    }
    return;
  }
#endif
  for (int64_t n = n0; n < n1; ++n) {
    const float s = scale != nullptr ? scale[n] : 1.f;
    for (int m = 0; m < Rows; ++m) {
      float sum = 0.f;
      for (int64_t c = 0; c < k; ++c) sum += x[m * k + c] * widen(w[n * k + c]);
      y[m * ldy + n] = static_cast<Y>(sum * s);
    }
  }
}

// y[m * ldy + n] = sum over groups of scale[n, g] * <x[m] in g, q[n] in g> + min[n, g] * xsum[m, g]
// for n in [n0, n1): `q` rows of k 4-bit values two to a byte, groups of `group` columns; `x` rows
// of k inputs, `xe` and `xo` [Rows, k / 2] their even and odd columns; `xsum` [Rows, k / group] the
// inputs' sum over each group.
template <int Rows, typename Y>
void product_int4(const float* x, const float* xe, const float* xo, const float* xsum, const uint8_t* q,
                  const float* scale, const float* low, int64_t k, int64_t group, int64_t n0, int64_t n1, Y* y,
                  int64_t ldy) {
  const int64_t half = k / 2;
  const int64_t groups = k / group;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = q + n * (k / 2);
    const float* s = scale + n * groups;
    const float* l = low + n * groups;
    float base[Rows];
    for (int m = 0; m < Rows; ++m) base[m] = 0.f;
#if defined(TANDEM_SIMD)
    if ((group / 2) % kLanes == 0) {
      vfloat total[Rows];
      for (int m = 0; m < Rows; ++m) total[m] = vzero();
      for (int64_t g = 0; g < groups; ++g) {
        vfloat acc[Rows];
        for (int m = 0; m < Rows; ++m) acc[m] = vzero();
        for (int64_t b = g * group / 2; b < (g + 1) * group / 2; b += kLanes) {  // kLanes bytes at a time
          if (b % 64 == 0) prefetch_ahead(row + b);
          vfloat even, odd;
          vload_nibble_pairs(row + b, even, odd);
          for (int m = 0; m < Rows; ++m) {
            acc[m] = vfmadd(vload(xe + m * half + b), even, acc[m]);
            acc[m] = vfmadd(vload(xo + m * half + b), odd, acc[m]);
          }
        }
        const vfloat sv = vset1(s[g]);
        for (int m = 0; m < Rows; ++m) {
          total[m] = vfmadd(sv, acc[m], total[m]);
          base[m] += l[g] * xsum[m * groups + g];
        }
      }
      for (int m = 0; m < Rows; ++m) y[m * ldy + n] = static_cast<Y>(vsum(total[m]) + base[m]);
      continue;
    }
#endif
    for (int m = 0; m < Rows; ++m) {
      float sum = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        float dot = 0.f;
        for (int64_t c = g * group; c < (g + 1) * group; ++c) dot += x[m * k + c] * nibble(row, c);
        sum += s[g] * dot + l[g] * xsum[m * groups + g];
      }
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

// Over weight rows [n0, n1): a tile of weight rows at a time, every group of up to eight input
// rows against it, so the tile comes from memory once and from cache for the other groups.
// `group(rows, first_row, t0, t1)` computes one group (rows as a compile-time constant).
template <typename Group>
void tiled(int64_t rows, int64_t n0, int64_t n1, int64_t tile, Group&& group) {
  for (int64_t t0 = n0; t0 < n1; t0 += tile) {
    const int64_t t1 = std::min(n1, t0 + tile);
    for (int64_t m = 0; m < rows; m += kGroupRows)
      tandem::with_count<kGroupRows>(std::min<int64_t>(kGroupRows, rows - m), [&](auto r) { group(r, m, t0, t1); });
  }
}

// The weight rows [0, y.size(1)) split across threads (each row `row_bytes` from `weights`), each
// thread's first lines asked for, and `group(r, m, t0, t1, yp)` called for every tile and group of
// input rows (`tiled`), `yp` the output's data as its dtype: float32, bfloat16 or float16.
template <typename Group>
void over_weight_rows(at::Tensor& y, const void* weights, int64_t row_bytes, const char* name, Group&& group) {
  const int64_t rows = y.size(0), n = y.size(1);
  const int64_t grain = std::max<int64_t>(8, kMinTaskBytes / row_bytes);
  const int64_t tile = std::max<int64_t>(1, kTileBytes / row_bytes);
  const char* first = static_cast<const char*>(weights);
  const auto run = [&](auto zero) {
    using scalar_t = decltype(zero);
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
      prefetch_first(first + n0 * row_bytes, (n1 - n0) * row_bytes);
      tiled(rows, n0, n1, tile, [&](auto r, int64_t m, int64_t t0, int64_t t1) { group(r, m, t0, t1, yp); });
    });
  };
  switch (y.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, name, " takes float32, bfloat16 or float16 activations");
  }
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
  const int64_t row_bytes = std::max<int64_t>(1, k * w.element_size());
#if defined(__AVX512BF16__)
  if (w.scalar_type() == at::kBFloat16 && k % 32 == 0) {
    const at::Tensor xc = x.contiguous();
    const auto* xp = xc.data_ptr<c10::BFloat16>();
    const auto* wp = w.data_ptr<c10::BFloat16>();
    over_weight_rows(y, wp, row_bytes, "skinny_linear", [&](auto r, int64_t m, int64_t t0, int64_t t1, auto* yp) {
      if constexpr (std::is_same_v<std::remove_pointer_t<decltype(yp)>, c10::BFloat16>)
        product_bf16<decltype(r)::value>(xp + m * k, wp, k, t0, t1, yp + m * n, n);
    });
    return y;
  }
#endif
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  over_weight_rows(y, w.data_ptr(), row_bytes, "skinny_linear", [&](auto r, int64_t m, int64_t t0, int64_t t1, auto* yp) {
    using W = std::remove_pointer_t<decltype(yp)>;  // the weights' dtype, the output's
    product<decltype(r)::value>(xp + m * k, static_cast<const W*>(w.data_ptr()), k, t0, t1, yp + m * n, n);
  });
  return y;
}

at::Tensor skinny_linear_int8(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "skinny_linear_int8 takes x [rows, k] and weight [n, k]");
  TORCH_CHECK(weight.scalar_type() == at::kChar, "skinny_linear_int8 takes int8 weights");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == weight.size(0), "skinny_linear_int8 takes a scale per weight row");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "skinny_linear_int8 runs on CPU tensors");
  TORCH_CHECK(x.size(0) <= kMaxRows, "skinny_linear_int8 takes at most ", kMaxRows, " rows, not ", x.size(0));
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0);
  const at::Tensor w = weight.contiguous();
  const at::Tensor s = scales.to(at::kFloat).contiguous();
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return y;
  const float* xp = xf.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  over_weight_rows(y, wp, std::max<int64_t>(1, k), "skinny_linear_int8",
                   [&](auto r, int64_t m, int64_t t0, int64_t t1, auto* yp) {
                     product<decltype(r)::value>(xp + m * k, wp, k, t0, t1, yp + m * n, n, sp);
                   });
  return y;
}

at::Tensor skinny_linear_int4(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scales,
                              const at::Tensor& minimums, int64_t group_size) {
  TORCH_CHECK(x.dim() == 2 && nibbles.dim() == 2 && x.size(1) == 2 * nibbles.size(1),
              "skinny_linear_int4 takes x [rows, k] and nibbles [n, k / 2]");
  TORCH_CHECK(nibbles.scalar_type() == at::kByte, "skinny_linear_int4 takes uint8 nibbles, two to a byte");
  const int64_t rows = x.size(0), k = x.size(1), n = nibbles.size(0);
  TORCH_CHECK(group_size > 0 && k % group_size == 0, "skinny_linear_int4: the group size must divide k");
  const int64_t groups = k / group_size;
  TORCH_CHECK(scales.sizes() == minimums.sizes() && scales.dim() == 2 && scales.size(0) == n &&
                  scales.size(1) == groups,
              "skinny_linear_int4 takes scales and minimums [n, k / group_size]");
  TORCH_CHECK(x.device().is_cpu() && nibbles.device().is_cpu(), "skinny_linear_int4 runs on CPU tensors");
  TORCH_CHECK(rows <= kMaxRows, "skinny_linear_int4 takes at most ", kMaxRows, " rows, not ", rows);
  const at::Tensor q = nibbles.contiguous();
  const at::Tensor s = scales.to(at::kFloat).contiguous();
  const at::Tensor l = minimums.to(at::kFloat).contiguous();
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor xsum = xf.view({rows, groups, group_size}).sum(-1).contiguous();
  const at::Tensor xe = xf.view({rows, k / 2, 2}).select(2, 0).contiguous();
  const at::Tensor xo = xf.view({rows, k / 2, 2}).select(2, 1).contiguous();
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return y;
  const float *xp = xf.data_ptr<float>(), *ep = xe.data_ptr<float>(), *op = xo.data_ptr<float>();
  const float *xs = xsum.data_ptr<float>(), *sp = s.data_ptr<float>(), *lp = l.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const int64_t half = k / 2;
  over_weight_rows(y, qp, std::max<int64_t>(1, half), "skinny_linear_int4",
                   [&](auto r, int64_t m, int64_t t0, int64_t t1, auto* yp) {
                     product_int4<decltype(r)::value>(xp + m * k, ep + m * half, op + m * half, xs + m * groups, qp,
                                                      sp, lp, k, group_size, t0, t1, yp + m * n, n);
                   });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("skinny_linear", &skinny_linear);
  m.impl("skinny_linear_int8", &skinny_linear_int8);
  m.impl("skinny_linear_int4", &skinny_linear_int4);
}
