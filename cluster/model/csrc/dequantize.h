// Quantised weights written out dense, for a prompt's products (`cluster.model.quant`'s `dense`):
// `tandem_cpu::dequantize_int8` and `_int4`, which `quantized_linear.cpp` registers (one translation
// unit: each one more compiles the ATen headers again, for every instruction set). The layouts are `quantized_linear.cpp`'s: int8 values with a scale a row or a block of 32
// columns, and 4-bit values two to a byte (the even column in the low nibble) with a scale and a
// minimum a group of columns.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "quantise.h"
#include "skinny.h"

namespace tandem::dequant {

using namespace tandem::quant;
using namespace tandem::skinny;

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

inline at::Tensor dequantize_int8(const at::Tensor& weight, const at::Tensor& scales, at::ScalarType dtype) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar, "dequantize_int8 takes int8 weights [n, k]");
  const int64_t n = weight.size(0), k = weight.size(1);
  const bool blocks = scales.dim() == 2;
  TORCH_CHECK(scales.size(0) == n && (scales.dim() == 1 || (blocks && k % kBlock == 0 && scales.size(1) == k / kBlock)),
              "dequantize_int8 takes a scale per weight row [n], or per block of ", kBlock, " columns");
  const at::Tensor w = weight.contiguous();
  std::vector<float> scale_copy;
  const float* s = as_float(scales, scale_copy);
  const int8_t* wp = w.data_ptr<int8_t>();
  const int64_t step = blocks ? kBlock : k;  // the columns one scale covers
  return dequantized(n, k, dtype, [&](int64_t r, auto* out) {
    using Y = std::remove_pointer_t<decltype(out)>;
    const int8_t* row = wp + r * k;
    for (int64_t c0 = 0; c0 < k; c0 += step) {  // a loop the compiler vectorises: one scale throughout
      const float scale = blocks ? s[r * (k / kBlock) + c0 / kBlock] : s[r];
      for (int64_t c = c0; c < c0 + step; ++c) out[c] = static_cast<Y>(static_cast<float>(row[c]) * scale);
    }
  });
}

inline at::Tensor dequantize_int4(const at::Tensor& nibbles, const at::Tensor& scales, const at::Tensor& minimums,
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

}  // namespace tandem::dequant
