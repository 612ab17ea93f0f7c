// Paged attention for prompt chunks (several new tokens per sequence) on CPU.
//
// Each sequence attends on its own, at its own length: its blocks are gathered from the cache (and
// dequantised, for an int8 cache), then torch's flash attention kernel runs over exactly its queries
// and keys. Padding every sequence of a pass to the longest one, as one batched call would, costs
// up to (longest / mean)^2 times the arithmetic for prompts of mixed lengths. A chunk that starts at
// position 0 uses the kernel's causal rule; a later chunk of a prompt, or a sliding window, gets an
// explicit mask (query i, at position num_cached + i, sees the keys at or before it).
//
// The CPU implementation of `tandem_cpu::prefill_attention`, which `cluster/cpu_kernels.py` defines,
// builds and loads.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

namespace {

constexpr int64_t kScaleBytes = 4;  // an int8 row ends with its float32 scale

// One sequence's first `ctx` positions of a cache, [kv_heads, ctx, head_dim] in `dtype`.
at::Tensor gather(const at::Tensor& cache, const at::Tensor& blocks, int64_t ctx, int64_t dim, at::ScalarType dtype) {
  at::Tensor rows = cache.index_select(0, blocks);  // [blocks, block_size, kv_heads, row]
  rows = rows.view({-1, cache.size(2), cache.size(3)}).narrow(0, 0, ctx);
  if (cache.scalar_type() == at::kByte) {
    at::Tensor values = rows.narrow(2, 0, dim).view(at::kChar).to(at::kFloat);
    at::Tensor scales = rows.narrow(2, dim, kScaleBytes).contiguous().view(at::kFloat);
    rows = (values * scales).to(dtype);
  }
  return rows.transpose(0, 1);
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& block_tables, at::IntArrayRef num_new, at::IntArrayRef num_cached,
                             double scale, std::optional<int64_t> window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad attention shapes");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "prefill_attention runs on CPU tensors");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2, "block tables must be [S, blocks]");
  const int64_t num_seqs = block_tables.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(static_cast<int64_t>(num_new.size()) == num_seqs && static_cast<int64_t>(num_cached.size()) == num_seqs,
              "num_new and num_cached need one entry per sequence");
  TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  const bool int8 = k_cache.scalar_type() == at::kByte;
  TORCH_CHECK(int8 ? k_cache.size(3) == dim + kScaleBytes
                   : k_cache.scalar_type() == q.scalar_type() && k_cache.size(3) == dim,
              "the KV cache must hold q's dtype, or int8 rows with their scales");
  TORCH_CHECK(!window || *window > 0, "a sliding window must be positive");
  int64_t total = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(num_new[s] > 0 && num_cached[s] >= 0, "sequence ", s, " has no new tokens");
    TORCH_CHECK((num_cached[s] + num_new[s] + block_size - 1) / block_size <= block_tables.size(1),
                "sequence ", s, "'s block table is too short for its positions");
    total += num_new[s];
  }
  TORCH_CHECK(total == q.size(0), "num_new adds up to ", total, " tokens, q has ", q.size(0));
  const at::Tensor tables = block_tables.to(at::kCPU);
  const int64_t cache_blocks = k_cache.size(0);
  TORCH_CHECK(tables.numel() == 0 || (tables.min().item<int64_t>() >= 0 && tables.max().item<int64_t>() < cache_blocks),
              "a block table entry lies outside the cache's ", cache_blocks, " blocks");

  at::Tensor out = at::empty({q.size(0), heads * dim}, q.options());
  int64_t start = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t n = num_new[s], cached = num_cached[s], ctx = cached + n;
    const at::Tensor blocks = tables[s].narrow(0, 0, (ctx + block_size - 1) / block_size);
    const at::Tensor keys = gather(k_cache, blocks, ctx, dim, q.scalar_type()).unsqueeze(0);
    const at::Tensor values = gather(v_cache, blocks, ctx, dim, q.scalar_type()).unsqueeze(0);
    const at::Tensor queries = q.narrow(0, start, n).transpose(0, 1).unsqueeze(0);  // [1, heads, n, dim]
    const bool causal = cached == 0 && !window;
    std::optional<at::Tensor> mask;
    if (!causal) {
      const at::Tensor q_pos = at::arange(cached, ctx, tables.options()).unsqueeze(1);
      const at::Tensor k_pos = at::arange(ctx, tables.options()).unsqueeze(0);
      at::Tensor m = k_pos <= q_pos;
      if (window) m = m & (q_pos - k_pos < *window);
      mask = m;
    }
    const at::Tensor o = at::scaled_dot_product_attention(queries, keys, values, mask, 0.0, causal, scale,
                                                          /*enable_gqa=*/true);  // [1, heads, n, dim]
    out.narrow(0, start, n).view({n, heads, dim}).copy_(o[0].transpose(0, 1));
    start += n;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
