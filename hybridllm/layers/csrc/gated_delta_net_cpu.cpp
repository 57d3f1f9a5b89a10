// Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention) for CPU: the causal depthwise conv1d
// over a flattened batch of sequences with its per-slot state, and the gated delta rule's
// recurrent form, one token at a time per sequence (decode rows and prefill; several tokens go
// through the state in column blocks that stay in L1).
// Registered as hybridllm::gdn_conv1d and hybridllm::gdn_recurrent; built on first use by
// hybridllm/layers/cpu_kernels.py. The torch forms are in hybridllm/layers/gated_delta_rule.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "vec_math.h"

namespace {

// out[c] = silu(a[c]), c < n
inline void silu_row(const float* a, float* out, int64_t n) {
  int64_t c = 0;
#if defined(__AVX512F__)
  for (; c + 16 <= n; c += 16)
    _mm512_storeu_ps(out + c, hybridllm_math::silu16(_mm512_loadu_ps(a + c)));
#endif
  for (; c < n; ++c) out[c] = hybridllm_math::silu(a[c]);
}

void check_f32(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), what,
              " must be a contiguous float32 CPU tensor");
}

void check_batch(const at::Tensor& query_start_loc, const at::Tensor& slots, int64_t tokens,
                 int64_t num_slots) {
  TORCH_CHECK(query_start_loc.scalar_type() == at::kLong && query_start_loc.is_contiguous() &&
                  query_start_loc.dim() == 1 && query_start_loc.size(0) >= 1,
              "query_start_loc must be a contiguous int64 [num_seqs + 1]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.size(0) == query_start_loc.size(0) - 1,
              "slots must be a contiguous int64 [num_seqs]");
  const int64_t* loc = query_start_loc.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  TORCH_CHECK(loc[0] == 0 && loc[slots.size(0)] == tokens, "query_start_loc must span x's rows");
  for (int64_t s = 0; s < slots.size(0); ++s) {
    TORCH_CHECK(loc[s] <= loc[s + 1], "query_start_loc must not decrease");
    TORCH_CHECK(slot[s] >= 0 && slot[s] < num_slots, "state slot out of range");
  }
}

// x [T, C] fp32 (the in-projection's q|k|v channels of every sequence, flattened), conv_state
// [slots, C, K-1] fp32 (each slot: the sequence's last K-1 inputs, oldest first), weight [C, K]
// fp32. Sequence s owns rows [loc[s], loc[s+1]) and slot slots[s]; fresh[s] starts it from
// zeros. out [T, C] = silu(causal conv); conv_state[slot] <- the last K-1 inputs, in place.
at::Tensor gdn_conv1d(const at::Tensor& x, at::Tensor& conv_state, const at::Tensor& weight,
                      const at::Tensor& query_start_loc, const at::Tensor& fresh,
                      const at::Tensor& slots) {
  check_f32(x, "gdn_conv1d: x");
  check_f32(conv_state, "gdn_conv1d: conv_state");
  check_f32(weight, "gdn_conv1d: weight");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && conv_state.dim() == 3, "gdn_conv1d: ranks");
  const int64_t tokens = x.size(0), channels = x.size(1), kernel = weight.size(1);
  const int64_t hist = kernel - 1;
  TORCH_CHECK(weight.size(0) == channels && conv_state.size(1) == channels &&
                  conv_state.size(2) == hist,
              "gdn_conv1d: weight must be [C, K] and conv_state [slots, C, K-1]");
  check_batch(query_start_loc, slots, tokens, conv_state.size(0));
  TORCH_CHECK(fresh.scalar_type() == at::kBool && fresh.is_contiguous() &&
                  fresh.size(0) == slots.size(0),
              "gdn_conv1d: fresh must be a contiguous bool [num_seqs]");
  at::Tensor out = at::empty({tokens, channels}, x.options());
  const int64_t seqs = slots.size(0);
  const int64_t* loc = query_start_loc.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const bool* is_fresh = fresh.data_ptr<bool>();
  const float* xp = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* state = conv_state.data_ptr<float>();
  float* o = out.data_ptr<float>();
  // The taps as [K][C], once a call, so that every tap is a contiguous row of channels.
  std::vector<float> taps(kernel * channels);
  for (int64_t c = 0; c < channels; ++c)
    for (int64_t j = 0; j < kernel; ++j) taps[j * channels + c] = w[c * kernel + j];
  // items: (chunk of kChunk channels, sequence), sequences fastest: each thread's contiguous
  // range of items then holds every sequence's share of some channels, so a long prefill beside
  // decode rows is spread over all threads. Within an item the channels are the inner loop
  // (vectorized), a token's window read straight from x's rows; only the first K-1 tokens
  // reach into the state, a channel at a time in its own [C][K-1] layout. Items of 64 channels
  // that gathered their taps again and shifted a history buffer every token took 16.9-22.7 ms
  // for 32 prompts of 64 tokens at Qwen3-Next's 8192 channels, these 13.6-16.2 (2-core Zen 5,
  // one process each, in turns, the engine's allocator settings); a decode step of 64 sequences
  // is 1.9-2.9 ms either way.
  constexpr int64_t kChunk = 512;
  const int64_t chunks = (channels + kChunk - 1) / kChunk;
  at::parallel_for(0, seqs * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> before(kChunk * hist), acc(kChunk);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item % seqs, c0 = item / seqs * kChunk;
      const int64_t nc = std::min(channels, c0 + kChunk) - c0;
      const int64_t t0 = loc[s], len = loc[s + 1] - loc[s];
      float* st = state + (slot[s] * channels + c0) * hist;  // [nc][hist], oldest first
      // the inputs before the sequence's first row, as the state holds them
      float* pv = before.data();
      if (is_fresh[s])
        std::fill(pv, pv + nc * hist, 0.f);
      else
        std::copy(st, st + nc * hist, pv);
      // channel c's input tau of this sequence (tau < 0: from before)
      const auto input = [&](int64_t tau, int64_t c) {
        return tau >= 0 ? xp[(t0 + tau) * channels + c0 + c] : pv[c * hist + hist + tau];
      };
      float* a = acc.data();
      for (int64_t t = 0; t < len; ++t) {
        // window = inputs t - hist .. t, oldest first, as the weight's taps
        if (t < hist) {  // reaches into the state: a channel at a time
          for (int64_t c = 0; c < nc; ++c) {
            float sum = 0.f;
            for (int64_t j = 0; j < kernel; ++j)
              sum += taps[j * channels + c0 + c] * input(t - hist + j, c);
            a[c] = sum;
          }
        } else {  // x's rows alone: whole rows of channels
          for (int64_t j = 0; j < kernel; ++j) {
            const float* xj = xp + (t0 + t - hist + j) * channels + c0;
            const float* tj = taps.data() + j * channels + c0;
            if (j == 0) {
#pragma omp simd
              for (int64_t c = 0; c < nc; ++c) a[c] = tj[c] * xj[c];
            } else {
#pragma omp simd
              for (int64_t c = 0; c < nc; ++c) a[c] += tj[c] * xj[c];
            }
          }
        }
        silu_row(a, o + (t0 + t) * channels + c0, nc);
      }
      for (int64_t c = 0; c < nc; ++c)  // the state: the last hist inputs
        for (int64_t j = 0; j < hist; ++j) st[c * hist + j] = input(len - hist + j, c);
    }
  });
  return out;
}

// A run of one (sequence, value head)'s tokens, prepared for the rule: q and k l2-normalized
// (q also scaled by dk^-0.5), one after the other, with each token's decay exp(g), beta, q . k.
struct RuleTokens {
  const float* q;  // [n, dk]
  const float* k;  // [n, dk]
  const float* decay;
  const float* beta;
  const float* qk;
  const float* v;  // token t's values at v + t * v_stride
  int64_t v_stride;
  float* out;  // token t's output at out + t * out_stride
  int64_t out_stride, n, dk;
};

// Tokens prepared at once: their q and k, 2 * 64 * Dk fp32 (64 KB at Dk = 128).
constexpr int64_t kTokenRun = 64;

// Columns [c0, c1) of the state S [Dk, Dv] (rows dv apart) through the run's tokens, in place.
// Columns are independent in the rule. With S' = decay S + k delta^T:
//   delta = beta (v - decay S^T k), out = S'^T q = decay S^T q + (q . k) delta.
// One read of S for both products, one read-write for the update; mem: 2 (c1 - c0) floats.
void rule_columns(const RuleTokens& r, float* S, int64_t dv, int64_t c0, int64_t c1, float* mem) {
  const int64_t cols = c1 - c0;
  float* mem_k = mem;
  float* mem_q = mem + cols;
  for (int64_t t = 0; t < r.n; ++t) {
    const float *k = r.k + t * r.dk, *q = r.q + t * r.dk;
    for (int64_t j = 0; j < cols; ++j) mem_k[j] = mem_q[j] = 0.f;
    for (int64_t i = 0; i < r.dk; ++i) {
      const float* Si = S + i * dv + c0;
      const float ki = k[i], qi = q[i];
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) {
        mem_k[j] += ki * Si[j];
        mem_q[j] += qi * Si[j];
      }
    }
    const float decay = r.decay[t], b = r.beta[t], qk = r.qk[t];
    const float* v = r.v + t * r.v_stride + c0;
    float* o = r.out + t * r.out_stride + c0;
    for (int64_t j = 0; j < cols; ++j) {
      mem_k[j] = b * (v[j] - decay * mem_k[j]);  // delta
      o[j] = decay * mem_q[j] + qk * mem_k[j];
    }
    for (int64_t i = 0; i < r.dk; ++i) {
      float* Si = S + i * dv + c0;
      const float ki = k[i];
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) Si[j] = decay * Si[j] + ki * mem_k[j];
    }
  }
}

#if defined(__AVX512F__)
// rule_columns for 16 columns (Dk % 4 == 0): one pass over the block a token, applying the
// previous token's update as it accumulates this token's S^T k and S^T q. The block, Dk x 16
// fp32 (8 KB at Dk = 128), stays in L1, where a head's whole state (64 KB) does not: a
// 2,048-token chunk of 32 prompts at Qwen3-Next's sizes (32 heads, Dk = Dv = 128) took 183-185
// ms a layer on 2 cores with the whole rows, 60-62 in blocks.
void rule_columns16(const RuleTokens& r, float* S, int64_t dv, int64_t c0) {
  __m512 delta = _mm512_setzero_ps(), decay = _mm512_set1_ps(1.f);
  const float* k_prev = nullptr;  // the previous token's k, whose update is pending
  for (int64_t t = 0; t < r.n; ++t) {
    const float *k = r.k + t * r.dk, *q = r.q + t * r.dk;
    __m512 ak[4], aq[4];  // partial sums over i % 4: four chains each for the FMA latency
    for (int u = 0; u < 4; ++u) ak[u] = aq[u] = _mm512_setzero_ps();
    for (int64_t i = 0; i < r.dk; i += 4) {
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {
        float* Si = S + (i + u) * dv + c0;
        __m512 row = _mm512_loadu_ps(Si);
        if (k_prev != nullptr) {
          row = _mm512_fmadd_ps(_mm512_set1_ps(k_prev[i + u]), delta, _mm512_mul_ps(decay, row));
          _mm512_storeu_ps(Si, row);
        }
        ak[u] = _mm512_fmadd_ps(_mm512_set1_ps(k[i + u]), row, ak[u]);
        aq[u] = _mm512_fmadd_ps(_mm512_set1_ps(q[i + u]), row, aq[u]);
      }
    }
    const __m512 mem_k = _mm512_add_ps(_mm512_add_ps(ak[0], ak[1]), _mm512_add_ps(ak[2], ak[3]));
    const __m512 mem_q = _mm512_add_ps(_mm512_add_ps(aq[0], aq[1]), _mm512_add_ps(aq[2], aq[3]));
    decay = _mm512_set1_ps(r.decay[t]);
    const __m512 v = _mm512_loadu_ps(r.v + t * r.v_stride + c0);
    delta = _mm512_mul_ps(_mm512_set1_ps(r.beta[t]), _mm512_fnmadd_ps(decay, mem_k, v));
    _mm512_storeu_ps(r.out + t * r.out_stride + c0,
                     _mm512_fmadd_ps(decay, mem_q, _mm512_mul_ps(_mm512_set1_ps(r.qk[t]), delta)));
    k_prev = k;
  }
  if (k_prev == nullptr) return;
  for (int64_t i = 0; i < r.dk; ++i) {  // the last token's update
    float* Si = S + i * dv + c0;
    _mm512_storeu_ps(Si, _mm512_fmadd_ps(_mm512_set1_ps(k_prev[i]), delta,
                                         _mm512_mul_ps(decay, _mm512_loadu_ps(Si))));
  }
}
#endif

// One (sequence, value head): its tokens in order through the gated delta rule, on the state
// S [Dk, Dv] in place, kTokenRun at a time. q, k: the head's raw (conv output) vectors,
// l2-normalized here. scratch: kTokenRun * (2 Dk + 3) + 2 Dv floats.
void delta_rule_head(const float* qkv, int64_t row_stride, int64_t q_off, int64_t k_off,
                     int64_t v_off, const float* g, const float* beta, int64_t gb_stride,
                     float* S, float* out, int64_t out_stride, int64_t len, int64_t dk,
                     int64_t dv, float* scratch) {
  const float scale = 1.f / std::sqrt(static_cast<float>(dk));
  float* qn = scratch;
  float* kn = qn + kTokenRun * dk;
  float* decay = kn + kTokenRun * dk;
  float* b = decay + kTokenRun;
  float* qk = b + kTokenRun;
  float* mem = qk + kTokenRun;
  for (int64_t t0 = 0; t0 < len; t0 += kTokenRun) {
    const int64_t n = std::min(kTokenRun, len - t0);
    for (int64_t t = 0; t < n; ++t) {
      const float* row = qkv + (t0 + t) * row_stride;
      float* q = qn + t * dk;
      float* k = kn + t * dk;
      float qq = 0.f, kk = 0.f;
      for (int64_t i = 0; i < dk; ++i) {
        q[i] = row[q_off + i];
        k[i] = row[k_off + i];
        qq += q[i] * q[i];
        kk += k[i] * k[i];
      }
      // the FLA l2norm: x * rsqrt(sum x^2 + 1e-6); queries also scaled by dk^-0.5
      const float qs = scale / std::sqrt(qq + 1e-6f), ks = 1.f / std::sqrt(kk + 1e-6f);
      float dot = 0.f;
      for (int64_t i = 0; i < dk; ++i) {
        q[i] *= qs;
        k[i] *= ks;
        dot += q[i] * k[i];
      }
      qk[t] = dot;
      decay[t] = std::exp(g[(t0 + t) * gb_stride]);
      b[t] = beta[(t0 + t) * gb_stride];
    }
    const RuleTokens run{qn,         kn,        decay, b, qk, qkv + t0 * row_stride + v_off,
                         row_stride, out + t0 * out_stride, out_stride, n, dk};
    int64_t c0 = 0;
#if defined(__AVX512F__)
    // one token (decode) reads the state from memory once either way, and whole rows stream
    // faster than a block's 64-byte pieces of them: 64 decode rows 6.9-7.4 against 8.6-9.1 ms
    if (dk % 4 == 0 && n > 1)
      for (; c0 + 16 <= dv; c0 += 16) rule_columns16(run, S, dv, c0);
#endif
    if (c0 < dv) rule_columns(run, S, dv, c0, dv, mem);
  }
}

// qkv [T, 2 Hk Dk + Hv Dv] fp32 (conv output: q heads | k heads | v heads), g (log decay) and
// beta [T, Hv] fp32, state [slots, Hv, Dk, Dv] fp32 updated in place -> out [T, Hv, Dv] fp32.
// Value head h reads q/k head h / (Hv / Hk). Threaded over (value head, sequence), sequences
// fastest, for the balance gdn_conv1d's order gives.
at::Tensor gdn_recurrent(const at::Tensor& qkv, const at::Tensor& g, const at::Tensor& beta,
                         at::Tensor& state, const at::Tensor& query_start_loc,
                         const at::Tensor& slots, int64_t num_k_heads) {
  check_f32(qkv, "gdn_recurrent: qkv");
  check_f32(g, "gdn_recurrent: g");
  check_f32(beta, "gdn_recurrent: beta");
  check_f32(state, "gdn_recurrent: state");
  TORCH_CHECK(state.dim() == 4 && qkv.dim() == 2, "gdn_recurrent: state [slots, Hv, Dk, Dv]");
  const int64_t tokens = qkv.size(0), hv = state.size(1), dk = state.size(2), dv = state.size(3);
  TORCH_CHECK(num_k_heads > 0 && hv % num_k_heads == 0, "gdn_recurrent: Hv % Hk != 0");
  TORCH_CHECK(qkv.size(1) == 2 * num_k_heads * dk + hv * dv, "gdn_recurrent: qkv width");
  TORCH_CHECK(g.dim() == 2 && g.size(0) == tokens && g.size(1) == hv && g.sizes() == beta.sizes(),
              "gdn_recurrent: g and beta must be [T, Hv]");
  check_batch(query_start_loc, slots, tokens, state.size(0));
  at::Tensor out = at::empty({tokens, hv, dv}, qkv.options());
  const int64_t seqs = slots.size(0), width = qkv.size(1), group = hv / num_k_heads;
  const int64_t* loc = query_start_loc.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const float* x = qkv.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  const float* bp = beta.data_ptr<float>();
  float* sp = state.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, seqs * hv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(kTokenRun * (2 * dk + 3) + 2 * dv);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item % seqs, h = item / seqs, kh = h / group, t0 = loc[s];
      delta_rule_head(x + t0 * width, width, kh * dk, (num_k_heads + kh) * dk,
                      2 * num_k_heads * dk + h * dv, gp + t0 * hv + h, bp + t0 * hv + h, hv,
                      sp + (slot[s] * hv + h) * dk * dv, op + (t0 * hv + h) * dv, hv * dv,
                      loc[s + 1] - t0, dk, dv, scratch.data());
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(hybridllm, CPU, m) {
  m.impl("gdn_conv1d", &gdn_conv1d);
  m.impl("gdn_recurrent", &gdn_recurrent);
}
