// The decoder layers' decode step as one call: `tandem_cpu::decode_layers`.
//
// An eager decode step runs each layer as about fifteen torch operations from Python (two norms, four
// products, the split, the rotary embedding, two cache writes, attention, two residual sums,
// silu(gate) * up), and in a small model their dispatch costs more than the weights take to read: an
// int8 SmolLM2-135M step on two cores spent 6 of its 15.6 ms outside every kernel. Here the layer is a
// sequence of the same kernels called from C++ (`skinny_linear*`, `elementwise.h`, `decode_attention`),
// with nothing between them but what they read and write, every layer in turn: where every product
// is one of the kernels' own, all in one parallel region (`in_one_region`); else the kernels one by
// one, each keeping its own threads (`decode_layer`).
//
// A product is given as the tensors its kernel reads, which say which kernel it is (`Product`):
//   [weight]                              float weights: `skinny_linear`
//   [weight int8, scales float32]         per row [n] or per block of 32 columns: `skinny_linear_int8`
//   [nibbles uint8, scales, minimums]     int4 in groups of k / scales.size(1): `skinny_linear_int4`
//   [packed uint8, scales_and_zeros]      torch's int4 product (`_weight_int4pack_mm_for_cpu`), in
//                                         groups of k / scales_and_zeros.size(0) ([k / g, n, 2])
// each optionally followed by the bias. `cluster/model/causal_lm.py` (`CausalLM.decode_natively`)
// builds them from the layers' modules (`native_parts`), which multiply the same way when called alone.
//
// It calls the other sources' kernels, so `kernels.cpp` includes it after them.

#include <ATen/ATen.h>
#include <torch/library.h>

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

// Writes the new keys or values `rows` [T, kv_heads, head_dim] (each row's values adjacent) into
// their slots of the cache, in its element type: as they are, rounded to a 16-bit cache's type, or
// quantised for an int8 cache.
void write_rows(const at::Tensor& rows, const at::Tensor& cache, const at::Tensor& slots) {
  const int64_t tokens = rows.size(0), heads = rows.size(1), dim = rows.size(2), row_elems = cache.size(3);
  TORCH_CHECK(rows.stride(2) == 1 && cache.is_contiguous() && cache.size(2) == heads, "decode_layers: bad KV rows");
  TORCH_CHECK(slots.scalar_type() == at::kLong, "decode_layers: slots must be int64");
  const at::Tensor slot_list = slots.contiguous();
  const int64_t* slot = slot_list.data_ptr<int64_t>();
  const int64_t num_slots = cache.size(0) * cache.size(1);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot ", slot[t], " outside the cache's ", num_slots);
  const auto each_row = [&](auto zero, auto* base, auto&& write) {
    using S = decltype(zero);
    const S* src = rows.data_ptr<S>();
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t h = 0; h < heads; ++h)
        write(src + t * rows.stride(0) + h * rows.stride(1), base + (slot[t] * heads + h) * row_elems);
  };
  if (cache.scalar_type() == at::kByte) {
    tandem::elementwise::with_dtype(rows, "decode_layers", [&](auto zero) {
      each_row(zero, cache.data_ptr<uint8_t>(), [&](const auto* src, uint8_t* dst) { quantise_row(src, dim, dst); });
    });
    return;
  }
  tandem::with_kv_types(rows.scalar_type(), cache.scalar_type(), "decode_layers", [&](auto zero, auto element) {
    using C = decltype(element);
    each_row(zero, cache.data_ptr<C>(), [&](const auto* src, C* dst) {
      for (int64_t i = 0; i < dim; ++i) dst[i] = static_cast<C>(tandem::widen(src[i]));
    });
  });
}

// One layer: `weights` holds its input and post-attention norms, then its four products' tensors
// (`Product`), `counts` how many tensors each product has.
at::Tensor decode_layer(const at::Tensor& x, at::ArrayRef<at::Tensor> weights, at::IntArrayRef counts,
                        const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& block_tables,
                        const at::Tensor& mask, int64_t heads, int64_t kv_heads, double scale, double eps) {
  const int64_t tokens = x.size(0), dim = k_cache.size(3) - (k_cache.scalar_type() == at::kByte ? tandem::kScaleBytes : 0);
  const int64_t q_size = heads * dim, kv_size = kv_heads * dim;
  std::vector<Product> products;
  size_t next = 2;
  for (const int64_t n : counts) {
    products.emplace_back(weights.slice(next, n));
    next += n;
  }
  const Product &qkv_proj = products[0], &o_proj = products[1], &gate_up_proj = products[2], &down_proj = products[3];

  const at::Tensor qkv = qkv_proj(tandem::elementwise::rms_norm(x, weights[0], eps));
  TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "decode_layers: the q/k/v product gives ", qkv.size(1),
              " columns, not ", q_size + 2 * kv_size);
  const at::Tensor q = tandem::elementwise::rope(qkv.narrow(1, 0, q_size).view({tokens, heads, dim}), cos, sin);
  write_rows(tandem::elementwise::rope(qkv.narrow(1, q_size, kv_size).view({tokens, kv_heads, dim}), cos, sin), k_cache,
             slots);
  write_rows(qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, kv_heads, dim}), v_cache, slots);
  at::Tensor h = x + o_proj(decode_attention(q, k_cache, v_cache, block_tables, mask, scale));

  const at::Tensor gate_up = gate_up_proj(tandem::elementwise::rms_norm(h, weights[1], eps));
  return h.add_(down_proj(tandem::elementwise::silu_mul(gate_up)));
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
void in_one_region(const Pass& p, std::vector<Product>& products, T* h, const T* cos, const T* sin,
                   Rows (*rows_of)(const at::Tensor&)) {
  using namespace tandem::elementwise;
  const int64_t rows = p.rows, q_size = p.heads * p.dim, kv_size = p.kv_heads * p.dim;
  const int64_t qkv_n = products[0].n(), inter = products[3].k();
  std::vector<T> normed(rows * p.hidden), qkv(rows * qkv_n), q(rows * q_size), k(rows * kv_size),
      attended(rows * q_size), o(rows * p.hidden), gate_up(rows * 2 * inter), act(rows * inter), down(rows * p.hidden);
  std::unique_ptr<Attend<T, Rows>> attend;
  std::exception_ptr error;
  const float eps = static_cast<float>(p.eps);
#pragma omp parallel
  {
#if defined(_OPENMP)
    const int64_t tid = omp_get_thread_num(), threads = omp_get_num_threads();
#else
    const int64_t tid = 0, threads = 1;
#endif
    // `step` on one thread, the others waiting at its end; a failure stops every thread after it.
    const auto serial = [&](auto&& step) {
#pragma omp single
      {
        try {
          if (error == nullptr) step();
        } catch (...) {
          error = std::current_exception();
        }
      }
      return error == nullptr;
    };
    const auto split = [&](int64_t n, int64_t grain, auto&& work) {
      const auto [n0, n1] = tandem::skinny::share_of(n, grain, tid, threads);
      try {
        if (n0 < n1) work(n0, n1);
      } catch (...) {
#pragma omp critical
        error = std::current_exception();
      }
#pragma omp barrier
    };
    const auto product = [&](const Product& product, const T* x, T* y) {
      split(product.n(), tandem::skinny::grain_of(product.row_bytes()),
            [&](int64_t n0, int64_t n1) { product.share(x, rows, n0, n1, y); });
    };
    for (size_t i = 0; i < p.first.size(); ++i) {
      const at::Tensor* w = p.weights.data() + p.first[i];
      Product* own = products.data() + 4 * i;
      if (!serial([&] {
            rms_norm_rows(h, w[0].data_ptr<T>(), normed.data(), rows, p.hidden, eps);
            own[0].prepare(normed.data(), rows);
          }))
        break;
      product(own[0], normed.data(), qkv.data());
      if (!serial([&] {
            own[0].add_bias(qkv.data(), rows);
            rope_rows(qkv.data(), qkv_n, cos, sin, q.data(), rows, p.heads, p.dim);
            rope_rows(qkv.data() + q_size, qkv_n, cos, sin, k.data(), rows, p.kv_heads, p.dim);
            write_kv(k.data(), kv_size, rows, p.kv_heads, p.dim, p.k_caches[i], p.slots);
            write_kv(qkv.data() + q_size + kv_size, qkv_n, rows, p.kv_heads, p.dim, p.v_caches[i], p.slots);
            const at::Tensor& mask = p.masks[p.mask_of[i]];
            attend = std::make_unique<Attend<T, Rows>>(
                q.data(), rows_of(p.k_caches[i]), rows_of(p.v_caches[i]), p.block_tables->data_ptr<int64_t>(),
                mask.data_ptr<bool>(), rows, p.heads, p.dim, p.block_tables->size(1), mask.size(-1),
                p.k_caches[i].size(1), p.kv_heads, p.threads, p.scale, attended.data());
          }))
        break;
      split(attend->tasks(), attend->kTaskGrain, [&](int64_t b, int64_t e) { attend->part(b, e); });
      split(attend->merges(), attend->kMergeGrain, [&](int64_t b, int64_t e) { attend->merge(b, e); });
      if (!serial([&] { own[1].prepare(attended.data(), rows); })) break;
      product(own[1], attended.data(), o.data());
      if (!serial([&] {
            own[1].add_bias(o.data(), rows);
            for (int64_t j = 0; j < rows * p.hidden; ++j) h[j] = T(tandem::widen(h[j]) + tandem::widen(o[j]));
            rms_norm_rows(h, w[1].data_ptr<T>(), normed.data(), rows, p.hidden, eps);
            own[2].prepare(normed.data(), rows);
          }))
        break;
      product(own[2], normed.data(), gate_up.data());
      if (!serial([&] {
            own[2].add_bias(gate_up.data(), rows);
            silu_mul_rows(gate_up.data(), act.data(), rows, inter);
            own[3].prepare(act.data(), rows);
          }))
        break;
      product(own[3], act.data(), down.data());
      if (!serial([&] {
            own[3].add_bias(down.data(), rows);
            for (int64_t j = 0; j < rows * p.hidden; ++j) h[j] = T(tandem::widen(h[j]) + tandem::widen(down[j]));
          }))
        break;
    }
  }
  if (error != nullptr) std::rethrow_exception(error);
}

// Whether every layer's pass can run `in_one_region`, checked as the kernels called alone would check
// it (any failure there would be theirs): float, int8 and int4 products of the activations' dtype
// (torch's int4 product keeps its own threads), contiguous caches and masks, every slot and block in
// its cache. Sets `p.first` and builds `products`.
bool one_region_fits(Pass& p, const at::Tensor& x, at::IntArrayRef counts, std::vector<Product>& products) {
  const int64_t layers = static_cast<int64_t>(p.k_caches.size());
  size_t next = 0;
  for (int64_t i = 0; i < layers; ++i) {
    p.first.push_back(next);
    next += 2;
    for (int64_t j = 0; j < 4; ++j) {
      products.emplace_back(p.weights.slice(next, counts[4 * i + j]));
      next += counts[4 * i + j];
    }
  }
  const int64_t q_size = p.heads * p.dim, kv_size = p.kv_heads * p.dim;
  for (int64_t i = 0; i < layers; ++i) {
    Product* own = products.data() + 4 * i;
    const int64_t inputs[4] = {p.hidden, q_size, p.hidden, own[2].n() / 2};
    const int64_t outputs[4] = {q_size + 2 * kv_size, p.hidden, 2 * own[3].k(), p.hidden};
    for (int j = 0; j < 4; ++j) {
      const Product& pr = own[j];
      for (const at::Tensor& t : pr.parts)
        if (!t.is_contiguous()) return false;
      if (pr.kind == Kind::kTorchInt4 || (pr.kind == Kind::kFloat && pr.parts[0].scalar_type() != x.scalar_type()) ||
          pr.k() != inputs[j] || pr.n() != outputs[j] || pr.n() == 0 ||
          (pr.bias != nullptr && (pr.bias->numel() != pr.n() || pr.bias->scalar_type() != x.scalar_type())))
        return false;
    }
    const at::Tensor* w = p.weights.data() + p.first[i];
    for (const at::Tensor& norm : {w[0], w[1]})
      if (norm.numel() != p.hidden || norm.scalar_type() != x.scalar_type() || !norm.is_contiguous()) return false;
  }
  return true;
}

at::Tensor decode_layers(const at::Tensor& x, at::TensorList weights, at::IntArrayRef counts, const at::Tensor& cos,
                         const at::Tensor& sin, at::TensorList k_caches, at::TensorList v_caches,
                         const at::Tensor& slots, const at::Tensor& block_tables, at::TensorList masks,
                         at::IntArrayRef mask_of, int64_t heads, int64_t kv_heads, double scale, double eps) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(x.dim() == 2 && slots.numel() == x.size(0), "decode_layers takes x [T, hidden] and a slot per row");
  TORCH_CHECK(v_caches.size() == k_caches.size() && static_cast<int64_t>(mask_of.size()) == layers &&
                  static_cast<int64_t>(counts.size()) == 4 * layers,
              "decode_layers: a cache pair, a mask and four products per layer");
  size_t first = 0;
  for (int64_t i = 0; i < layers; ++i) {
    size_t size = 2;
    for (const int64_t n : counts.slice(4 * i, 4)) size += n;
    TORCH_CHECK(first + size <= weights.size() && mask_of[i] >= 0 && mask_of[i] < static_cast<int64_t>(masks.size()),
                "decode_layers: layer ", i, "'s weights or mask are missing");
    first += size;
  }
  if (layers > 0 && x.size(0) > 0) {
    const at::Tensor& cache = k_caches[0];
    const bool int8 = cache.scalar_type() == at::kByte;
    Pass p{x.size(0), x.size(1), heads, kv_heads, cache.size(3) - (int8 ? tandem::kScaleBytes : 0),
           at::get_num_threads(), scale, eps, weights, {}, k_caches, v_caches, masks, mask_of, nullptr, &block_tables};
    std::vector<Product> products;
    bool fits = one_region_fits(p, x, counts, products) && x.is_contiguous() && slots.scalar_type() == at::kLong &&
                block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && cos.is_contiguous() &&
                sin.is_contiguous() && cos.numel() == x.size(0) * p.dim && sin.numel() == cos.numel() &&
                cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type() && heads % kv_heads == 0;
    for (int64_t i = 0; fits && i < layers; ++i) {
      const at::Tensor &k = k_caches[i], &v = v_caches[i], &mask = masks[mask_of[i]];
      fits = k.is_contiguous() && v.is_contiguous() && k.sizes() == cache.sizes() && v.sizes() == cache.sizes() &&
             k.scalar_type() == cache.scalar_type() && v.scalar_type() == cache.scalar_type() &&
             cache.size(2) == kv_heads && mask.scalar_type() == at::kBool && mask.is_contiguous() &&
             mask.numel() == x.size(0) * block_tables.size(1) * cache.size(1) && block_tables.size(0) == x.size(0);
    }
    if (fits) {
      const at::Tensor slot_list = slots.contiguous();
      const int64_t* slot = slot_list.data_ptr<int64_t>();
      const int64_t num_slots = cache.size(0) * cache.size(1), num_blocks = cache.size(0);
      for (int64_t t = 0; t < x.size(0); ++t)
        TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot ", slot[t], " outside the cache's ", num_slots);
      const int64_t* table = block_tables.data_ptr<int64_t>();
      for (int64_t i = 0; i < block_tables.numel(); ++i)
        TORCH_CHECK(table[i] >= 0 && table[i] < num_blocks, "block table entry ", table[i], " outside the cache's ",
                    num_blocks, " blocks");
      p.slots = slot;
      for (Product& product : products) product.keep_scales();
      at::Tensor h = x.clone();
      const auto run = [&](auto zero, auto rows_of) {
        using T = decltype(zero);
        in_one_region<T>(p, products, h.data_ptr<T>(), cos.data_ptr<T>(), sin.data_ptr<T>(), +rows_of);
      };
      if (int8) {
        tandem::elementwise::with_dtype(x, "decode_layers", [&](auto zero) {
          run(zero, [](const at::Tensor& c) { return Int8Rows{c.data_ptr<uint8_t>(), c.size(3), c.size(3) - tandem::kScaleBytes}; });
        });
      } else {
        tandem::with_kv_types(x.scalar_type(), cache.scalar_type(), "decode_layers", [&](auto zero, auto element) {
          using C = decltype(element);
          run(zero, [](const at::Tensor& c) { return PlainRows<C>{c.data_ptr<C>(), c.size(3)}; });
        });
      }
      return h;
    }
  }
  at::Tensor h = x;
  first = 0;
  for (int64_t i = 0; i < layers; ++i) {
    const auto own = counts.slice(4 * i, 4);
    size_t size = 2;
    for (const int64_t n : own) size += n;
    h = decode_layer(h, weights.slice(first, size), own, cos, sin, k_caches[i], v_caches[i], slots, block_tables,
                     masks[mask_of[i]], heads, kv_heads, scale, eps);
    first += size;
  }
  return h;
}

}  // namespace

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("decode_layers", &decode_layers); }
