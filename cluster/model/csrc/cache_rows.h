// Rows of a paged KV cache as the CPU attention kernels read them: one (slot, KV head) row of
// head_dim values, in the model's dtype or int8 with the row's float32 scale after its values
// (`cluster/attention.py`), and hints that ask for a position's rows ahead of use.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

namespace tandem {

// Rows of the cache in the model's dtype.
template <typename T>
struct PlainRows {
  const T* base;
  int64_t row_elems;  // elements from one (slot, head) row to the next
  const T* row(int64_t r) const { return base + r * row_elems; }
  float scale(int64_t) const { return 1.f; }
  int64_t stride_bytes() const { return row_elems * sizeof(T); }
};

constexpr int64_t kScaleBytes = 4;  // an int8 row ends with its float32 scale

// Quantised rows: `dim` int8 values, then the row's float32 scale.
struct Int8Rows {
  const uint8_t* base;
  int64_t row_bytes;
  int64_t dim;
  const int8_t* row(int64_t r) const { return reinterpret_cast<const int8_t*>(base + r * row_bytes); }
  int64_t stride_bytes() const { return row_bytes; }
  float scale(int64_t r) const {
    float s;
    std::memcpy(&s, base + r * row_bytes + dim, sizeof(s));
    return s;
  }
};

// Refuses a float cache whose element type does not go with the queries': the same type (float32,
// bfloat16, float16), or a 16-bit cache under float32 queries (`cache.kv_dtype: float16` or `bfloat16`
// under a float32 model).
inline void check_kv_types(at::ScalarType query, at::ScalarType cache) {
  const bool half_under_float = query == at::kFloat && (cache == at::kHalf || cache == at::kBFloat16);
  TORCH_CHECK(query == cache || half_under_float,
              "the KV cache must hold q's dtype (or float16 or bfloat16 under float32 queries), or int8 rows "
              "with their scales");
}

// Calls body(Q{}, C{}) with the queries' and a float cache's element types (`check_kv_types`).
template <typename Body>
void with_kv_types(at::ScalarType query, at::ScalarType cache, const char* name, Body&& body) {
  check_kv_types(query, cache);
  if (query != cache) return cache == at::kHalf ? body(float{}, c10::Half{}) : body(float{}, c10::BFloat16{});
  switch (query) {
    case at::kFloat: return body(float{}, float{});
    case at::kBFloat16: return body(c10::BFloat16{}, c10::BFloat16{});
    case at::kHalf: return body(c10::Half{}, c10::Half{});
    default: TORCH_CHECK(false, name, " takes float32, bfloat16 or float16 queries");
  }
}

constexpr int64_t kPrefetchAhead = 8;  // positions: the block table scatters them, so the hardware cannot guess

// Hints for the `bytes` from row r on (a position's rows for every KV head follow each other).
template <typename Rows>
inline void prefetch_row(const Rows& rows, int64_t r, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(rows.row(r));
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
}

}  // namespace tandem
