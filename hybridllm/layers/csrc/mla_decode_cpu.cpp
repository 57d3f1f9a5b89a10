// Multi-head latent attention (DeepSeek MLA) decode for CPU, absorbed form: all H query heads
// attend over one shared latent row a token, [c_kv (latent_dim) | k_pe], read once for all
// heads a tile of keys; flash-decoding splits of the keys keep every thread busy at batch 1.
// Registered as the torch op hybridllm::mla_decode_attention; built by cpu_kernels.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "vec_avx512.h"
#include "vec_math.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using hybridllm_math::exp_nonpositive;
constexpr int kTile = 32;             // keys scored and accumulated together, for all heads
constexpr int64_t kMinSplit = 4 * kTile;  // fewest keys a split of one sequence gets
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// f(std::integral_constant<int, n>) for a run-time 1 <= n <= N: the register blocks' remainders
template <int N, typename F>
inline void with_count(int64_t n, F&& f) {
  if constexpr (N > 1) {
    if (n < N) return with_count<N - 1>(n, std::forward<F>(f));
  }
  f(std::integral_constant<int, N>{});
}

struct Shape {
  int64_t heads, dim, latent;  // H, D = latent + rope, latent_dim
  float scale;
};

// One thread's buffers: a tile's keys transposed [D][kTile] (AVX-512), its rows widened to fp32
// [kTile][D] (16-bit caches), the heads' scores then probabilities [H][kTile], and per head the
// running max, sum and the rescale of the accumulator for the current tile.
struct Scratch {
  std::vector<float> kt, rows, p, m, l, alpha;
  explicit Scratch(const Shape& s)
      : kt(s.dim * kTile + 16), rows(kTile * s.dim), p(s.heads * kTile), m(s.heads),
        l(s.heads), alpha(s.heads) {}
};

#if defined(__AVX512F__)
using hybridllm_avx512::load16;

// The tile's keys widened and transposed to kt [D][kTile] (keys past `count` repeat the last),
// and, from a 16-bit cache, the latent part of each row widened to rows [t][D] for pass 2.
template <typename kv_t>
void transpose_tile(const kv_t* const* key, int count, const Shape& s, float* kt, float* rows) {
  for (int half = 0; half < 2; ++half)
    for (int64_t c = 0; c < s.dim; c += 16) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) {
        const int t = std::min(16 * half + i, count - 1);
        r[i] = load16(key[t] + c);
        if (!std::is_same_v<kv_t, float> && c < s.latent && 16 * half + i < count)
          _mm512_storeu_ps(rows + (16 * half + i) * s.dim + c, r[i]);
      }
      hybridllm_avx512::transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_store_ps(kt + (c + i) * kTile + 16 * half, r[i]);
    }
}

// p[r][0..32) = q_r . k_t for kR heads: 2 x kR sums in registers, each q value broadcast once
// for the tile's 32 keys.
template <int kR>
inline void score_heads(const float* q, int64_t dim, const float* kt, float* p) {
  __m512 a[kR][2];
  for (int r = 0; r < kR; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; ++d) {
    const __m512 k0 = _mm512_load_ps(kt + d * kTile), k1 = _mm512_load_ps(kt + d * kTile + 16);
    for (int r = 0; r < kR; ++r) {
      const __m512 qv = _mm512_set1_ps(q[r * dim + d]);
      a[r][0] = _mm512_fmadd_ps(qv, k0, a[r][0]);
      a[r][1] = _mm512_fmadd_ps(qv, k1, a[r][1]);
    }
  }
  for (int r = 0; r < kR; ++r) {
    _mm512_storeu_ps(p + r * kTile, a[r][0]);
    _mm512_storeu_ps(p + r * kTile + 16, a[r][1]);
  }
}

// acc[r][16 kC values] = alpha_r acc[r] + sum_t p[r][t] v_t for kR heads: the kR x kC sums stay
// in registers over the tile's keys, each value vector loaded once for the kR heads.
template <int kR, int kC>
inline void accumulate_heads(const float* p, const float* alpha, const float* const* v,
                             int count, int64_t latent, bool fresh, float* acc) {
  __m512 a[kR][kC];
  for (int r = 0; r < kR; ++r)
    for (int c = 0; c < kC; ++c)
      a[r][c] = fresh ? _mm512_setzero_ps()
                      : _mm512_mul_ps(_mm512_loadu_ps(acc + r * latent + 16 * c),
                                      _mm512_set1_ps(alpha[r]));
  for (int t = 0; t < count; ++t) {
    __m512 vv[kC];
    for (int c = 0; c < kC; ++c) vv[c] = _mm512_loadu_ps(v[t] + 16 * c);
    for (int r = 0; r < kR; ++r) {
      const __m512 w = _mm512_set1_ps(p[r * kTile + t]);
      for (int c = 0; c < kC; ++c) a[r][c] = _mm512_fmadd_ps(w, vv[c], a[r][c]);
    }
  }
  for (int r = 0; r < kR; ++r)
    for (int c = 0; c < kC; ++c) _mm512_storeu_ps(acc + r * latent + 16 * c, a[r][c]);
}
#endif

// One work item: query heads q [H][D] of one sequence against its keys key[0..n) (row
// pointers), leaving acc [H][latent] (unnormalized; the first tile overwrites it), m (running
// max), l (sum of e^(s - m)).
template <typename kv_t>
void attend(const float* q, const kv_t* const* key, int64_t n, const Shape& s, float* acc,
            float* m, float* l, Scratch& w) {
  const int64_t H = s.heads, D = s.dim, L = s.latent;
  std::fill(m, m + H, kNegInf);
  std::fill(l, l + H, 0.f);
#if defined(__AVX512F__)
  const bool blocked = D % 16 == 0 && L % 16 == 0;
  float* kt = w.kt.data() + (-reinterpret_cast<uintptr_t>(w.kt.data()) / sizeof(float)) % 16;
#endif
  const float* v[kTile];  // the tile's rows as fp32: the cache's own, or widened into w.rows
  for (int64_t t0 = 0; t0 < n; t0 += kTile) {
    const int count = static_cast<int>(std::min<int64_t>(kTile, n - t0));
    const kv_t* const* tile = key + t0;
    for (int t = 0; t < count; ++t) {
      if constexpr (std::is_same_v<kv_t, float>) v[t] = tile[t];
      else v[t] = w.rows.data() + t * D;
    }
    float* p = w.p.data();  // scores p [H][kTile]
#if defined(__AVX512F__)
    if (blocked) {  // the keys transposed once, then 8 heads at a time
      transpose_tile(tile, count, s, kt, w.rows.data());
      for (int64_t h = 0; h < H; h += 8)
        with_count<8>(H - h, [&](auto r) { score_heads<r()>(q + h * D, D, kt, p + h * kTile); });
    } else
#endif
    {
      if constexpr (!std::is_same_v<kv_t, float>)
        for (int t = 0; t < count; ++t)
          for (int64_t d = 0; d < D; ++d) w.rows[t * D + d] = static_cast<float>(tile[t][d]);
      for (int64_t h = 0; h < H; ++h)
        for (int t = 0; t < count; ++t) {
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += q[h * D + d] * v[t][d];
          p[h * kTile + t] = dot;
        }
    }
    // online softmax: the tile's scores to e^(s - m_new), the sums and accumulators rescaled
    for (int64_t h = 0; h < H; ++h) {
      float* ph = p + h * kTile;
      float mx = m[h];
      for (int t = 0; t < count; ++t) mx = std::max(mx, ph[t] * s.scale);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int t = 0; t < count; ++t) {
        ph[t] = exp_nonpositive(ph[t] * s.scale - mx);
        sum += ph[t];
      }
      w.alpha[h] = exp_nonpositive(m[h] - mx);  // unused for the first tile
      l[h] = l[h] * w.alpha[h] + sum;
      m[h] = mx;
    }
#if defined(__AVX512F__)
    if (blocked) {  // acc [H][L] += p [H][tile] x v [tile][L], 4 heads x 64 values at a time
      for (int64_t c = 0; c < L; c += 64) {
        const float* vc[kTile];
        for (int t = 0; t < count; ++t) vc[t] = v[t] + c;
        for (int64_t h = 0; h < H; h += 4)
          with_count<4>(H - h, [&](auto r) {
            with_count<4>((L - c) / 16, [&](auto cols) {
              accumulate_heads<r(), cols()>(p + h * kTile, w.alpha.data() + h, vc, count, L,
                                            t0 == 0, acc + h * L + c);
            });
          });
      }
      continue;
    }
#endif
    for (int64_t h = 0; h < H; ++h) {
      float* ah = acc + h * L;
      const float alpha = w.alpha[h];
#pragma omp simd
      for (int64_t i = 0; i < L; ++i) ah[i] = t0 == 0 ? 0.f : ah[i] * alpha;
      for (int t = 0; t < count; ++t) {
        const float pt = p[h * kTile + t];
        const float* vt = v[t];
#pragma omp simd
        for (int64_t i = 0; i < L; ++i) ah[i] += pt * vt[i];
      }
    }
  }
}

// A sequence's keys [start, end), accumulated into acc: the output rows of a whole sequence,
// else a split's partial rows, merged with the sequence's other splits at the end.
struct Item {
  int64_t b, start, end;
  float* acc;
};

template <typename kv_t>
void mla_decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                const at::Tensor& block_tables, const int32_t* lens, const Shape& s) {
  const int64_t batch = query.size(0), H = s.heads, D = s.dim, L = s.latent;
  const int64_t block_size = kv_cache.size(1);
  const kv_t* kv = kv_cache.data_ptr<kv_t>();
  float* o = out.data_ptr<float>();
  // Small work stays on the calling thread. Under 2 sequences a thread, sequences split into
  // ranges of about total / (4 threads) keys (flash-decoding); the threads take items one at a
  // time, the longest first, so they end together even when other work slows one.
  const int64_t threads = at::get_num_threads();
  int64_t total = 0, longest = 1;
  for (int64_t b = 0; b < batch; ++b)
    total += lens[b], longest = std::max<int64_t>(longest, lens[b]);
  const bool serial = threads == 1 || total * H * (D + L) < (int64_t{1} << 20);
  const int64_t chunk = serial || batch >= 2 * threads
                            ? longest
                            : std::max(kMinSplit, (total + 4 * threads - 1) / (4 * threads));
  std::vector<int64_t> first(batch + 1, 0);  // sequence b's items: first[b] .. first[b + 1] - 1
  for (int64_t b = 0; b < batch; ++b) first[b + 1] = first[b] + (lens[b] + chunk - 1) / chunk;
  const int64_t n_items = first[batch];
  at::Tensor part = at::empty({n_items, H, L}, query.options());  // the splits' rows
  std::vector<float> part_m(n_items * H), part_l(n_items * H);
  std::vector<Item> items;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = lens[b], n = first[b + 1] - first[b];
    const int64_t piece = n == 0 ? 0 : ((len + n - 1) / n + kTile - 1) / kTile * kTile;
    for (int64_t j = 0; j < n; ++j)
      items.push_back({b, std::min(len, j * piece), std::min(len, (j + 1) * piece),
                       n == 1 ? o + b * H * L : part.data_ptr<float>() + (first[b] + j) * H * L});
  }
  std::vector<int64_t> order(n_items);
  for (int64_t i = 0; i < n_items; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    return items[x].end - items[x].start > items[y].end - items[y].start;
  });
  std::atomic<int64_t> next{0};
  at::parallel_for(0, serial ? 1 : std::min(threads, n_items), 1, [&](int64_t, int64_t) {
    Scratch w(s);
    std::vector<const kv_t*> key;
    for (int64_t k = next++; k < n_items; k = next++) {
      const int64_t i = order[k];
      const Item& it = items[i];
      const int32_t* table = block_tables.data_ptr<int32_t>() + it.b * block_tables.stride(0);
      key.resize(it.end - it.start);
      for (int64_t t = it.start; t < it.end; ++t)
        key[t - it.start] = kv + table[t / block_size] * kv_cache.stride(0) +
                            (t % block_size) * kv_cache.stride(1);
      attend(query.data_ptr<float>() + it.b * H * D, key.data(), it.end - it.start, s, it.acc,
             part_m.data() + i * H, part_l.data() + i * H, w);
    }
  });
  // out[b, h] = sum_j e^(m_j - M) acc_j / sum_j e^(m_j - M) l_j over the sequence's items j (a
  // whole sequence's acc is out[b, h] already); zeros for an empty sequence
  at::parallel_for(0, batch * H, serial ? batch * H : 16, [&](int64_t begin, int64_t end) {
    std::vector<float> weight;
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H, i0 = first[b], n = first[b + 1] - i0;
      const float* pm = part_m.data() + i0 * H + h;  // item i0 + j's: pm[j * H]
      const float* pl = part_l.data() + i0 * H + h;
      float* ob = o + bh * L;
      float mx = kNegInf, denom = 0.f;
      for (int64_t j = 0; j < n; ++j) mx = std::max(mx, pm[j * H]);
      weight.resize(n);
      for (int64_t j = 0; j < n; ++j) {
        weight[j] = exp_nonpositive(pm[j * H] - mx);
        denom += weight[j] * pl[j * H];
      }
      if (n == 1) {
        for (int64_t d = 0; d < L; ++d) ob[d] /= denom;
        continue;
      }
      std::fill(ob, ob + L, 0.f);
      for (int64_t j = 0; j < n; ++j) {
        const float wj = weight[j] / denom;
        const float* a = items[i0 + j].acc + h * L;
#pragma omp simd
        for (int64_t d = 0; d < L; ++d) ob[d] += wj * a[d];
      }
    }
  });
}

at::Tensor mla_decode_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                                const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                double scale, int64_t latent_dim) {
  for (const at::Tensor* t : {&query, &kv_cache, &block_tables, &seq_lens})
    TORCH_CHECK(t->device().is_cpu(), "mla_decode_attention: every tensor must be on the CPU");
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous() && query.scalar_type() == at::kFloat,
              "query must be a contiguous float32 [B, H, D], got ", query.scalar_type(), " ",
              query.sizes());
  TORCH_CHECK(kv_cache.dim() == 3 && kv_cache.stride(2) == 1,
              "kv_cache must be [num_blocks, block_size, D] with the last dim dense, got ",
              kv_cache.sizes());
  const auto kv_type = kv_cache.scalar_type();
  TORCH_CHECK(kv_type == at::kFloat || kv_type == at::kHalf || kv_type == at::kBFloat16,
              "kv_cache dtype must be float32, float16 or bfloat16, got ", kv_type);
  TORCH_CHECK(kv_cache.size(2) == query.size(2), "query width D (", query.size(2),
              ") differs from kv_cache's row width (", kv_cache.size(2), ")");
  TORCH_CHECK(latent_dim > 0 && latent_dim <= kv_cache.size(2), "latent_dim (", latent_dim,
              ") must be in [1, D = ", kv_cache.size(2), "]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.stride(1) == 1 && block_tables.size(0) >= query.size(0),
              "block_tables must be int32 [>= B, max_blocks] with dense rows");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 &&
                  seq_lens.is_contiguous() && seq_lens.size(0) >= query.size(0),
              "seq_lens must be a contiguous int32 [>= B]");
  const int64_t batch = query.size(0), block_size = kv_cache.size(1);
  const int64_t num_blocks = kv_cache.size(0), max_blocks = block_tables.size(1);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b) {  // every block read is in the cache
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= max_blocks * block_size, "seq_lens[", b, "] = ",
                lens[b], " is negative or beyond the block table's ", max_blocks, " blocks of ",
                block_size);
    for (int64_t j = 0; j * block_size < lens[b]; ++j) {
      const int32_t block = tables[b * block_tables.stride(0) + j];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block_tables[", b, ", ", j, "] = ", block,
                  " is not a block of kv_cache (", num_blocks, " blocks)");
    }
  }
  at::Tensor out = at::empty({batch, query.size(1), latent_dim}, query.options());
  const Shape s{query.size(1), query.size(2), latent_dim, static_cast<float>(scale)};
  if (kv_type == at::kFloat)
    mla_decode<float>(out, query, kv_cache, block_tables, lens, s);
  else if (kv_type == at::kHalf)
    mla_decode<c10::Half>(out, query, kv_cache, block_tables, lens, s);
  else
    mla_decode<c10::BFloat16>(out, query, kv_cache, block_tables, lens, s);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(hybridllm, CPU, m) {
  m.impl("mla_decode_attention", &mla_decode_attention);
}
