// Shared by the few-row products (`skinny_linear.cpp`, `quantized_linear.cpp`): how the weight rows
// are split across threads and tiles, and how far ahead of the product they are asked for.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "vec.h"

namespace tandem::skinny {

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

// Steps over [0, end) a `width` at a time, `step(c, acc)` adding the vector at c into one of two
// accumulator sets, alternately: with one set, each multiply-add would wait for the one before it
// (four cycles), and a row of one input would be bound by that latency, not by reading the weights.
// A vector left over goes to `first`. `ahead(c)` comes once per pair of vectors: prefetch hints.
template <typename Acc, typename Ahead, typename Step>
TANDEM_INLINE inline void alternate(int64_t end, int64_t width, Acc* first, Acc* second, Ahead&& ahead, Step&& step) {
  int64_t c = 0;
  for (; c + 2 * width <= end; c += 2 * width) {
    ahead(c);
    step(c, first);
    step(c + width, second);
  }
  if (c < end) step(c, first);
}

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

// How a product's weight rows are split: at least `grain` rows to a thread, `tile` rows a group pass.
inline int64_t grain_of(int64_t row_bytes) { return std::max<int64_t>(8, kMinTaskBytes / row_bytes); }
inline int64_t tile_of(int64_t row_bytes) { return std::max<int64_t>(1, kTileBytes / row_bytes); }

// Thread `tid`'s share of [0, n) among `threads`, as `at::parallel_for(0, n, grain, ...)` splits it on
// OpenMP (one range where it would not fork): a pass that keeps its own threads
// (`tandem_cpu::decode_layers`) computes exactly what the kernels called alone compute. Each thread
// streams one contiguous range: handing out tiles to whichever thread is free, to even out the
// threads' ends, made an int8 SmolLM2-135M decode pass 1.16x slower on two cores (AMD Zen 3): every
// tile then starts a stream of its own that the prefetchers must find again.
inline std::pair<int64_t, int64_t> share_of(int64_t n, int64_t grain, int64_t tid, int64_t threads) {
  if (n <= grain || n <= 1 || threads <= 1) return tid == 0 ? std::pair<int64_t, int64_t>{0, n} : std::pair<int64_t, int64_t>{n, n};
  const int64_t used = std::min(threads, (n + grain - 1) / grain), chunk = (n + used - 1) / used;
  const int64_t begin = std::min(n, tid * chunk);
  return {begin, std::min(n, begin + chunk)};
}

// One thread's share [n0, n1) of the weight rows (each `row_bytes` from `weights`): its first lines
// asked for, and `group(rows, first_row, t0, t1)` called for every tile and group of input rows.
template <typename Group>
void weight_rows(int64_t rows, int64_t n0, int64_t n1, const void* weights, int64_t row_bytes, Group&& group) {
  prefetch_first(static_cast<const char*>(weights) + n0 * row_bytes, (n1 - n0) * row_bytes);
  tiled(rows, n0, n1, tile_of(row_bytes), group);
}

// `share(n0, n1)` over the n weight rows split across torch's threads.
template <typename Share>
void over_weight_rows(int64_t n, int64_t row_bytes, Share&& share) {
  at::parallel_for(0, n, grain_of(row_bytes), share);
}

// Calls body(zero) with a value of y's dtype: float32, bfloat16 or float16.
template <typename Body>
void with_output(const at::Tensor& y, const char* name, Body&& body) {
  switch (y.scalar_type()) {
    case at::kFloat: return body(float{});
    case at::kBFloat16: return body(c10::BFloat16{});
    case at::kHalf: return body(c10::Half{});
    default: TORCH_CHECK(false, name, " takes float32, bfloat16 or float16 activations");
  }
}

}  // namespace tandem::skinny
