// How the few-rows kernels of hybridllm::gguf_linear (fp32 and int8 activations) prefetch the
// weight bytes a thread streams from memory.
#pragma once

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

// Where a thread's kernel calls prefetch: `distance` bytes ahead, up to `stop`.
struct PrefetchWindow {
  int64_t distance;
  const char* stop;
};

// The window of a thread that reads `range_bytes` contiguous weight bytes from `first`, at most
// `max_distance` ahead. A long range also has the bytes before the distance requested now: the
// kernels only ever ask for bytes `distance` ahead of themselves (a short range keeps the 16 KB
// tuned without this).
inline PrefetchWindow start_prefetch(const void* first, int64_t range_bytes,
                                     int64_t max_distance = kMaxPrefetchBytes) {
  const char* begin = static_cast<const char*>(first);
  const PrefetchWindow window{std::clamp(range_bytes / 16, kMinPrefetchBytes, max_distance),
                              begin + range_bytes};
#if defined(__SSE__)
  if (window.distance > kMinPrefetchBytes)
    for (const char* p = begin; p < begin + window.distance; p += 64) _mm_prefetch(p, _MM_HINT_T0);
#endif
  return window;
}

// A kernel call over `cols` consecutive weight rows from `w` that has read `done` of each row's
// bytes and reads `step` more: the bytes `distance` past its position in that run.
inline void prefetch_ahead(const PrefetchWindow& window, const uint8_t* w, int64_t cols,
                           int64_t done, int64_t step) {
#if defined(__SSE__)
  const char* ahead = reinterpret_cast<const char*>(w) + window.distance + cols * done;
  if (ahead < window.stop)
    for (int64_t o = 0; o < cols * step; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T0);
#endif
}

}  // namespace hybridllm_gguf
