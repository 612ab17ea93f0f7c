// The decoder layers' decode step as one call: `tandem_cpu::decode_layers`.
//
// An eager decode step runs each layer as about fifteen torch operations from Python (two norms, four
// products, the split, the rotary embedding, two cache writes, attention, two residual sums,
// silu(gate) * up), and in a small model their dispatch costs more than the weights take to read: an
// int8 SmolLM2-135M step on two cores spent 6 of its 15.6 ms outside every kernel. Here the layer is a
// sequence of the same kernels called from C++ (`skinny_linear*`, `elementwise.h`, `decode_attention`),
// with nothing between them but what they read and write, every layer in turn: where every product
// is one of the kernels' own, all in one parallel region (`in_one_region`, `one_region.h`); else the
// kernels one by one, each keeping its own threads (`decode_layer`).
//
// A product is given as the tensors its kernel reads, which say which kernel it is (`product.h`).
// `cluster/model/causal_lm.py` (`CausalLM.decode_natively`) builds them from the layers' modules
// (`native_parts`), which multiply the same way when called alone.
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

#include "cache_rows.h"
#include "elementwise.h"
#include "one_region.h"
#include "product.h"

namespace {

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

// Whether every layer's pass can run `in_one_region`, checked as the kernels called alone would check
// it (any failure there would be theirs): float, int8 and int4 products of the activations' dtype
// (torch's int4 product keeps its own threads), their norms, and inputs of the shapes and types the
// region reads. Sets `p.first` and builds `products`.
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

// Whether the caches, masks, block tables and rotary tables are laid out as `in_one_region` reads them:
// contiguous, every layer's caches of the first's shape and type, a mask row per row and position.
bool inputs_fit(const Pass& p, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                const at::Tensor& slots, const at::Tensor& block_tables) {
  const at::Tensor& cache = p.k_caches[0];
  bool fits = x.is_contiguous() && slots.scalar_type() == at::kLong && block_tables.scalar_type() == at::kLong &&
              block_tables.is_contiguous() && block_tables.size(0) == x.size(0) && cos.is_contiguous() &&
              sin.is_contiguous() && cos.numel() == x.size(0) * p.dim && sin.numel() == cos.numel() &&
              cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type() &&
              p.heads % p.kv_heads == 0 && cache.size(2) == p.kv_heads;
  for (size_t i = 0; fits && i < p.k_caches.size(); ++i) {
    const at::Tensor &k = p.k_caches[i], &v = p.v_caches[i], &mask = p.masks[p.mask_of[i]];
    fits = k.is_contiguous() && v.is_contiguous() && k.sizes() == cache.sizes() && v.sizes() == cache.sizes() &&
           k.scalar_type() == cache.scalar_type() && v.scalar_type() == cache.scalar_type() &&
           mask.scalar_type() == at::kBool && mask.is_contiguous() &&
           mask.numel() == x.size(0) * block_tables.size(1) * cache.size(1);
  }
  return fits;
}

// Every slot and block table entry within the cache, as the kernels called alone check them.
void check_slots_and_blocks(const int64_t* slot, int64_t rows, const at::Tensor& block_tables, const at::Tensor& cache) {
  const int64_t num_slots = cache.size(0) * cache.size(1), num_blocks = cache.size(0);
  for (int64_t t = 0; t < rows; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot ", slot[t], " outside the cache's ", num_slots);
  const int64_t* table = block_tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < block_tables.numel(); ++i)
    TORCH_CHECK(table[i] >= 0 && table[i] < num_blocks, "block table entry ", table[i], " outside the cache's ",
                num_blocks, " blocks");
}

// `in_one_region` over `x`'s dtype and the cache's kind (int8 rows with their scales, or plain rows).
at::Tensor run_in_one_region(Pass& p, std::vector<Product>& products, const at::Tensor& x, const at::Tensor& cos,
                             const at::Tensor& sin) {
  for (Product& product : products) product.keep_scales();
  at::Tensor h = x.clone();
  const auto run = [&](auto zero, auto rows_of) {
    using T = decltype(zero);
    in_one_region<T>(p, products, h.data_ptr<T>(), cos.data_ptr<T>(), sin.data_ptr<T>(), +rows_of);
  };
  const at::Tensor& cache = p.k_caches[0];
  if (cache.scalar_type() == at::kByte) {
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

at::Tensor decode_layers(const at::Tensor& x, at::TensorList weights, at::IntArrayRef counts, const at::Tensor& cos,
                         const at::Tensor& sin, at::TensorList k_caches, at::TensorList v_caches,
                         const at::Tensor& slots, const at::Tensor& block_tables, at::TensorList masks,
                         at::IntArrayRef mask_of, int64_t heads, int64_t kv_heads, double scale, double eps) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(x.dim() == 2 && slots.numel() == x.size(0), "decode_layers takes x [T, hidden] and a slot per row");
  TORCH_CHECK(v_caches.size() == k_caches.size() && static_cast<int64_t>(mask_of.size()) == layers &&
                  static_cast<int64_t>(counts.size()) == 4 * layers,
              "decode_layers: a cache pair, a mask and four products per layer");
  std::vector<size_t> sizes;  // each layer's tensors in `weights`: two norms and its products'
  size_t first = 0;
  for (int64_t i = 0; i < layers; ++i) {
    sizes.push_back(2);
    for (const int64_t n : counts.slice(4 * i, 4)) sizes.back() += n;
    TORCH_CHECK(first + sizes.back() <= weights.size() && mask_of[i] >= 0 &&
                    mask_of[i] < static_cast<int64_t>(masks.size()),
                "decode_layers: layer ", i, "'s weights or mask are missing");
    first += sizes.back();
  }
  if (layers > 0 && x.size(0) > 0) {
    const at::Tensor& cache = k_caches[0];
    const int64_t dim = cache.size(3) - (cache.scalar_type() == at::kByte ? tandem::kScaleBytes : 0);
    Pass p{x.size(0), x.size(1), heads, kv_heads, dim, at::get_num_threads(), scale, eps, weights, {},
           k_caches, v_caches, masks, mask_of, nullptr, &block_tables};
    std::vector<Product> products;
    if (one_region_fits(p, x, counts, products) && inputs_fit(p, x, cos, sin, slots, block_tables)) {
      const at::Tensor slot_list = slots.contiguous();
      p.slots = slot_list.data_ptr<int64_t>();
      check_slots_and_blocks(p.slots, x.size(0), block_tables, cache);
      return run_in_one_region(p, products, x, cos, sin);
    }
  }
  at::Tensor h = x;  // layer by layer, each kernel with its own threads
  first = 0;
  for (int64_t i = 0; i < layers; ++i) {
    h = decode_layer(h, weights.slice(first, sizes[i]), counts.slice(4 * i, 4), cos, sin, k_caches[i], v_caches[i],
                     slots, block_tables, masks[mask_of[i]], heads, kv_heads, scale, eps);
    first += sizes[i];
  }
  return h;
}

}  // namespace

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("decode_layers", &decode_layers); }
