// The decoder layers' decode pass in one parallel region (`in_one_region`), which `decode_layer.cpp`'s
// `decode_layers` runs where every product is one of the kernels' own, and the cache row writes it
// shares with that file's layer-by-layer path.
//
// It calls the other sources' kernels: `kernels.cpp` includes them first.

#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <memory>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "cache_rows.h"
#include "elementwise.h"
#include "product.h"

namespace {

// One row of `dim` values as the int8 cache stores it (`cluster/model/attention.py`'s `quantize_rows`):
// each value over the row's max-abs / 127, rounded half to even, then the float32 scale.
template <typename S>
void quantise_row(const S* v, int64_t dim, uint8_t* out) {
  float top = 0.f;
  for (int64_t i = 0; i < dim; ++i) top = std::max(top, std::fabs(tandem::widen(v[i])));
  const float scale = std::max(top / 127.f, 1e-8f);
  for (int64_t i = 0; i < dim; ++i) {
    const float q = std::clamp(std::nearbyint(tandem::widen(v[i]) / scale), -127.f, 127.f);
    out[i] = static_cast<uint8_t>(static_cast<int8_t>(q));
  }
  std::memcpy(out + dim, &scale, sizeof(scale));
}

// The new keys or values `src` [T, kv_heads, dim] (row t at `src + t * stride`) written into their
// slots, as `write_rows` writes them; on one thread.
template <typename T>
void write_kv(const T* src, int64_t stride, int64_t tokens, int64_t heads, int64_t dim, const at::Tensor& cache,
              const int64_t* slot) {
  const int64_t row_elems = cache.size(3);
  if (cache.scalar_type() == at::kByte) {
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t h = 0; h < heads; ++h)
        quantise_row(src + t * stride + h * dim, dim, cache.data_ptr<uint8_t>() + (slot[t] * heads + h) * row_elems);
    return;
  }
  tandem::with_kv_types(c10::CppTypeToScalarType<T>::value, cache.scalar_type(), "decode_layers", [&](auto, auto element) {
    using C = decltype(element);
    C* base = cache.data_ptr<C>();
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t i = 0; i < dim; ++i)
          base[(slot[t] * heads + h) * row_elems + i] = static_cast<C>(tandem::widen(src[t * stride + h * dim + i]));
  });
}

// What `in_one_region` takes besides the products: shapes, the caches and the attention's inputs.
struct Pass {
  int64_t rows, hidden, heads, kv_heads, dim, threads;
  double scale, eps;
  at::ArrayRef<at::Tensor> weights;  // every layer's: two norms, then its products' tensors
  std::vector<size_t> first;         // where each layer's begin in `weights`
  at::TensorList k_caches, v_caches, masks;
  at::IntArrayRef mask_of;
  const int64_t* slots;
  const at::Tensor* block_tables;
};

// Every layer's pass in one parallel region (`decode_layers` says when). The threads stay in it from
// the first layer to the last: each takes its share of every product's weight rows and of attention's
// tasks, split as the kernels called alone split them (`share_of`), so the results are the same
// bits; one thread does the row-wise steps between them (norms, rotary embedding, cache writes,
// residual sums) into buffers kept for the whole pass. Called alone, the kernels fork and join
// torch's threads five times a layer, and between them the second thread waited while the first
// allocated and dispatched the steps between: a third of its time in an int8 SmolLM2-135M step.
// In one region that pass ran 1.23x as fast on two cores of an AMD Zen 3 (int4 1.09x; float32, bound
// by reading four times the bytes, 1.02x).
template <typename T, typename Rows>
struct Region {
  using Cache = Rows (*)(const at::Tensor&);

  Region(const Pass& pass, std::vector<Product>& own, T* hidden, const T* c, const T* s, Cache rows)
      : p(pass), products(own), h(hidden), cos(c), sin(s), rows_of(rows), qkv_n(own[0].n()), inter(own[3].k()),
        normed(p.rows * p.hidden), qkv(p.rows * qkv_n), q(p.rows * q_size), k(p.rows * kv_size),
        attended(p.rows * q_size), o(p.rows * p.hidden), gate_up(p.rows * 2 * inter), act(p.rows * inter),
        down(p.rows * p.hidden) {}

  // Each thread of the region runs it: every layer, until one fails (rethrown after the region).
  void run(int64_t tid, int64_t threads) {
    for (size_t i = 0; i < p.first.size(); ++i)
      if (!layer(i, tid, threads)) break;
  }

  // One layer: the row-wise steps on one thread (`serial`), each product and attention over all.
  bool layer(size_t i, int64_t tid, int64_t threads) {
    using namespace tandem::elementwise;
    const at::Tensor* w = p.weights.data() + p.first[i];
    Product* own = products.data() + 4 * i;
    const int64_t rows = p.rows;
    const auto step = [&](const Product& product, const T* x, T* y) {
      split(product.n(), tandem::skinny::grain_of(product.row_bytes()), tid, threads,
            [&](int64_t n0, int64_t n1) { product.share(x, rows, n0, n1, y); });
    };
    if (!serial([&] {
          rms_norm_rows(h, w[0].data_ptr<T>(), normed.data(), rows, p.hidden, eps);
          own[0].prepare(normed.data(), rows);
        }))
      return false;
    step(own[0], normed.data(), qkv.data());
    if (!serial([&] { own[0].add_bias(qkv.data(), rows); attention_inputs(i); })) return false;
    split(attend->tasks(), attend->kTaskGrain, tid, threads, [&](int64_t b, int64_t e) { attend->part(b, e); });
    split(attend->merges(), attend->kMergeGrain, tid, threads, [&](int64_t b, int64_t e) { attend->merge(b, e); });
    if (!serial([&] { own[1].prepare(attended.data(), rows); })) return false;
    step(own[1], attended.data(), o.data());
    if (!serial([&] {
          own[1].add_bias(o.data(), rows);
          add_into(h, o.data());
          rms_norm_rows(h, w[1].data_ptr<T>(), normed.data(), rows, p.hidden, eps);
          own[2].prepare(normed.data(), rows);
        }))
      return false;
    step(own[2], normed.data(), gate_up.data());
    if (!serial([&] {
          own[2].add_bias(gate_up.data(), rows);
          silu_mul_rows(gate_up.data(), act.data(), rows, inter);
          own[3].prepare(act.data(), rows);
        }))
      return false;
    step(own[3], act.data(), down.data());
    return serial([&] { own[3].add_bias(down.data(), rows); add_into(h, down.data()); });
  }

  // On one thread: the rotary embedding, the new keys and values into layer i's caches, and its
  // attention over them.
  void attention_inputs(size_t i) {
    using namespace tandem::elementwise;
    rope_rows(qkv.data(), qkv_n, cos, sin, q.data(), p.rows, p.heads, p.dim);
    rope_rows(qkv.data() + q_size, qkv_n, cos, sin, k.data(), p.rows, p.kv_heads, p.dim);
    write_kv(k.data(), kv_size, p.rows, p.kv_heads, p.dim, p.k_caches[i], p.slots);
    write_kv(qkv.data() + q_size + kv_size, qkv_n, p.rows, p.kv_heads, p.dim, p.v_caches[i], p.slots);
    const at::Tensor& mask = p.masks[p.mask_of[i]];
    attend = std::make_unique<Attend<T, Rows>>(
        q.data(), rows_of(p.k_caches[i]), rows_of(p.v_caches[i]), p.block_tables->data_ptr<int64_t>(),
        mask.data_ptr<bool>(), p.rows, p.heads, p.dim, p.block_tables->size(1), mask.size(-1), p.k_caches[i].size(1),
        p.kv_heads, p.threads, p.scale, attended.data());
  }

  // `step` on one thread, the others waiting at its end; a failure stops every thread after it.
  template <typename Step>
  bool serial(Step&& step) {
#pragma omp single
    {
      try {
        if (error == nullptr) step();
      } catch (...) {
        error = std::current_exception();
      }
    }
    return error == nullptr;
  }

  // This thread's share of [0, n), split as the kernels called alone split it; then every thread waits.
  template <typename Work>
  void split(int64_t n, int64_t grain, int64_t tid, int64_t threads, Work&& work) {
    const auto [n0, n1] = tandem::skinny::share_of(n, grain, tid, threads);
    try {
      if (n0 < n1) work(n0, n1);
    } catch (...) {
#pragma omp critical
      error = std::current_exception();
    }
#pragma omp barrier
  }

  // The residual sum into h, rounded as torch's `add` rounds it.
  void add_into(T* into, const T* y) const {
    for (int64_t j = 0; j < p.rows * p.hidden; ++j) into[j] = T(tandem::widen(into[j]) + tandem::widen(y[j]));
  }

  const Pass& p;
  std::vector<Product>& products;
  T* h;
  const T *cos, *sin;
  Cache rows_of;
  const int64_t q_size = p.heads * p.dim, kv_size = p.kv_heads * p.dim, qkv_n, inter;
  const float eps = static_cast<float>(p.eps);
  std::vector<T> normed, qkv, q, k, attended, o, gate_up, act, down;  // kept for the whole pass
  std::unique_ptr<Attend<T, Rows>> attend;
  std::exception_ptr error;
};

template <typename T, typename Rows>
void in_one_region(const Pass& p, std::vector<Product>& products, T* h, const T* cos, const T* sin,
                   Rows (*rows_of)(const at::Tensor&)) {
  Region<T, Rows> region(p, products, h, cos, sin, rows_of);
#pragma omp parallel
  {
#if defined(_OPENMP)
    region.run(omp_get_thread_num(), omp_get_num_threads());
#else
    region.run(0, 1);
#endif
  }
  if (region.error != nullptr) std::rethrow_exception(region.error);
}

}  // namespace
