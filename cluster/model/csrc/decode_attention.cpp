// Paged attention for decode rows (one query per sequence) on CPU.
//
// A task is one part of one sequence's context (the whole context when there are enough sequences
// to keep every thread busy). It reads each admitted position's keys, for all KV heads at once, in
// place through the block table, scores every query head against them, then sums the values with
// the softmax weights; rows are converted to float32 in registers and nothing is gathered into a
// copy of the cache (vectors of sixteen lanes on AVX-512, eight on AVX2; `vec.h`). bfloat16 keys are
// scored by AVX512-BF16 pair products on the raw rows where the CPU has them (`decode_bf16.h`). Values of 16-bit and
// int8 caches are summed sixteen positions at a time, one KV head after another, into
// accumulators kept in registers (float32 values, bound by reading them, go in cache order). The
// parts of a sequence are merged afterwards (split-context decoding). An int8 cache row holds
// head_dim int8 values followed by its float32 scale (`cluster/attention.py`).
//
// The CPU implementation of `tandem_cpu::decode_attention`, which `cluster/model/cpu_kernels.py` defines,
// builds and loads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cache_rows.h"
#include "decode_bf16.h"
#include "vec.h"

namespace {

using tandem::exp_nonpositive;
using tandem::Int8Rows;
using tandem::kPrefetchAhead;
using tandem::PlainRows;
using tandem::prefetch_row;
using tandem::widen;
using tandem::with_count;
#if defined(__AVX512BF16__)
using tandem::bf16::score_bf16;
#endif
#if defined(TANDEM_SIMD)
using namespace tandem::simd;
#endif

constexpr int64_t kMaxParts = 64;  // context parts of one sequence

#if defined(TANDEM_SIMD)
constexpr int64_t kMaxVectorDim = 256;  // head_dim of the vector paths
#endif


#if defined(TANDEM_SIMD)
// `score` for head_dim kLanes * Chunks, known when compiled: a position's key row for one KV head
// stays in registers for its query heads, each product summed in two chains of multiply-adds.
template <int Chunks, typename Rows>
void score_chunks(const Rows& keys, const int64_t* rows, int64_t n, const float* qf, int64_t kv_heads,
                  int64_t groups, float scale, float* scores, int64_t stride) {
  constexpr int64_t dim = kLanes * Chunks;
  const int64_t position_bytes = kv_heads * keys.stride_bytes();
  for (int64_t i = 0; i < n; ++i) {
    if (i + kPrefetchAhead < n) prefetch_row(keys, rows[i + kPrefetchAhead], position_bytes);
    for (int64_t h = 0; h < kv_heads; ++h) {
      const auto* r = keys.row(rows[i] + h);
      vfloat k[Chunks];
      for (int c = 0; c < Chunks; ++c) k[c] = vload(r + kLanes * c);
      const float row_scale = keys.scale(rows[i] + h) * scale;
      for (int64_t qh = h * groups; qh < (h + 1) * groups; ++qh) {
        const float* qv = qf + qh * dim;
        vfloat even = vmul(vload(qv), k[0]), odd = vzero();
        for (int c = 1; c < Chunks; ++c) {
          if (c % 2 == 0)
            even = vfmadd(vload(qv + kLanes * c), k[c], even);
          else
            odd = vfmadd(vload(qv + kLanes * c), k[c], odd);
        }
        scores[qh * stride + i] = vsum(vadd(even, odd)) * row_scale;
      }
    }
  }
}
#endif

// scores[qh * stride + i] = scale * <q_qh, key row of position i for qh's KV head>, for every query
// head qh = h * groups + g. rows[i] is position i's row for KV head 0; its heads' rows follow it.
template <typename Rows>
void score(const Rows& keys, const int64_t* rows, int64_t n, const float* qf, int64_t kv_heads, int64_t groups,
           int64_t dim, float scale, float* scores, int64_t stride) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<Rows, PlainRows<c10::BFloat16>>) {
    switch (dim) {
      case 64: return score_bf16<2>(keys, rows, n, qf, kv_heads, groups, scale, scores, stride);
      case 128: return score_bf16<4>(keys, rows, n, qf, kv_heads, groups, scale, scores, stride);
      case 256: return score_bf16<8>(keys, rows, n, qf, kv_heads, groups, scale, scores, stride);
    }
  }
#endif
#if defined(TANDEM_SIMD)
  switch (dim) {
    case 64: return score_chunks<64 / kLanes>(keys, rows, n, qf, kv_heads, groups, scale, scores, stride);
    case 128: return score_chunks<128 / kLanes>(keys, rows, n, qf, kv_heads, groups, scale, scores, stride);
    case 256: return score_chunks<256 / kLanes>(keys, rows, n, qf, kv_heads, groups, scale, scores, stride);
  }
  if (dim % kLanes == 0 && dim <= kMaxVectorDim) {
    const int64_t chunks = dim / kLanes, position_bytes = kv_heads * keys.stride_bytes();
    vfloat k[kMaxVectorDim / kLanes];
    for (int64_t i = 0; i < n; ++i) {
      if (i + kPrefetchAhead < n) prefetch_row(keys, rows[i + kPrefetchAhead], position_bytes);
      for (int64_t h = 0; h < kv_heads; ++h) {
        const auto* r = keys.row(rows[i] + h);
        for (int64_t c = 0; c < chunks; ++c) k[c] = vload(r + kLanes * c);
        const float row_scale = keys.scale(rows[i] + h) * scale;
        for (int64_t qh = h * groups; qh < (h + 1) * groups; ++qh) {
          const float* qv = qf + qh * dim;
          vfloat a = vmul(vload(qv), k[0]);
          for (int64_t c = 1; c < chunks; ++c) a = vfmadd(vload(qv + kLanes * c), k[c], a);
          scores[qh * stride + i] = vsum(a) * row_scale;
        }
      }
    }
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < kv_heads; ++h) {
      const auto* r = keys.row(rows[i] + h);
      const float row_scale = keys.scale(rows[i] + h) * scale;
      for (int64_t qh = h * groups; qh < (h + 1) * groups; ++qh) {
        float s = 0.f;
        for (int64_t d = 0; d < dim; ++d) s += qf[qh * dim + d] * widen(r[d]);
        scores[qh * stride + i] = s * row_scale;
      }
    }
}

#if defined(TANDEM_SIMD)
constexpr int64_t kValueTile = 16;  // positions whose values are summed with the accumulators in registers
constexpr int kAccumulators = kLanes;  // vector registers those accumulators may take (of 32 zmm, or 16 ymm)

// acc[qh] += probs[qh * stride + i] * value row of position i, for the query heads [qh0, qh0 + Heads)
// of KV head h over positions [i0, i1): the accumulators stay in registers across the positions.
// With `ahead`, each position also asks for KV head h's row of position i + ahead.
template <int Heads, int Chunks, typename Rows>
inline void accumulate_heads(const Rows& values, const int64_t* rows, int64_t i0, int64_t i1, const float* probs,
                             int64_t stride, int64_t h, int64_t qh0, float* acc, int64_t ahead, int64_t n) {
  constexpr int64_t dim = kLanes * Chunks;
  vfloat a[Heads][Chunks];
  for (int g = 0; g < Heads; ++g)
    for (int c = 0; c < Chunks; ++c) a[g][c] = vload(acc + (qh0 + g) * dim + kLanes * c);
  for (int64_t i = i0; i < i1; ++i) {
    if (ahead > 0 && i + ahead < n) prefetch_row(values, rows[i + ahead] + h, values.stride_bytes());
    const auto* r = values.row(rows[i] + h);
    const float row_scale = values.scale(rows[i] + h);
    vfloat v[Chunks];
    for (int c = 0; c < Chunks; ++c) v[c] = vload(r + kLanes * c);
    for (int g = 0; g < Heads; ++g) {
      const vfloat w = vset1(probs[(qh0 + g) * stride + i] * row_scale);
      for (int c = 0; c < Chunks; ++c) a[g][c] = vfmadd(w, v[c], a[g][c]);
    }
  }
  for (int g = 0; g < Heads; ++g)
    for (int c = 0; c < Chunks; ++c) vstore(acc + (qh0 + g) * dim + kLanes * c, a[g][c]);
}

// `accumulate` for head_dim kLanes * Chunks. A tile of positions at a time (one stretch of the cache,
// the next tile's rows asked for ahead), each KV head's query heads a few at a time.
template <int Chunks, typename Rows>
void accumulate_tiled(const Rows& values, const int64_t* rows, int64_t n, const float* probs, int64_t stride,
                      int64_t kv_heads, int64_t groups, float* acc) {
  constexpr int kMaxHeads = std::max(1, kAccumulators / Chunks);
  const int64_t position_bytes = kv_heads * values.stride_bytes();
  for (int64_t i = 0; i < std::min(n, kValueTile); ++i) prefetch_row(values, rows[i], position_bytes);
  for (int64_t i0 = 0; i0 < n; i0 += kValueTile) {
    const int64_t i1 = std::min(n, i0 + kValueTile);
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t g = 0; g < groups; g += kMaxHeads) {
        const int64_t qh0 = h * groups + g, ahead = g == 0 ? kValueTile : 0;
        with_count<kMaxHeads>(std::min<int64_t>(kMaxHeads, groups - g), [&](auto heads) {
          accumulate_heads<decltype(heads)::value, Chunks>(values, rows, i0, i1, probs, stride, h, qh0, acc, ahead, n);
        });
      }
  }
}
#endif

// acc[qh] += probs[qh * stride + i] * value row of position i for qh's KV head, for every query head.
template <typename Rows>
void accumulate(const Rows& values, const int64_t* rows, int64_t n, const float* probs, int64_t stride,
                int64_t kv_heads, int64_t groups, int64_t dim, float* acc) {
#if defined(TANDEM_SIMD)
  // Measured per instruction set: with AVX-512 (an AMD Zen 4) float32 values read fastest in cache
  // order, every head at once (the loop below); with AVX2 (an AMD Zen 3) tiled, the accumulators in
  // registers, 1.5x faster.
  if constexpr (!std::is_same_v<Rows, PlainRows<float>> || kLanes == 8) {
    switch (dim) {
      case 64: return accumulate_tiled<64 / kLanes>(values, rows, n, probs, stride, kv_heads, groups, acc);
      case 128: return accumulate_tiled<128 / kLanes>(values, rows, n, probs, stride, kv_heads, groups, acc);
      case 256: return accumulate_tiled<256 / kLanes>(values, rows, n, probs, stride, kv_heads, groups, acc);
    }
  }
  if (dim % kLanes == 0 && dim <= kMaxVectorDim) {
    const int64_t chunks = dim / kLanes, position_bytes = kv_heads * values.stride_bytes();
    vfloat v[kMaxVectorDim / kLanes];
    for (int64_t i = 0; i < n; ++i) {
      if (i + kPrefetchAhead < n) prefetch_row(values, rows[i + kPrefetchAhead], position_bytes);
      for (int64_t h = 0; h < kv_heads; ++h) {
        const auto* r = values.row(rows[i] + h);
        for (int64_t c = 0; c < chunks; ++c) v[c] = vload(r + kLanes * c);
        const float row_scale = values.scale(rows[i] + h);
        for (int64_t qh = h * groups; qh < (h + 1) * groups; ++qh) {
          const vfloat w = vset1(probs[qh * stride + i] * row_scale);
          float* a = acc + qh * dim;
          for (int64_t c = 0; c < chunks; ++c) vstore(a + kLanes * c, vfmadd(w, v[c], vload(a + kLanes * c)));
        }
      }
    }
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < kv_heads; ++h) {
      const auto* r = values.row(rows[i] + h);
      const float row_scale = values.scale(rows[i] + h);
      for (int64_t qh = h * groups; qh < (h + 1) * groups; ++qh) {
        const float w = probs[qh * stride + i] * row_scale;
        for (int64_t d = 0; d < dim; ++d) acc[qh * dim + d] += w * widen(r[d]);
      }
    }
}


// scores[0, n) -> exp(score - max), in place; leaves the max and the sum of the exponentials.
inline void exponentiate(float* scores, int64_t n, float* top, float* sum) {
  float t = -std::numeric_limits<float>::infinity();
  float total = 0.f;
  int64_t i = 0;
#if defined(TANDEM_SIMD)
  vfloat vt = vset1(t);
  for (; i + kLanes <= n; i += kLanes) vt = vmax(vt, vload(scores + i));
  t = vmaxval(vt);
  for (int64_t j = i; j < n; ++j) t = std::max(t, scores[j]);
  const vfloat tops = vset1(t);
  vfloat sums = vzero();
  for (i = 0; i + kLanes <= n; i += kLanes) {
    const vfloat e = vexp_nonpositive(vsub(vload(scores + i), tops));
    vstore(scores + i, e);
    sums = vadd(sums, e);
  }
  total = vsum(sums);
#else
  for (int64_t j = 0; j < n; ++j) t = std::max(t, scores[j]);
#endif
  for (; i < n; ++i) {
    scores[i] = exp_nonpositive(scores[i] - t);
    total += scores[i];
  }
  *top = t;
  *sum = total;
}

// Decode attention over a batch of sequences, as tasks any thread may take: `part(task)` for each of
// `tasks()` (one part of one sequence's context), then `merge(i)` for each of `merges()` (a
// sequence's query head, its parts' outputs rescaled to their common maximum over their sums).
// `attend` runs them on torch's threads; `tandem_cpu::decode_layers` on its own, split the same way.
template <typename Q, typename Rows>
struct Attend {
  static constexpr int64_t kTaskGrain = 1, kMergeGrain = 16;  // at::parallel_for's grains for each

  Attend(const Q* q, Rows keys, Rows values, const int64_t* tables, const bool* masks, int64_t num_seqs, int64_t heads,
         int64_t dim, int64_t max_blocks, int64_t ctx, int64_t block_size, int64_t kv_heads, int64_t threads,
         double scale, Q* out)
      : q(q), keys(keys), values(values), tables(tables), masks(masks), num_seqs(num_seqs), heads(heads), dim(dim),
        max_blocks(max_blocks), ctx(ctx), block_size(block_size), kv_heads(kv_heads),
        parts(std::max<int64_t>(1, std::min<int64_t>({threads / num_seqs, max_blocks / 8, kMaxParts}))),
        blocks_per_part((max_blocks + parts - 1) / parts), part_ctx(blocks_per_part * block_size),
        fscale(static_cast<float>(scale)), out(out), tops(num_seqs * parts * heads), sums(num_seqs * parts * heads),
        partial(num_seqs * parts * heads * dim) {}

  int64_t tasks() const { return num_seqs * parts; }
  int64_t merges() const { return num_seqs * heads; }

  // A part leaves its maximum score, sum of exponentials and unnormalised output per query head.
  void part(int64_t begin, int64_t end) {
    const int64_t groups = heads / kv_heads;
    std::vector<float> qf(heads * dim), scores(heads * part_ctx);
    std::vector<int64_t> rows(part_ctx);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / parts, p = task % parts;
      const int64_t* table = tables + s * max_blocks;
      int64_t n = 0;  // admitted positions of this part, in order
      for (int64_t b = p * blocks_per_part; b < std::min(max_blocks, (p + 1) * blocks_per_part); ++b) {
        const bool* m = masks + s * ctx + b * block_size;
        const int64_t first_row = table[b] * block_size * kv_heads;
        for (int64_t o = 0; o < block_size; ++o)
          if (m[o]) rows[n++] = first_row + o * kv_heads;
      }
      for (int64_t i = 0; i < heads * dim; ++i) qf[i] = widen(q[s * heads * dim + i]);
      score(keys, rows.data(), n, qf.data(), kv_heads, groups, dim, fscale, scores.data(), part_ctx);
      for (int64_t qh = 0; qh < heads; ++qh)
        exponentiate(&scores[qh * part_ctx], n, &tops[task * heads + qh], &sums[task * heads + qh]);
      float* acc = &partial[task * heads * dim];
      std::fill(acc, acc + heads * dim, 0.f);
      accumulate(values, rows.data(), n, scores.data(), part_ctx, kv_heads, groups, dim, acc);
    }
  }

  void merge(int64_t begin, int64_t end) {
    float weight[kMaxParts];
    for (int64_t sq = begin; sq < end; ++sq) {
      const int64_t s = sq / heads, qh = sq % heads;
      const auto slot = [&](int64_t p) { return (s * parts + p) * heads + qh; };
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < parts; ++p) top = std::max(top, tops[slot(p)]);
      float total = 0.f;
      for (int64_t p = 0; p < parts; ++p) {
        const float t = tops[slot(p)];  // -inf: the part admitted no position
        weight[p] = t == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(t - top);
        total += weight[p] * sums[slot(p)];
      }
      for (int64_t d = 0; d < dim; ++d) {
        float x = 0.f;
        for (int64_t p = 0; p < parts; ++p) x += weight[p] * partial[slot(p) * dim + d];
        out[sq * dim + d] = static_cast<Q>(total > 0.f ? x / total : 0.f);  // fully masked: attends to nothing
      }
    }
  }

  const Q* q;
  Rows keys, values;
  const int64_t* tables;
  const bool* masks;
  int64_t num_seqs, heads, dim, max_blocks, ctx, block_size, kv_heads, parts, blocks_per_part, part_ctx;
  float fscale;
  Q* out;
  std::vector<float> tops, sums, partial;
};

template <typename Q, typename Rows>
void attend(const at::Tensor& q, const Rows& keys, const Rows& values, const at::Tensor& block_tables,
            const at::Tensor& mask, int64_t block_size, int64_t kv_heads, double scale, at::Tensor& out) {
  Attend<Q, Rows> a(q.data_ptr<Q>(), keys, values, block_tables.data_ptr<int64_t>(), mask.data_ptr<bool>(), q.size(0),
                    q.size(1), q.size(2), block_tables.size(1), mask.size(-1), block_size, kv_heads,
                    at::get_num_threads(), scale, out.data_ptr<Q>());
  at::parallel_for(0, a.tasks(), a.kTaskGrain, [&](int64_t begin, int64_t end) { a.part(begin, end); });
  at::parallel_for(0, a.merges(), a.kMergeGrain, [&](int64_t begin, int64_t end) { a.merge(begin, end); });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& mask, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad attention shapes");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "decode_attention runs on CPU tensors");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && mask.scalar_type() == at::kBool, "bad index dtypes");
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2), dim = q.size(2);
  TORCH_CHECK(q.size(1) % kv_heads == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(mask.numel() == q.size(0) * block_tables.size(1) * block_size, "mask must be [S, 1, 1, ctx]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  at::Tensor qc = q.contiguous(), tables = block_tables.contiguous(), m = mask.contiguous();
  const int64_t num_blocks = k_cache.size(0);
  const int64_t* t = tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < tables.numel(); ++i)
    TORCH_CHECK(t[i] >= 0 && t[i] < num_blocks, "block table entry ", t[i], " outside the cache's ", num_blocks, " blocks");
  at::Tensor out = at::empty_like(qc);
  const bool int8 = k_cache.scalar_type() == at::kByte;
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "keys and values must share a dtype");
  TORCH_CHECK(k_cache.size(3) == (int8 ? dim + tandem::kScaleBytes : dim), "the cache's rows must hold head_dim values (int8: and their scale)");
  if (int8) {
    const int64_t row = k_cache.size(3);
    const auto run = [&](auto zero) {
      attend<decltype(zero)>(qc, Int8Rows{k_cache.data_ptr<uint8_t>(), row, dim},
                             Int8Rows{v_cache.data_ptr<uint8_t>(), row, dim}, tables, m, block_size, kv_heads, scale,
                             out);
    };
    switch (q.scalar_type()) {
      case at::kFloat: run(float{}); break;
      case at::kBFloat16: run(c10::BFloat16{}); break;
      case at::kHalf: run(c10::Half{}); break;
      default: TORCH_CHECK(false, "decode_attention takes float32, bfloat16 or float16 queries");
    }
  } else {
    tandem::with_kv_types(q.scalar_type(), k_cache.scalar_type(), "decode_attention", [&](auto query, auto element) {
      using C = decltype(element);
      attend<decltype(query)>(qc, PlainRows<C>{k_cache.data_ptr<C>(), dim}, PlainRows<C>{v_cache.data_ptr<C>(), dim},
                              tables, m, block_size, kv_heads, scale, out);
    });
  }
  return out.view({q.size(0), q.size(1) * dim});
}

}  // namespace

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }
