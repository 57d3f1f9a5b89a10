// Paged decode attention for CPU: each single-token query attends over its context read in
// place from the block-paged KV cache (no gather into a padded copy). The cache has the query's
// dtype, or is 16-bit (float16/bfloat16) under an fp32 query: keys and values widen to fp32 as
// they are loaded and the arithmetic stays fp32. Optional logit soft-capping (Gemma 2) and
// attention sinks (gpt-oss) act on a row's scores between the two passes, outside the loops
// over keys and values. Registered as the torch op hybridllm::paged_decode_attention; built
// on first use by hybridllm/layers/cpu_kernels.py.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "vec_avx512.h"
#include "vec_math.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using hybridllm_math::exp_minus_max;
using hybridllm_math::softcap_inplace;

// How many tokens ahead the first pass over an item's keys asks for the key and value rows it
// will need. Blocks are scattered, so the hardware prefetcher stops at every block's end; with
// the context coming from DRAM (batch 64, 190 tokens, 24 rotating caches) prefetching a block
// ahead read 14-17 GB/s against 10-11 without. The AVX-512 pass asks for one token a key it
// computes, 32 ahead: a tile's 16 tokens asked for at once (192 lines) measured 790-810 us a
// call against 705-715 (SmolLM2's shape, batch 64, 192 tokens, float16); 16, 48, 64 between.
// It serves an item's tokens that the item before did not ask for (SpreadPrefetch).
constexpr int64_t kPrefetchTokens = 16;
constexpr int64_t kPrefetchTokensAvx512 = 32;

// Both rows (key and value) of one token's heads of this item into L1: pass 2 finds the values
// in L2 (an item's context is a few hundred KB at most, the L2 holds MBs).
template <int kLocality = 3>
inline void prefetch_kv_row(const void* key_row, int64_t value_offset_bytes, int64_t bytes) {
  const char* k = static_cast<const char*>(key_row);
  for (int64_t o = 0; o < bytes; o += 64) {
    __builtin_prefetch(k + o, 0, kLocality);
    __builtin_prefetch(k + value_offset_bytes + o, 0, kLocality);
  }
}

// The next work item's key and value rows (all its heads), asked for one token at a time
// over the current item's work: step() once per key row of pass 1 and per value row of pass 2,
// so that the next item's DRAM reads overlap this item's arithmetic. From DRAM (SmolLM2's
// shape, batch 64, 192 tokens, float16, 24 rotating caches): 304-335 us a call against 437-464
// with all of the next item's rows asked for during one head's pass 2; asked for over the
// first half of the item, 372. Into L2 (the item in between streams through L1).
template <typename kv_t>
struct SpreadPrefetch {
  const kv_t* const* rows = nullptr;  // the next item's token rows (+ offset: its first head)
  int64_t offset = 0;
  int64_t n = 0;                 // its tokens
  int64_t value_bytes = 0;       // from a key row to its value row
  int64_t row_bytes = 0;         // one row of all its heads
  int64_t steps_per_token = 1;   // this item's steps per token asked for
  int64_t countdown = 1, token = 0;  // token: the next one to ask for

  void step() {
    if (--countdown > 0) return;
    countdown = steps_per_token;
    if (token < n) prefetch_kv_row<2>(rows[token++] + offset, value_bytes, row_bytes);
  }
};

// Softmax numerators in place for `rows` rows of n scores (scores[r * n + t]), and each row's
// 1 / sum in inv_sum[r]: the division waits until the weighted sum of values is done.
// softcap > 0 first caps each row's scores at +-softcap (tanh); sinks (or nullptr): row r's
// sink logit sinks[r], in the softmax's denominator only.
inline void softmax_numerators(float* scores, int64_t rows, int64_t n, float* inv_sum,
                               float softcap, const float* sinks) {
  constexpr float kNoSink = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    if (softcap > 0.f) softcap_inplace(scores + r * n, n, softcap);
    inv_sum[r] = 1.f / exp_minus_max(scores + r * n, n, sinks == nullptr ? kNoSink : sinks[r]);
  }
}

// A verify step's queries of one sequence in one item (speculative decoding): the item's `rows`
// query rows come `group` a KV head, each KV head's in `causal` runs of group / causal rows, run
// j at position n - causal + j. Run j sees the first n - causal + j + 1 of the n tokens: the
// later ones (the drafts after it) get a -inf score. causal 1: nothing to mask.
inline void mask_later_tokens(float* scores, int64_t rows, int64_t n, int64_t group,
                              int64_t causal) {
  if (causal <= 1) return;
  const int64_t per_run = group / causal;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t visible = n - (causal - 1 - (r % group) / per_run);
    std::fill(scores + r * n + visible, scores + (r + 1) * n,
              -std::numeric_limits<float>::infinity());
  }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// 8 cache values from p as fp32
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 widen8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 widen8(const c10::BFloat16* p) {
  const __m256i words =
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
}
#endif

// The portable passes' inner products: q . k and acc += p v over one head's d values of a
// key or value row. With AVX2 (and F16C) 8 at a time, the cache's halves widened in registers:
// GCC's loops converted each c10::Half on its own, and a SmolLM2 decode step's attention took
// 77 us a layer (a fifth of the step) on a 2-core Zen 3.
template <typename kv_t>
inline float dot_row(const float* q, const kv_t* k, int64_t d_count) {
  int64_t d = 0;
  float s = 0.f;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  if constexpr (std::is_same_v<kv_t, float> || std::is_same_v<kv_t, c10::Half> ||
                std::is_same_v<kv_t, c10::BFloat16>) {
    __m256 acc = _mm256_setzero_ps();
    for (; d + 8 <= d_count; d += 8)
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), widen8(k + d), acc);
    __m128 four = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    four = _mm_add_ps(four, _mm_movehl_ps(four, four));
    s = _mm_cvtss_f32(_mm_add_ss(four, _mm_movehdup_ps(four)));
  }
#endif
  for (; d < d_count; ++d) s += q[d] * static_cast<float>(k[d]);
  return s;
}

template <typename kv_t>
inline void add_scaled_row(float p, const kv_t* v, float* acc, int64_t d_count) {
  int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  if constexpr (std::is_same_v<kv_t, float> || std::is_same_v<kv_t, c10::Half> ||
                std::is_same_v<kv_t, c10::BFloat16>) {
    const __m256 pv = _mm256_set1_ps(p);
    for (; d + 8 <= d_count; d += 8)
      _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(pv, widen8(v + d), _mm256_loadu_ps(acc + d)));
  }
#endif
  for (; d < d_count; ++d) acc[d] += p * static_cast<float>(v[d]);
}

#if defined(__AVX512F__)
using hybridllm_avx512::load16;

// One vector whose lane j is the sum of v[j]'s 16 lanes: a transpose-and-add tree (45 shuffles
// and adds for 16 sums, where 16 separate horizontal sums take about three times as many).
inline __m512 sum_lanes16(const __m512 v[16]) {
  __m512 a[8], c[4];
  for (int i = 0; i < 8; ++i)  // a[i]'s 128-bit lanes: partials of rows 2i, 2i + 1, interleaved
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // c[i]: each 128-bit lane holds rows 4i..4i+3's partials
    const __m512d lo = _mm512_castps_pd(a[2 * i]), hi = _mm512_castps_pd(a[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
  }
  // add 128-bit lanes pairwise, twice: lane L of the result holds rows 4L..4L+3
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                                  _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88),
                                  _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

// Pass 2 for kR query rows of one KV head, over the kCols value columns from `head_off` (a
// head's first kCols, or a slice of a wider head): out[r] = sum_t p[r, t] v_t / sum_r
// (p: [kR][n]; out rows kStride floats apart). kR is a compile-time count: with a run-time row
// count the compiler kept the kR x kCols / 16 sums on the stack, a load and a store around
// every FMA.
template <typename kv_t, int kCols, int kR, int kStride = kCols>
inline void weighted_values(const kv_t* const* token_rows, int64_t head_off, const float* p,
                            int64_t n, const float* inv_sum, float* ob,
                            SpreadPrefetch<kv_t>& next) {
  constexpr int kVec = kCols / 16;
  __m512 acc[kR][kVec];
  for (int r = 0; r < kR; ++r)
    for (int i = 0; i < kVec; ++i) acc[r][i] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    next.step();
    const kv_t* v = token_rows[t] + head_off;
    __m512 vr[kVec];
    for (int i = 0; i < kVec; ++i) vr[i] = load16(v + 16 * i);
    for (int r = 0; r < kR; ++r) {
      const __m512 w = _mm512_set1_ps(p[r * n + t]);
      for (int i = 0; i < kVec; ++i) acc[r][i] = _mm512_fmadd_ps(w, vr[i], acc[r][i]);
    }
  }
  for (int r = 0; r < kR; ++r) {
    const __m512 inv = _mm512_set1_ps(inv_sum[r]);
    for (int i = 0; i < kVec; ++i)
      _mm512_storeu_ps(ob + r * kStride + 16 * i, _mm512_mul_ps(acc[r][i], inv));
  }
}

// fp32 fast path for one work item, head_dim kDim (a multiple of 16): the G query rows of a KV
// head meet each tile of 16 keys while it is in L1, widened to fp32 once for all G (pass 1),
// and keep their output accumulators in registers, kRows rows at a time (pass 2), so each
// value row is loaded once per row group and never written back. Same arithmetic as the
// generic loop below up to summation order. Against widening each key for every query row and
// a run-time row count in pass 2, with the context in L3 (batch 64, 192 keys): SmolLM2's shape
// 226-233 -> 177-181 us a call, Qwen3-30B-A3B's (batch 8) 159 -> 100. Against one horizontal
// sum a score: 1.2-1.4x at batch 8-64 (Qwen3-30B-A3B's
// 32 / 4 heads of 128, 192 keys), 1.0-1.4x at SmolLM2's 9 / 3 heads of 64.
template <typename kv_t, int kDim>
int64_t decode_item_avx512(const float* qb, const kv_t* const* token_rows, int64_t value_offset,
                           int64_t head_stride, int64_t h0, int64_t heads, int64_t group,
                           int64_t n, float scale, float softcap, const float* sinks,
                           float* scores, float* inv_sum, float* ob,
                           const kv_t* const* next_rows, int64_t next_n, int64_t streamed,
                           int64_t causal) {
  constexpr int kVec = kDim / 16;                      // zmm per head row
  constexpr int kRows = kVec <= 4 ? 4 : 2;  // pass 2: <= 16 zmm of sums
  // pass 2 over kCols value columns at a time: a head wider than 128 (Qwen3-Next's and
  // Gemma's 256) goes in slices of 64 columns, 4 rows each, so the sums stay in registers and
  // each value row is read ceil(G / 4) times instead of G
  constexpr int kCols = kDim > 128 ? 64 : kDim;
  constexpr int kSliceRows = kDim > 128 ? 4 : kRows;
  auto row_ptr = [&](int64_t t) { return token_rows[t]; };  // K row (all heads); + value_offset: V
  // the next item's rows over this item's steps: heads * n key rows, heads * ceil(G / kRows) * n
  // value rows. Returns how many of its tokens were asked for.
  SpreadPrefetch<kv_t> next;
  if (next_n > 0) {
    next.rows = next_rows;
    next.n = next_n;
    next.offset = h0 * head_stride;
    next.value_bytes = value_offset * sizeof(kv_t);
    next.row_bytes = heads * kDim * sizeof(kv_t);
    const int64_t steps =
        heads * n * (1 + (kDim / kCols) * ((group + kSliceRows - 1) / kSliceRows));
    next.steps_per_token = next.countdown = std::max<int64_t>(1, steps / next_n);
  }
  // pass 1: scores[r, t] = q_r . k_t, a tile of 16 keys at a time: every query row of the
  // KV head meets the tile while it is in L1, in 16 independent sums reduced together. The
  // first head's pass prefetches the key and value rows (all heads) of later tokens that the
  // item before did not ask for (`streamed`: its first tokens).
  for (int64_t hh = 0; hh < heads; ++hh) {
    const int64_t head_off = (h0 + hh) * head_stride;
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
      const int count = static_cast<int>(std::min<int64_t>(16, n - t0));
      // the tile's keys widened to fp32 once, for all G query rows: [16][kDim]
      alignas(64) float k[16][kDim];
      for (int j = 0; j < 16; ++j) {  // keys past n repeat the last one; their lanes are dropped
        const int64_t ahead = t0 + j + kPrefetchTokensAvx512;
        if (hh == 0 && ahead >= streamed && ahead < n)  // every head's rows not yet asked for
          prefetch_kv_row(row_ptr(ahead) + h0 * head_stride, value_offset * sizeof(kv_t),
                          heads * kDim * sizeof(kv_t));
        next.step();
        const kv_t* key = row_ptr(t0 + std::min(j, count - 1)) + head_off;
        for (int i = 0; i < kVec; ++i) _mm512_store_ps(k[j] + 16 * i, load16(key + 16 * i));
      }
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = hh * group + g;
        __m512 q[kVec], s[16];
        for (int i = 0; i < kVec; ++i)
          q[i] = _mm512_mul_ps(_mm512_loadu_ps(qb + r * kDim + 16 * i), _mm512_set1_ps(scale));
        for (int j = 0; j < 16; ++j) {
          s[j] = _mm512_mul_ps(q[0], _mm512_load_ps(k[j]));
          for (int i = 1; i < kVec; ++i)
            s[j] = _mm512_fmadd_ps(q[i], _mm512_load_ps(k[j] + 16 * i), s[j]);
        }
        _mm512_mask_storeu_ps(scores + r * n + t0, static_cast<__mmask16>((1u << count) - 1),
                              sum_lanes16(s));
      }
    }
  }
  mask_later_tokens(scores, heads * group, n, group, causal);
  softmax_numerators(scores, heads * group, n, inv_sum, softcap, sinks);
  // pass 2: out[r] = sum_t p[r, t] v_t / sum_r, kSliceRows query rows over kCols columns at
  // a time
  for (int64_t hh = 0; hh < heads; ++hh) {
    for (int64_t c0 = 0; c0 < kDim; c0 += kCols) {
      const int64_t head_off = value_offset + (h0 + hh) * head_stride + c0;
      for (int64_t g0 = 0; g0 < group; g0 += kSliceRows) {
        const int64_t r0 = hh * group + g0;
        const auto run = [&](auto rows_tag) {
          weighted_values<kv_t, kCols, decltype(rows_tag)::value, kDim>(
              token_rows, head_off, scores + r0 * n, n, inv_sum + r0, ob + r0 * kDim + c0, next);
        };
        switch (std::min<int64_t>(kSliceRows, group - g0)) {
          case 1: run(std::integral_constant<int, 1>{}); break;
          case 2: run(std::integral_constant<int, 2>{}); break;
          case 3: run(std::integral_constant<int, 3>{}); break;
          default: run(std::integral_constant<int, kSliceRows>{});
        }
      }
    }
  }
  return next.token;
}
#endif

// The K row address (all heads side by side) of each of a sequence's n context tokens from
// position `start`, walking its block table once. Computed per token and pass instead, the
// position's block (a 64-bit division) cost more than the dot products beside it.
template <typename scalar_t>
void fill_token_rows(const scalar_t** rows, const scalar_t* kv, const int32_t* table,
                     int64_t block_size, int64_t block_stride, int64_t token_stride, int64_t start,
                     int64_t n) {
  int64_t block = start / block_size, offset = start % block_size;
  const scalar_t* base = kv + table[block] * block_stride;
  for (int64_t t = 0; t < n; ++t) {
    rows[t] = base + offset * token_stride;
    if (++offset == block_size && t + 1 < n) {
      offset = 0;
      base = kv + table[++block] * block_stride;
    }
  }
}

// Whether query row b continues the run of rows before it: the next query of the same sequence
// (a verify step's, speculative decoding), with the same block table and one more token. Two
// live sequences never share a whole table (each writes its own last block), so equal tables
// and lengths one apart are one sequence. A sliding window would give each row its own first
// token: such rows stay separate.
inline bool continues_run(const int32_t* tables, int64_t table_stride, const int32_t* lens,
                          int64_t b, int64_t block_size, int64_t window) {
  if (lens[b] != lens[b - 1] + 1 || (window > 0 && lens[b] > window)) return false;
  const int64_t blocks = (lens[b] + block_size - 1) / block_size;
  return std::memcmp(tables + b * table_stride, tables + (b - 1) * table_stride,
                     blocks * sizeof(int32_t)) == 0;
}

// One work item is one run of query rows (one sequence's, or a verify step's queries of one
// sequence: see continues_run) and a run of its KV heads: all of them when there are enough
// runs to keep every thread busy, so each token's K and V rows (all heads side by side) are
// read as one contiguous stream; one head per item for few runs. The G query heads of a KV
// head share every key and value read, and so do the R rows of a verify step (R G query rows a
// KV head, each row's later tokens masked): a 5-row verify step over 900 tokens read its
// context 5 times as 5 items.
// kHeadDim > 0 fixes head_dim at compile time (fully unrolled dot products); 0 reads it.
// scalar_t: the query's and output's dtype; kv_t: the cache's (scalar_t, or 16-bit under fp32).
// softcap: 0 for none; sinks: [num_heads] fp32 logits, or nullptr.
template <typename scalar_t, typename kv_t, int kHeadDim>
void decode_kernel(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens, float scale,
                   int64_t window, float softcap, const float* sinks) {
  const int64_t batch = query.size(0), num_heads = query.size(1);
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : query.size(2);
  const int64_t block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t value_offset = kv_cache.stride(0), block_stride = kv_cache.stride(1);
  const int64_t token_stride = kv_cache.stride(2), head_stride = kv_cache.stride(3);
  const int64_t table_stride = block_tables.stride(0);
  const kv_t* kv = kv_cache.data_ptr<kv_t>();
  const scalar_t* q = query.data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();

  // runs of rows, [run_start[i], run_start[i + 1]); a run is one sequence (rows with sinks,
  // gpt-oss's, stay one a run: a sink belongs to a query head, not to a row of the item)
  std::vector<int64_t> run_start{0};
  for (int64_t b = 1; b < batch; ++b)
    if (sinks != nullptr || !continues_run(tables, table_stride, lens, b, block_size, window))
      run_start.push_back(b);
  run_start.push_back(batch);
  // Too few runs for the threads (one sequence's verify step: 3 KV heads, 2 threads): halve the
  // longest run until there are enough; each half reads the context once. One 5-row verify
  // step over 900 tokens, SmolLM2's heads: 107 us a call as one run, 82 as runs of 3 and 2.
  const int64_t threads = at::get_num_threads();
  while (static_cast<int64_t>(run_start.size() - 1) * num_kv_heads < 2 * threads) {
    int64_t longest = 0;
    for (size_t i = 1; i + 1 < run_start.size(); ++i)
      if (run_start[i + 1] - run_start[i] > run_start[longest + 1] - run_start[longest])
        longest = static_cast<int64_t>(i);
    const int64_t length = run_start[longest + 1] - run_start[longest];
    if (length < 2) break;
    run_start.insert(run_start.begin() + longest + 1, run_start[longest] + (length + 1) / 2);
  }
  const int64_t runs = static_cast<int64_t>(run_start.size()) - 1;

  // Waking the thread pool costs microseconds: small steps run on the calling thread. Measured
  // at one sequence (3 KV heads): 64 keys alike either way, 200 keys 53 -> 43 us on 2 threads.
  int64_t total_keys = 0;
  for (int64_t b = 0; b < batch; ++b) total_keys += lens[b];
  // Whole-sequence items ran 1.3x faster than per-head items at batch 64 (SmolLM2's 3 KV
  // heads, 190 tokens, interleaved in one process): per-head rows are strided 256-byte pieces.
  const int64_t heads_per_item = runs >= 2 * threads ? num_kv_heads : 1;
  const int64_t chunks = num_kv_heads / heads_per_item;
  const int64_t items = runs * chunks;
  const int64_t grain = total_keys * num_kv_heads < 512 ? items : 1;
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf, acc, inv_sum;
    // a run's query rows reordered as one item reads them (KV head, row of the run, query head
    // of the group), and its output before it is put back; for runs of more than one row
    std::vector<scalar_t> run_q, run_o;
    // this item's token rows, and the next one's: whole-sequence items prefetch the next
    // item's rows over their own work (SpreadPrefetch)
    std::vector<const kv_t*> token_rows, next_rows;
    const auto fill = [&](int64_t item, std::vector<const kv_t*>& rows_out) {
      const int64_t last = run_start[item / chunks + 1] - 1, len = lens[last];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      rows_out.resize(len - start);
      fill_token_rows(rows_out.data(), kv, tables + last * table_stride, block_size,
                      block_stride, token_stride, start, len - start);
    };
    if (begin < end) fill(begin, next_rows);
    int64_t streamed = 0;  // the item's leading tokens whose rows the one before asked for
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b0 = run_start[item / chunks], causal = run_start[item / chunks + 1] - b0;
      const int64_t h0 = (item % chunks) * heads_per_item;
      const int64_t len = lens[b0 + causal - 1];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - start;
      const int64_t item_group = group * causal;  // query rows a KV head
      const int64_t rows = heads_per_item * item_group;
      // query is contiguous [B, H, D]: one row's query heads of this item are consecutive
      const scalar_t* qb = q + (b0 * num_heads + h0 * group) * head_dim;
      scalar_t* ob = o + (b0 * num_heads + h0 * group) * head_dim;
      if (causal > 1) {
        // [heads_per_item][causal][group][D] from the rows' [causal][H][D]
        run_q.resize(rows * head_dim);
        run_o.resize(rows * head_dim);
        for (int64_t hh = 0; hh < heads_per_item; ++hh)
          for (int64_t j = 0; j < causal; ++j)
            std::memcpy(run_q.data() + (hh * item_group + j * group) * head_dim,
                        q + ((b0 + j) * num_heads + (h0 + hh) * group) * head_dim,
                        group * head_dim * sizeof(scalar_t));
        qb = run_q.data();
        ob = run_o.data();
      }
      const float* item_sinks = sinks == nullptr ? nullptr : sinks + h0 * group;
      scores.resize(rows * n);
      inv_sum.resize(rows);
      std::swap(token_rows, next_rows);
      if (item + 1 < end)
        fill(item + 1, next_rows);
      else
        next_rows.clear();
      bool done = false;
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<scalar_t, float> && kHeadDim > 0 && kHeadDim % 16 == 0) {
        streamed = decode_item_avx512<kv_t, kHeadDim>(
            qb, token_rows.data(), value_offset, head_stride, h0, heads_per_item, item_group, n,
            scale, softcap, item_sinks, scores.data(), inv_sum.data(), ob, next_rows.data(),
            heads_per_item == num_kv_heads ? static_cast<int64_t>(next_rows.size()) : 0,
            streamed, causal);
        done = true;
      }
#endif
      if (!done) {
        qf.resize(rows * head_dim);
        acc.assign(rows * head_dim, 0.f);
        for (int64_t i = 0; i < rows * head_dim; ++i) qf[i] = static_cast<float>(qb[i]) * scale;

        // scores[r, t] = q_r . k_t  (already scaled); query row r = hh * item_group + g reads
        // KV head h0 + hh
        // the key row (this item's heads side by side) of token t; + value_offset: V
        auto key_row = [&](int64_t t) { return token_rows[t] + h0 * head_stride; };
        for (int64_t t = 0; t < n; ++t) {
          const kv_t* k_row = key_row(t);
          if (t + kPrefetchTokens < n)
            prefetch_kv_row(key_row(t + kPrefetchTokens), value_offset * sizeof(kv_t),
                            heads_per_item * head_dim * sizeof(kv_t));
          for (int64_t hh = 0; hh < heads_per_item; ++hh) {
            const kv_t* k = k_row + hh * head_stride;
            for (int64_t g = 0; g < item_group; ++g) {
              const int64_t r = hh * item_group + g;
              const float* qr = qf.data() + r * head_dim;
              scores[r * n + t] = dot_row(qr, k, head_dim);
            }
          }
        }
        mask_later_tokens(scores.data(), rows, n, item_group, causal);
        softmax_numerators(scores.data(), rows, n, inv_sum.data(), softcap, item_sinks);
        // acc[r] = sum_t p[r, t] * v_t
        for (int64_t t = 0; t < n; ++t) {
          const kv_t* v_row = key_row(t) + value_offset;
          for (int64_t hh = 0; hh < heads_per_item; ++hh) {
            const kv_t* v = v_row + hh * head_stride;
            for (int64_t g = 0; g < item_group; ++g) {
              const int64_t r = hh * item_group + g;
              add_scaled_row(scores[r * n + t], v, acc.data() + r * head_dim, head_dim);
            }
          }
        }
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t d = 0; d < head_dim; ++d)
            ob[r * head_dim + d] = static_cast<scalar_t>(acc[r * head_dim + d] * inv_sum[r]);
      }
      if (causal > 1) {
        for (int64_t hh = 0; hh < heads_per_item; ++hh)
          for (int64_t j = 0; j < causal; ++j)
            std::memcpy(o + ((b0 + j) * num_heads + (h0 + hh) * group) * head_dim,
                        run_o.data() + (hh * item_group + j * group) * head_dim,
                        group * head_dim * sizeof(scalar_t));
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                  double scale, int64_t window, double softcap,
                                  const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous(), "query must be a contiguous [B, H, D]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.stride(4) == 1,
              "kv_cache must be [2, num_blocks, block_size, kv_heads, head_dim], last dim dense");
  const bool widen =
      query.scalar_type() == at::kFloat &&
      (kv_cache.scalar_type() == at::kHalf || kv_cache.scalar_type() == at::kBFloat16);
  TORCH_CHECK(kv_cache.scalar_type() == query.scalar_type() || widen, "query (",
              query.scalar_type(), ") and kv_cache (", kv_cache.scalar_type(),
              ") dtypes differ: the cache has the query's dtype, or is float16/bfloat16 under "
              "a float32 query");
  TORCH_CHECK(kv_cache.size(4) == query.size(2), "query and kv_cache head_dim differ");
  TORCH_CHECK(query.size(1) % kv_cache.size(3) == 0, "num_heads must be a multiple of kv_heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.stride(1) == 1 && block_tables.size(0) >= query.size(0),
              "block_tables must be int32 [>= B, max_blocks] with dense rows");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                  seq_lens.size(0) >= query.size(0),
              "seq_lens must be a contiguous int32 [>= B]");
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: none), got ", softcap);
  TORCH_CHECK(!sinks.has_value() ||
                  (sinks->scalar_type() == at::kFloat && sinks->dim() == 1 &&
                   sinks->size(0) == query.size(1) && sinks->is_contiguous() && sinks->is_cpu()),
              "sinks must be a contiguous float32 CPU tensor [num_heads = ", query.size(1), "]");
  at::Tensor out = at::empty_like(query);
  const float s = static_cast<float>(scale), cap = static_cast<float>(softcap);
  const float* sink_ptr = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  // head_dim 64, 128 and 256 (Gemma, Qwen3-Next) compiled in (fully unrolled dot products, the
  // AVX-512 path), others read at run time
  auto run = [&](auto query_tag, auto kv_tag) {
    using scalar_t = decltype(query_tag);
    using kv_t = decltype(kv_tag);
    const auto decode = [&](auto head_dim) {
      decode_kernel<scalar_t, kv_t, decltype(head_dim)::value>(
          out, query, kv_cache, block_tables, seq_lens, s, window, cap, sink_ptr);
    };
    switch (query.size(2)) {
      case 64: decode(std::integral_constant<int, 64>{}); break;
      case 128: decode(std::integral_constant<int, 128>{}); break;
      case 256: decode(std::integral_constant<int, 256>{}); break;
      default: decode(std::integral_constant<int, 0>{});
    }
  };
  if (widen) {
    AT_DISPATCH_REDUCED_FLOATING_TYPES(kv_cache.scalar_type(), "paged_decode", [&] {
      run(float{}, scalar_t{});
    });
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(),
                                    "paged_decode", [&] { run(scalar_t{}, scalar_t{}); });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(hybridllm, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
