// How the few-rows kernels of hybridllm::gguf_linear (fp32 and int8 activations) split weight
// rows among the threads and prefetch the weight bytes a thread streams from memory.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#if defined(__SSE__)
#include <immintrin.h>
#endif

namespace hybridllm_gguf {

// How far ahead of its reads a thread prefetches weight bytes: a sixteenth of the bytes it
// reads, from 16 to 128 KB, never past them. At M = 1 from DRAM on a 2-core Zen 5,
// Llama-3-8B-sized Q4_1 linears streamed 14-18 GB/s at 16 KB and 32-38 at 128 KB, while
// SmolLM2's (a few hundred KB a thread) lost up to a third at 128 KB; 16 KB was tuned on a Xeon.
constexpr int64_t kMinPrefetchBytes = 16 * 1024, kMaxPrefetchBytes = 128 * 1024;

// How far ahead a thread prefetches weight bytes it reads only once a call (see
// start_prefetch): they go to L1 alone, which holds tens of KB.
constexpr int64_t kStreamingPrefetchBytes = 8 * 1024;

// Where a thread's kernel calls prefetch: `distance` bytes ahead, up to `stop`; `streaming`:
// non-temporally.
struct PrefetchWindow {
  int64_t distance;
  const char* stop;
  bool streaming;
};

// One cache line of weights, into every cache level or (streaming) into L1 alone.
inline void prefetch_line(const char* p, bool streaming) {
#if defined(__SSE__)
  if (streaming)
    _mm_prefetch(p, _MM_HINT_NTA);
  else
    _mm_prefetch(p, _MM_HINT_T0);
#else
  (void)p, (void)streaming;
#endif
}

// The window of a thread that reads `range_bytes` contiguous weight bytes from `first`, at most
// `max_distance` ahead. A long range also has the bytes before the distance requested now: the
// kernels only ever ask for bytes `distance` ahead of themselves (a short range keeps the 16 KB
// tuned without this).
// `streaming` (each weight byte is read once a call: one row of x, or the int8 row kernels' one
// tile of rows): the bytes bypass L2 and L3, kStreamingPrefetchBytes ahead. A decode step
// streams every weight through the caches once; cached, they evict what the step reuses (the
// KV cache, activations, Python's own working set between steps). On the 1B Q4_K_M-like file
// (2-core Zen 5, one process switching between the two) batch-1 decode ran 75.3 against 68.3
// tok/s (median of 8 rounds, x8 kernels), faster in 7 of 8 rounds; 16 KB ahead: 74.0. SmolLM2
// Q4_1 (row kernels): 367 against 329 tok/s, faster in 8 of 8 rounds; 4 KB: 369, 16 KB: 348.
// The x8 kernels have since stopped prefetching at one row of x (for_x8_row_groups): with the
// hardware prefetchers alone they read faster still; the row kernels showed no difference.
inline PrefetchWindow start_prefetch(const void* first, int64_t range_bytes,
                                     int64_t max_distance = kMaxPrefetchBytes,
                                     bool streaming = false) {
  const char* begin = static_cast<const char*>(first);
  const int64_t distance =
      streaming ? std::min(range_bytes, kStreamingPrefetchBytes)
                : std::clamp(range_bytes / 16, kMinPrefetchBytes, max_distance);
  const PrefetchWindow window{distance, begin + range_bytes, streaming};
  if (streaming || window.distance > kMinPrefetchBytes)
    for (const char* p = begin; p < begin + window.distance; p += 64)
      prefetch_line(p, streaming);
  return window;
}

// The window of a run whose reads the hardware prefetchers alone follow: the kernels ask for
// no byte (each stops at the run's first).
inline PrefetchWindow hardware_prefetch_only(const void* first) {
  return {0, static_cast<const char*>(first), true};
}

// A kernel call over `cols` consecutive weight rows from `w` that has read `done` of each row's
// bytes and reads `step` more: the bytes `distance` past its position in that run.
inline void prefetch_ahead(const PrefetchWindow& window, const uint8_t* w, int64_t cols,
                           int64_t done, int64_t step) {
#if defined(__SSE__)
  const char* ahead = reinterpret_cast<const char*>(w) + window.distance + cols * done;
  if (ahead < window.stop)
    for (int64_t o = 0; o < cols * step; o += 64) prefetch_line(ahead + o, window.streaming);
#endif
}

// Below this many (32-weight block x row of x) products, waking the thread pool costs more than
// it saves.
constexpr int64_t kSerialWork = 2048;

// Splits N weight rows (row_bytes each, from qw) among the threads, one contiguous run each, and
// starts each run's prefetching (`streaming`: see start_prefetch): body(begin, end, window).
// `work`: the call's (32-weight block x row of x) products; below kSerialWork the call stays on
// this thread.
template <class Body>
void for_weight_rows(const uint8_t* qw, int64_t row_bytes, int64_t N, int64_t work,
                     bool streaming, Body body) {
  const int64_t threads = at::get_num_threads();
  const int64_t grain = work < kSerialWork ? N : (N + threads - 1) / threads;
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    body(begin, end,
         start_prefetch(qw + begin * row_bytes, (end - begin) * row_bytes, kMaxPrefetchBytes,
                        streaming));
  });
}

// The same for several weights at once (an MoE layer's experts, an attention layer's heads):
// groups * N weight rows, weight g's N rows (row_bytes each) from weights[g], split among the
// threads in contiguous runs of the groups' rows one after the other, so that one group or a
// batch of 1 still keeps every thread busy: body(g, n0, n1, window) for rows [n0, n1) of group
// g. A run's groups whose weights lie one after the other in memory (a [groups, N, bytes]
// tensor) and that stream alike (`streaming(g)`) share one prefetch window over the run's bytes,
// so the prefetching runs on across group boundaries; any other group gets a window of its own.
// `work`: as for for_weight_rows.
template <class Streaming, class Body>
void for_grouped_weight_rows(const uint8_t* const* weights, int64_t row_bytes, int64_t groups,
                             int64_t N, int64_t work, Streaming streaming, Body body) {
  const int64_t total = groups * N, threads = at::get_num_threads();
  if (total == 0) return;
  const int64_t grain = work < kSerialWork ? total : (total + threads - 1) / threads;
  at::parallel_for(0, total, grain, [&](int64_t begin, int64_t end) {
    const int64_t first = begin / N, last = (end - 1) / N;  // the run's groups
    bool shared = true;
    for (int64_t g = first + 1; g <= last && shared; ++g)
      shared = weights[g] == weights[g - 1] + N * row_bytes && streaming(g) == streaming(first);
    PrefetchWindow window{};
    if (shared)
      window = start_prefetch(weights[first] + (begin - first * N) * row_bytes,
                              (end - begin) * row_bytes, kMaxPrefetchBytes, streaming(first));
    for (int64_t g = first; g <= last; ++g) {
      const int64_t n0 = std::max(begin, g * N) - g * N, n1 = std::min(end, (g + 1) * N) - g * N;
      if (!shared)
        window = start_prefetch(weights[g] + n0 * row_bytes, (n1 - n0) * row_bytes,
                                kMaxPrefetchBytes, streaming(g));
      body(g, n0, n1, window);
    }
  });
}

}  // namespace hybridllm_gguf
