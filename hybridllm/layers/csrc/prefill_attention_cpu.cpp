// Causal prefill attention for CPU: one sequence's chunk of n query tokens, the last n of its
// ctx-token context, over that context's keys and values (fp32, or a 16-bit cache's widened as
// they are read), grouped-query heads, an optional sliding window, optional logit soft-capping
// (Gemma 2) and attention sinks (gpt-oss), both applied in the softmax pass. Registered as
// hybridllm::prefill_attention; built on first use by hybridllm/layers/cpu_kernels.py.
//
// Why not torch's SDPA: on the project's 2-core EPYC its CPU kernel ran SmolLM2's 128-token
// prompts (9 / 3 heads of 64) at ~25 GFLOPS a call and a 1B model's 512-token prompt at ~70,
// a fifth of a 1B prefill and as long as a 64-prompt run's o_proj and qkv GEMMs together.
//
// A work item is one KV head and a tile of query tokens: its rows (each token's query heads of
// that KV head) meet the keys in three passes over fp32 scratch: scores (4 rows against 32
// keys at a time, keys transposed so that each step is a broadcast times two vectors), a masked
// softmax per row, and the weighted sum of values (4 rows at a time, kept in registers).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "vec_avx512.h"
#include "vec_math.h"

namespace {

using hybridllm_math::exp_minus_max;
using hybridllm_math::softcap_inplace;

#if defined(__AVX512F__)
using hybridllm_avx512::in_register;
using hybridllm_avx512::load16;
using hybridllm_avx512::transpose16;
#endif

constexpr int kRows = 4;   // rows a register block
constexpr int kKeys = 16;  // keys a score tile (one 16-float vector)

// Strided views of the inputs: element (token t, head h, dim d) at base[t * token + h * head + d].
template <typename T>
struct Rows {
  const T* base;
  int64_t token, head;
  const T* at(int64_t t, int64_t h) const { return base + t * token + h * head; }
};

// Scratch of one thread, kept from item to item and call to call.
struct Scratch {
  std::vector<float> q, keys_t, values, scores, inv_sum;
};

// o[i] = inv_sum[i] * sum_{j in [lo, hi)} p[i][j] values[j] for nr <= 4 rows, head_dim kDim:
// the sums stay in a local array the compiler keeps in registers.
template <int kDim>
void weighted_values(const float* const* p, const float* values, int64_t lo, int64_t hi,
                     const float* inv_sum, int nr, float* const* o) {
#if defined(__AVX512F__)
  if constexpr (kDim > 0 && kDim % 64 == 0) {
    // 64 dims at a time (kDim = 128: two passes over the values, as 4 rows' sums of all 128
    // would not fit the registers): a value row's 4 vectors loaded once for the 4 rows
    // (in_register: 4 loads for 16 FMAs, where the compiler's own code loaded them for each
    // row, 20)
    for (int d0 = 0; d0 < kDim; d0 += 64) {
      __m512 acc[kRows][4];
      for (int i = 0; i < kRows; ++i)
        for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_setzero_ps();
      for (int64_t j = lo; j < hi; ++j) {
        __m512 v[4];
        for (int c = 0; c < 4; ++c)
          v[c] = in_register(_mm512_loadu_ps(values + j * kDim + d0 + 16 * c));
        for (int i = 0; i < kRows; ++i) {
          const __m512 pj = _mm512_set1_ps(p[i][j]);
          for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_fmadd_ps(pj, v[c], acc[i][c]);
        }
      }
      for (int i = 0; i < nr; ++i) {
        const __m512 inv = _mm512_set1_ps(inv_sum[i]);
        for (int c = 0; c < 4; ++c)
          _mm512_storeu_ps(o[i] + d0 + 16 * c, _mm512_mul_ps(acc[i][c], inv));
      }
    }
    return;
  }
#endif
  float acc[kRows][kDim] = {};
  for (int64_t j = lo; j < hi; ++j) {
    const float* v = values + j * kDim;
    for (int i = 0; i < kRows; ++i) {
      const float pj = p[i][j];
#pragma omp simd
      for (int d = 0; d < kDim; ++d) acc[i][d] += pj * v[d];
    }
  }
  for (int i = 0; i < nr; ++i)
#pragma omp simd
    for (int d = 0; d < kDim; ++d) o[i][d] = acc[i][d] * inv_sum[i];
}

// One item: KV head `kv_head`, query tokens [i0, i1) at context positions offset + i.
template <int kDim, typename kv_t>
void prefill_item(const Rows<float>& query, const Rows<kv_t>& key, const Rows<kv_t>& value,
                  int64_t head_dim_runtime, int64_t group, int64_t kv_head, int64_t i0,
                  int64_t i1, int64_t offset, int64_t window, float scale, float softcap,
                  const float* sinks, float* out, int64_t out_token, Scratch& s) {
  const int64_t D = kDim > 0 ? kDim : head_dim_runtime;
  const int64_t rows = (i1 - i0) * group;  // row r: token i0 + r / group, head r % group
  const int64_t last = offset + i1;        // one past the newest key any row sees
  const int64_t first = window > 0 ? std::max<int64_t>(0, offset + i0 - window + 1) : 0;
  const int64_t n = last - first;
  const int64_t tiles = (n + kKeys - 1) / kKeys;

  // fp32 copies: queries scaled, keys transposed a tile at a time ([tile][d][16], zeros past
  // n), values as rows [n][D]
  s.q.resize(rows * D);
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = query.at(i0 + r / group, kv_head * group + r % group);
    float* dst = s.q.data() + r * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * scale;
  }
  s.keys_t.resize(tiles * D * kKeys);
  std::fill(s.keys_t.end() - D * kKeys, s.keys_t.end(), 0.f);  // the last tile's padding
  s.values.resize(n * D);
  int64_t j = 0;
#if defined(__AVX512F__)
  // whole tiles of 16 keys: 16 x 16 blocks widened and transposed in registers, where the
  // scalar loop below wrote one float a key and dimension, 16 floats apart
  constexpr bool kLoads16 = std::is_same_v<kv_t, float> || std::is_same_v<kv_t, c10::Half> ||
                           std::is_same_v<kv_t, c10::BFloat16>;  // (the dispatch compiles double)
  if constexpr (kLoads16) {
    for (; D % 16 == 0 && j + kKeys <= n; j += kKeys) {
      float* kt = s.keys_t.data() + (j / kKeys) * D * kKeys;
      for (int64_t d0 = 0; d0 < D; d0 += 16) {
        __m512 r[16];
        for (int i = 0; i < 16; ++i) r[i] = load16(key.at(first + j + i, kv_head) + d0);
        transpose16(r);  // r[c]: dimension d0 + c of the 16 keys
        for (int c = 0; c < 16; ++c) _mm512_storeu_ps(kt + (d0 + c) * kKeys, r[c]);
      }
      for (int i = 0; i < kKeys; ++i) {
        const kv_t* v = value.at(first + j + i, kv_head);
        float* vf = s.values.data() + (j + i) * D;
        for (int64_t d0 = 0; d0 < D; d0 += 16) _mm512_storeu_ps(vf + d0, load16(v + d0));
      }
    }
  }
#endif
  for (; j < n; ++j) {
    const kv_t* k = key.at(first + j, kv_head);
    const kv_t* v = value.at(first + j, kv_head);
    float* kt = s.keys_t.data() + (j / kKeys) * D * kKeys + j % kKeys;
    float* vf = s.values.data() + j * D;
    for (int64_t d = 0; d < D; ++d) kt[d * kKeys] = static_cast<float>(k[d]);
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) vf[d] = static_cast<float>(v[d]);
  }

  // pass 1: scores [rows][n], 4 rows x 16 keys a step; a row's keys past its own position are
  // skipped by tiles (whole tiles past the block's newest row) and masked below
  s.scores.resize(rows * n);
  s.inv_sum.resize(rows);
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int nr = static_cast<int>(std::min<int64_t>(kRows, rows - r0));
    const int64_t newest = offset + i0 + (r0 + nr - 1) / group;  // the block's newest position
    const int64_t block_tiles = (newest + 1 - first + kKeys - 1) / kKeys;
    const float* q[kRows];
    for (int i = 0; i < kRows; ++i) q[i] = s.q.data() + (r0 + std::min(i, nr - 1)) * D;
    int64_t tile = 0;
#if defined(__AVX512F__)
    // two tiles a step: 4 broadcasts and 2 key loads for 8 FMAs (one tile: 5 loads for 4)
    for (; tile + 2 <= block_tiles; tile += 2) {
      const float* kt = s.keys_t.data() + tile * D * kKeys;
      __m512 acc[kRows][2];
      for (int i = 0; i < kRows; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; ++d) {
        const __m512 k0 = in_register(_mm512_loadu_ps(kt + d * kKeys));
        const __m512 k1 = in_register(_mm512_loadu_ps(kt + (D + d) * kKeys));
        for (int i = 0; i < kRows; ++i) {
          const __m512 qd = _mm512_set1_ps(q[i][d]);
          acc[i][0] = _mm512_fmadd_ps(qd, k0, acc[i][0]);
          acc[i][1] = _mm512_fmadd_ps(qd, k1, acc[i][1]);
        }
      }
      const int64_t j0 = tile * kKeys, count = std::min<int64_t>(2 * kKeys, n - j0);
      for (int i = 0; i < nr; ++i) {
        float* dst = s.scores.data() + (r0 + i) * n + j0;
        const auto mask = [](int64_t keys) {  // the first `keys` of 16 lanes
          return keys >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << keys) - 1);
        };
        _mm512_mask_storeu_ps(dst, mask(count), acc[i][0]);
        if (count > 16) _mm512_mask_storeu_ps(dst + 16, mask(count - 16), acc[i][1]);
      }
    }
#endif
    for (; tile < block_tiles; ++tile) {
      const float* kt = s.keys_t.data() + tile * D * kKeys;
      float acc[kRows][kKeys] = {};
      for (int64_t d = 0; d < D; ++d) {
        const float* kd = kt + d * kKeys;
        for (int i = 0; i < kRows; ++i) {
          const float qd = q[i][d];
#pragma omp simd
          for (int l = 0; l < kKeys; ++l) acc[i][l] += qd * kd[l];
        }
      }
      const int64_t j0 = tile * kKeys, count = std::min<int64_t>(kKeys, n - j0);
      for (int i = 0; i < nr; ++i)
        std::copy(acc[i], acc[i] + count, s.scores.data() + (r0 + i) * n + j0);
    }
  }
  // softmax numerators over each row's visible keys (soft-capped first; a sink logit in the
  // denominator), zeros elsewhere
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t pos = offset + i0 + r / group;
    const int64_t lo = (window > 0 ? std::max(first, pos - window + 1) : first) - first;
    const int64_t hi = pos + 1 - first;
    float* sr = s.scores.data() + r * n;
    if (softcap > 0.f) softcap_inplace(sr + lo, hi - lo, softcap);
    const float sink = sinks == nullptr ? -std::numeric_limits<float>::infinity()
                                        : sinks[kv_head * group + r % group];
    s.inv_sum[r] = 1.f / exp_minus_max(sr + lo, hi - lo, sink);
    std::fill(sr, sr + lo, 0.f);
    std::fill(sr + hi, sr + n, 0.f);
  }
  // pass 2: out[r] = sum_j p[r, j] v_j / sum_r, 4 rows a step over the keys any of them sees
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int nr = static_cast<int>(std::min<int64_t>(kRows, rows - r0));
    const int64_t oldest = offset + i0 + r0 / group;
    const int64_t lo = (window > 0 ? std::max(first, oldest - window + 1) : first) - first;
    const int64_t hi = offset + i0 + (r0 + nr - 1) / group + 1 - first;
    const float* p[kRows];
    for (int i = 0; i < kRows; ++i) p[i] = s.scores.data() + (r0 + std::min(i, nr - 1)) * n;
    float* o[kRows];
    for (int i = 0; i < nr; ++i) {
      const int64_t r = r0 + i;
      o[i] = out + (i0 + r / group) * out_token + (kv_head * group + r % group) * D;
    }
    if constexpr (kDim > 0) {
      weighted_values<kDim>(p, s.values.data(), lo, hi, s.inv_sum.data() + r0, nr, o);
    } else {
      for (int i = 0; i < nr; ++i) std::fill(o[i], o[i] + D, 0.f);
      for (int64_t j = lo; j < hi; ++j) {
        const float* v = s.values.data() + j * D;
        for (int i = 0; i < nr; ++i) {
          const float pj = p[i][j];
          float* a = o[i];
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += pj * v[d];
        }
      }
      for (int i = 0; i < nr; ++i) {
        const float inv = s.inv_sum[r0 + i];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[i][d] *= inv;
      }
    }
  }
}

template <int kDim, typename kv_t>
void prefill_kernel(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                    at::Tensor& out, double scale, int64_t window, float softcap,
                    const float* sinks) {
  const int64_t n = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t ctx = key.size(0), num_kv_heads = key.size(1);
  const int64_t group = num_heads / num_kv_heads, offset = ctx - n;
  const Rows<float> q{query.data_ptr<float>(), query.stride(0), query.stride(1)};
  const Rows<kv_t> k{key.data_ptr<kv_t>(), key.stride(0), key.stride(1)};
  const Rows<kv_t> v{value.data_ptr<kv_t>(), value.stride(0), value.stride(1)};
  float* o = out.data_ptr<float>();
  // Query tokens an item: 16 to 64, so that there are some 8 items a thread. An item converts
  // its keys and values once for all its rows: bigger tiles, fewer conversions.
  const int64_t threads = at::get_num_threads();
  const int64_t tile_tokens =
      std::clamp<int64_t>(n * num_kv_heads / (8 * threads) / 16 * 16, 16, 64);
  const int64_t tiles = (n + tile_tokens - 1) / tile_tokens;
  // item i's tile alternates between the chunk's two ends (0, last, 1, last - 1, ...): later
  // tiles see more keys, and each thread's contiguous run of items gets a share of both
  at::parallel_for(0, tiles * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch scratch;  // kept from call to call: fresh buffers fault their pages in
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item % num_kv_heads, order = item / num_kv_heads;
      const int64_t tile = order % 2 == 0 ? order / 2 : tiles - 1 - order / 2;
      const int64_t i0 = tile * tile_tokens, i1 = std::min(n, i0 + tile_tokens);
      prefill_item<kDim, kv_t>(q, k, v, head_dim, group, h, i0, i1, offset, window,
                               static_cast<float>(scale), softcap, sinks, o, num_heads * head_dim,
                               scratch);
    }
  });
}

at::Tensor prefill_attention(const at::Tensor& query, const at::Tensor& key,
                             const at::Tensor& value, double scale, int64_t window, double softcap,
                             const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3,
              "prefill_attention: query [n, heads, D], key and value [ctx, kv_heads, D]; got ",
              query.sizes(), ", ", key.sizes(), ", ", value.sizes());
  TORCH_CHECK(query.scalar_type() == at::kFloat, "prefill_attention: query must be float32, got ",
              query.scalar_type());
  TORCH_CHECK(key.scalar_type() == value.scalar_type() &&
                  (key.scalar_type() == at::kFloat || key.scalar_type() == at::kHalf ||
                   key.scalar_type() == at::kBFloat16),
              "prefill_attention: key and value must share a dtype of float32, float16 or "
              "bfloat16, got ", key.scalar_type(), " and ", value.scalar_type());
  TORCH_CHECK(key.sizes() == value.sizes(), "prefill_attention: key ", key.sizes(),
              " and value ", value.sizes(), " differ");
  TORCH_CHECK(query.size(2) == key.size(2) && query.size(2) > 0,
              "prefill_attention: head_dim differs: query ", query.size(2), ", key ", key.size(2));
  TORCH_CHECK(key.size(1) > 0 && query.size(1) % key.size(1) == 0,
              "prefill_attention: ", query.size(1), " query heads are not a multiple of ",
              key.size(1), " KV heads");
  TORCH_CHECK(key.size(0) >= query.size(0), "prefill_attention: ", query.size(0),
              " queries but a context of ", key.size(0));
  TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1 && value.stride(2) == 1,
              "prefill_attention: the head dim must be dense");
  TORCH_CHECK(window >= 0, "prefill_attention: window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(softcap >= 0, "prefill_attention: softcap must be >= 0 (0: none), got ", softcap);
  TORCH_CHECK(!sinks.has_value() ||
                  (sinks->scalar_type() == at::kFloat && sinks->dim() == 1 &&
                   sinks->size(0) == query.size(1) && sinks->is_contiguous() && sinks->is_cpu()),
              "prefill_attention: sinks must be a contiguous float32 CPU tensor [num_heads = ",
              query.size(1), "]");
  const float cap = static_cast<float>(softcap);
  const float* sink_ptr = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  at::Tensor out = at::empty(query.sizes(), query.options());
  if (query.size(0) == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, key.scalar_type(), "prefill", [&] {
    switch (query.size(2)) {  // head_dim 64 and 128: accumulators in registers
      case 64:
        prefill_kernel<64, scalar_t>(query, key, value, out, scale, window, cap, sink_ptr);
        break;
      case 128:
        prefill_kernel<128, scalar_t>(query, key, value, out, scale, window, cap, sink_ptr);
        break;
      default: prefill_kernel<0, scalar_t>(query, key, value, out, scale, window, cap, sink_ptr);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(hybridllm, CPU, m) {
  m.impl("prefill_attention", &prefill_attention);
}
