// The decoder layers' decode step as one call: `tandem_cpu::decode_layers`.
//
// An eager decode step runs each layer as about fifteen torch operations from Python (two norms, four
// products, the split, the rotary embedding, two cache writes, attention, two residual sums,
// silu(gate) * up), and in a small model their dispatch costs more than the weights take to read: an
// int8 SmolLM2-135M step on two cores spent 6 of its 15.6 ms outside every kernel. Here the layer is a
// sequence of the same kernels called from C++ (`skinny_linear*`, `elementwise.h`, `decode_attention`),
// with nothing between them but the few tensor views they need, every layer in turn. Each product
// keeps its own threads.
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
#include <vector>

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

// Every layer in turn: layer i takes `counts[4 * i, 4 * i + 4)` of `weights` (after its two norms),
// its caches, and `masks[mask_of[i]]` (its sliding window's).
at::Tensor decode_layers(const at::Tensor& x, at::TensorList weights, at::IntArrayRef counts, const at::Tensor& cos,
                         const at::Tensor& sin, at::TensorList k_caches, at::TensorList v_caches,
                         const at::Tensor& slots, const at::Tensor& block_tables, at::TensorList masks,
                         at::IntArrayRef mask_of, int64_t heads, int64_t kv_heads, double scale, double eps) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(x.dim() == 2 && slots.numel() == x.size(0), "decode_layers takes x [T, hidden] and a slot per row");
  TORCH_CHECK(v_caches.size() == k_caches.size() && static_cast<int64_t>(mask_of.size()) == layers &&
                  static_cast<int64_t>(counts.size()) == 4 * layers,
              "decode_layers: a cache pair, a mask and four products per layer");
  at::Tensor h = x;
  size_t first = 0;
  for (int64_t i = 0; i < layers; ++i) {
    const auto own = counts.slice(4 * i, 4);
    size_t size = 2;
    for (const int64_t n : own) size += n;
    TORCH_CHECK(first + size <= weights.size() && mask_of[i] >= 0 && mask_of[i] < static_cast<int64_t>(masks.size()),
                "decode_layers: layer ", i, "'s weights or mask are missing");
    h = decode_layer(h, weights.slice(first, size), own, cos, sin, k_caches[i], v_caches[i], slots, block_tables,
                     masks[mask_of[i]], heads, kv_heads, scale, eps);
    first += size;
  }
  return h;
}

}  // namespace

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("decode_layers", &decode_layers); }
