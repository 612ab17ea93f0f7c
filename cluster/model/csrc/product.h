// One of a decoder layer's products in `decode_layers` (`decode_layer.cpp`), given as the tensors its
// kernel reads, which say which kernel it is:
//   [weight]                              float weights: `skinny_linear`
//   [weight int8, scales float32]         per row [n] or per block of 32 columns: `skinny_linear_int8`
//   [nibbles uint8, scales, minimums]     int4 in groups of k / scales.size(1): `skinny_linear_int4`
//   [packed uint8, scales_and_zeros]      torch's int4 product (`_weight_int4pack_mm_for_cpu`), in
//                                         groups of k / scales_and_zeros.size(0) ([k / g, n, 2])
// each optionally followed by the bias. Called whole (`operator()`), or, in one parallel region, as
// its one-thread preparation (`prepare`) and each thread's `share` of the output's columns.
//
// It calls the other sources' kernels: `kernels.cpp` includes them first.

#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

#include "quantise.h"

namespace {

enum class Kind { kFloat, kInt8, kInt4, kTorchInt4 };

struct Product {
  Kind kind;
  const at::Tensor* bias;  // nullptr: none
  at::ArrayRef<at::Tensor> parts;

  explicit Product(at::ArrayRef<at::Tensor> p) : parts(p) {
    TORCH_CHECK(!p.empty(), "decode_layers: a product needs its weights");
    const at::ScalarType w = p[0].scalar_type();
    kind = w == at::kChar ? Kind::kInt8 : w != at::kByte ? Kind::kFloat
           : p.size() > 1 && p[1].dim() == 3 ? Kind::kTorchInt4 : Kind::kInt4;
    const size_t needed = kind == Kind::kFloat ? 1 : kind == Kind::kInt4 ? 3 : 2;
    TORCH_CHECK(p.size() == needed || p.size() == needed + 1, "decode_layers: a ", w, " product takes ", needed,
                " tensors and an optional bias, not ", p.size());
    bias = p.size() > needed ? &p[needed] : nullptr;
  }

  at::Tensor operator()(const at::Tensor& x) const {
    at::Tensor y;
    const int64_t k = x.size(1);
    switch (kind) {
      case Kind::kFloat: y = skinny_linear(x, parts[0]); break;
      case Kind::kInt8: y = skinny_linear_int8(x, parts[0], parts[1]); break;
      case Kind::kInt4: y = skinny_linear_int4(x, parts[0], parts[1], parts[2], k / parts[1].size(1)); break;
      case Kind::kTorchInt4: y = at::_weight_int4pack_mm_for_cpu(x, parts[0], k / parts[1].size(0), parts[1]); break;
    }
    return bias == nullptr ? y : y.add_(*bias);
  }

  // For `in_one_region`: its output columns, its inputs, and the bytes of a weight row.
  int64_t n() const { return parts[0].size(0); }
  int64_t k() const { return kind == Kind::kInt4 ? 2 * parts[0].size(1) : parts[0].size(1); }
  int64_t row_bytes() const {
    return std::max<int64_t>(1, kind == Kind::kFloat ? k() * parts[0].element_size() : kind == Kind::kInt4 ? k() / 2 : k());
  }

  // On one thread, before the shares: the inputs as the kernel reads them (quantised, or widened).
  template <typename T>
  void prepare(const T* x, int64_t rows) {
    const int64_t k = this->k();
    if (kind == Kind::kInt8) {
      a = quantise(x, rows, k, /*split=*/false, /*lane_columns=*/4);
    } else if (kind == Kind::kInt4) {
      a = quantise(x, rows, k, /*split=*/true, /*lane_columns=*/8);
      xsum = int4_group_sums(a, rows, k / parts[1].size(1));
    } else if (!bf16_pairs(parts[0].scalar_type(), k)) {
      widened.resize(rows * k);
      for (int64_t i = 0; i < rows * k; ++i) widened[i] = tandem::widen(x[i]);
    }
  }

  // A thread's share [n0, n1) of the output's columns, y [rows, n], after `prepare` of the same x.
  template <typename T>
  void share(const T* x, int64_t rows, int64_t n0, int64_t n1, T* y) const {
    const int64_t k = this->k(), n = this->n();
    switch (kind) {
      case Kind::kFloat: float_rows(widened.data(), x, parts[0].data_ptr<T>(), rows, k, n, n0, n1, y); break;
      case Kind::kInt8: int8_rows(a, rows, parts[0].data_ptr<int8_t>(), scales, parts[1].dim() == 2, n, n0, n1, y); break;
      case Kind::kInt4:
        int4_rows(a, rows, xsum.data(), parts[0].data_ptr<uint8_t>(), scales, minimums, k / parts[1].size(1), n, n0, n1, y);
        break;
      case Kind::kTorchInt4: break;  // never in one region (`in_one_region`)
    }
  }

  // After every share: the bias, rounded once as `add_` rounds it.
  template <typename T>
  void add_bias(T* y, int64_t rows) const {
    if (bias == nullptr) return;
    const T* b = bias->data_ptr<T>();
    const int64_t n = this->n();
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t j = 0; j < n; ++j) y[m * n + j] = T(tandem::widen(y[m * n + j]) + tandem::widen(b[j]));
  }

  // The scales (and minimums) as float32, once a pass (`as_float`: in place where they are).
  void keep_scales() {
    if (kind == Kind::kInt8 || kind == Kind::kInt4) scales = as_float(parts[1], scale_copy);
    if (kind == Kind::kInt4) minimums = as_float(parts[2], minimum_copy);
  }

  tandem::quant::Quantised a{};
  std::vector<float> xsum, widened, scale_copy, minimum_copy;
  const float* scales = nullptr;
  const float* minimums = nullptr;
};

}  // namespace
