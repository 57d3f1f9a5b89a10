// The routed experts of an MoE layer in one native call, from GGUF blocks or fp32 weights read
// as F32 blocks (and the routing before it, route_experts): tokens grouped by expert (a counting
// sort), each selected expert's gate/up and down computed once for all its tokens by
// hybridllm::gguf_linear, the gate fused (SiLU, GELU-tanh, or gpt-oss's clamped swigluoai, with
// optional per-expert biases), and the results added into each token's output with its routing
// weight, in fp32. The Python loop it replaces cost ~50 us an expert in
// dispatch and slicing, a third of a Qwen3-30B-A3B layer's decode step on 2 cores. Registered as
// hybridllm::fused_moe; built on first use by hybridllm/layers/cpu_kernels.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "gguf_blocks.h"
#include "gguf_q8_linear.h"
#include "gguf_x8.h"
#include "library_ops.h"
#include "vec_math.h"

namespace {

using hybridllm_gguf::is_float_type;
using hybridllm_gguf::is_x8_type;
using hybridllm_gguf::kFp32Activations;
using hybridllm_gguf::kQ8Avx512Vnni;
using hybridllm_gguf::int8_gemm_min_rows;
using hybridllm_gguf::kX8GroupRows;
using hybridllm_gguf::q8_linear_grouped;
using hybridllm_ops::gguf_linear;
using hybridllm_ops::silu_and_mul;

// What gguf_linear checks of a weight, for the experts computed together without it: uint8
// [E, N, bytes] rows of blocks of `type` for K inputs, each expert's rows dense.
void check_int8_experts(const at::Tensor& w, int64_t type, int64_t K, const char* name) {
  using namespace hybridllm_gguf;
  TORCH_CHECK(w.scalar_type() == at::kByte && supported_type(type),
              "fused_moe: ", name, " must be uint8 blocks of a supported ggml_type, got ",
              w.scalar_type(), " and type ", type);
  TORCH_CHECK(K % row_granule(type) == 0 && w.size(2) == row_bytes_of(type, K) &&
                  w.stride(2) == 1 && w.stride(1) == w.size(2),
              "fused_moe: ", name, " ", w.sizes(), " is not dense rows of ", row_bytes_of(type, K),
              " bytes (", K, " inputs of ggml_type ", type, ")");
  TORCH_CHECK(!is_x8_type(type) || w.size(1) % kX8GroupRows == 0, "fused_moe: ", name,
              " holds x8 groups (ggml_type ", type, "): its ", w.size(1),
              " rows an expert are not a multiple of ", kX8GroupRows);
}

// The gated activation, fused_moe's `act` (layers/fused_moe.py's NATIVE_ACTIVATIONS).
enum ExpertAct : int64_t { kSiluAct = 0, kGeluTanhAct = 1, kSwigluOaiAct = 2 };

// One expert's rows of gate_up [count, 2 * width] (gate | up) -> out [count, width]: the
// expert's gate/up bias (bias13 [2 * width], or null) added first, then
//   silu:      silu(g) * u
//   gelu_tanh: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) * u
//   swigluoai: g = min(g, limit), u = clamp(u, -limit, limit): g sigmoid(alpha g) (u + 1).
void gated_rows(const float* gate_up, int64_t count, int64_t width, const float* bias13,
                int64_t act, float alpha, float limit, float* out) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1));
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = gate_up + r * 2 * width;
      const float* up = gate + width;
      float* o = out + r * width;
      for (int64_t j = 0; j < width; ++j) {
        float g = gate[j], u = up[j];
        if (bias13 != nullptr) {
          g += bias13[j];
          u += bias13[width + j];
        }
        if (act == kSwigluOaiAct) {
          g = std::min(g, limit);
          u = std::min(std::max(u, -limit), limit);
          const float z = alpha * g;
          const float e = hybridllm_math::exp_nonpositive(-std::fabs(z));
          const float sigmoid = (z >= 0.f ? 1.f : e) / (1.f + e);
          o[j] = g * sigmoid * (u + 1.f);
        } else if (act == kGeluTanhAct) {
          const float inner = 0.7978845608f * (g + 0.044715f * g * g * g);
          o[j] = 0.5f * g * (1.f + std::tanh(inner)) * u;
        } else {
          o[j] = hybridllm_math::silu(g) * u;
        }
      }
    }
  });
}

// Each token's top_k experts from its router logits [n, E]: softmax (or each logit's sigmoid)
// in fp32, the best first (ties to the lower id), weights renormalised to sum 1 or not. Returns
// (weights [n, k] float32, ids [n, k] int64), what moe_routing.select_experts gives, in one call
// instead of its five ops (~40 us a layer at one token).
std::tuple<at::Tensor, at::Tensor> route_experts(const at::Tensor& router_logits, int64_t top_k,
                                                 bool sigmoid, bool renormalize) {
  TORCH_CHECK(router_logits.device().is_cpu() && router_logits.dim() == 2,
              "route_experts: router_logits must be a 2-D CPU tensor [tokens, experts], got ",
              router_logits.sizes(), " on ", router_logits.device());
  const at::Tensor logits = router_logits.to(at::kFloat).contiguous();
  const int64_t n = logits.size(0), experts = logits.size(1);
  TORCH_CHECK(top_k >= 1 && top_k <= experts, "route_experts: top_k ", top_k,
              " must be in [1, ", experts, "] (the number of experts)");
  at::Tensor weights = at::empty({n, top_k}, logits.options());
  at::Tensor ids = at::empty({n, top_k}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  float* wp = weights.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(experts);
    for (int64_t t = begin; t < end; ++t) {
      const float* row = lp + t * experts;
      if (sigmoid) {
        for (int64_t e = 0; e < experts; ++e) scores[e] = 1.0f / (1.0f + std::exp(-row[e]));
      } else {
        float top = row[0], sum = 0.0f;
        for (int64_t e = 1; e < experts; ++e) top = std::max(top, row[e]);
        for (int64_t e = 0; e < experts; ++e) sum += scores[e] = std::exp(row[e] - top);
        for (int64_t e = 0; e < experts; ++e) scores[e] /= sum;
      }
      float chosen = 0.0f;
      for (int64_t j = 0; j < top_k; ++j) {  // k passes: k <= E and k is small (1-8)
        int64_t best = -1;
        for (int64_t e = 0; e < experts; ++e)
          if (scores[e] >= 0.0f && (best < 0 || scores[e] > scores[best])) best = e;
        ip[t * top_k + j] = best;
        wp[t * top_k + j] = scores[best];
        chosen += scores[best];
        scores[best] = -1.0f;  // taken (scores are >= 0)
      }
      if (renormalize)
        for (int64_t j = 0; j < top_k; ++j) wp[t * top_k + j] /= chosen;
    }
  });
  return {weights, ids};
}

at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& topk_weights,
                     const at::Tensor& topk_ids, const at::Tensor& w13, int64_t w13_type,
                     const at::Tensor& w2, int64_t w2_type, int64_t activations,
                     const std::optional<at::Tensor>& w13_bias,
                     const std::optional<at::Tensor>& w2_bias, int64_t act, double alpha,
                     double limit) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "fused_moe: x must be a 2-D float32 CPU tensor [tokens, hidden], got ",
              x.scalar_type(), " ", x.sizes(), " on ", x.device());
  const int64_t n = x.size(0), hidden = x.size(1);
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong && topk_ids.dim() == 2 &&
                  topk_ids.size(0) == n,
              "fused_moe: topk_ids must be int64 [", n, ", top_k], got ", topk_ids.scalar_type(),
              " ", topk_ids.sizes());
  const int64_t top_k = topk_ids.size(1);
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat &&
                  topk_weights.sizes() == topk_ids.sizes(),
              "fused_moe: topk_weights must be float32 ", topk_ids.sizes(), ", got ",
              topk_weights.scalar_type(), " ", topk_weights.sizes());
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.size(0) == w2.size(0) &&
                  w2.size(1) == hidden && w13.size(1) % 2 == 0,
              "fused_moe: w13 must be [E, 2 * I, bytes] and w2 [E, ", hidden,
              ", bytes], got ", w13.sizes(), " and ", w2.sizes());
  const int64_t experts = w13.size(0), width2 = w13.size(1);
  TORCH_CHECK(act == kSiluAct || act == kGeluTanhAct || act == kSwigluOaiAct,
              "fused_moe: act must be 0 (silu), 1 (gelu_tanh) or 2 (swigluoai), got ", act);
  // the biases: float32 [E, 2I] (gate | up, as w13's rows) and [E, H], or none
  const auto bias_of = [&](const std::optional<at::Tensor>& bias, int64_t width,
                           const char* name) -> at::Tensor {
    if (!bias.has_value()) return at::Tensor();
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat &&
                    bias->dim() == 2 && bias->size(0) == experts && bias->size(1) == width,
                "fused_moe: ", name, " must be a float32 CPU tensor [", experts, ", ", width,
                "], got ", bias->scalar_type(), " ", bias->sizes(), " on ", bias->device());
    return bias->contiguous();
  };
  const at::Tensor b13 = bias_of(w13_bias, width2, "w13_bias");
  const at::Tensor b2 = bias_of(w2_bias, hidden, "w2_bias");
  const float* b13p = b13.defined() ? b13.data_ptr<float>() : nullptr;
  const float* b2p = b2.defined() ? b2.data_ptr<float>() : nullptr;
  // SiLU without a bias: the compiled silu_and_mul, bit for bit what the op computed before
  const bool plain_silu = act == kSiluAct && b13p == nullptr;
  const auto activate = [&](const at::Tensor& gate_up, int64_t e) -> at::Tensor {
    if (plain_silu) return silu_and_mul(gate_up);
    at::Tensor out = at::empty({gate_up.size(0), width2 / 2}, gate_up.options());
    gated_rows(gate_up.data_ptr<float>(), gate_up.size(0), width2 / 2,
               b13p != nullptr ? b13p + e * width2 : nullptr, act, static_cast<float>(alpha),
               static_cast<float>(limit), out.data_ptr<float>());
    return out;
  };
  const at::Tensor ids = topk_ids.contiguous(), weights = topk_weights.contiguous();
  const at::Tensor xc = x.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t pairs = n * top_k;

  // counting sort of the (token, slot) pairs by expert, stable so each expert's tokens keep
  // their order: grouped[p] is the p-th pair in expert order
  std::vector<int64_t> offsets(experts + 1, 0), grouped(pairs);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < experts, "fused_moe: expert id ", id[p],
                " out of range [0, ", experts, ")");
    ++offsets[id[p] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) offsets[e + 1] += offsets[e];
  std::vector<int64_t> next(offsets.begin(), offsets.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) grouped[next[id[p]]++] = p;

  // Each active expert once over its rows: gathered [count, H] -> [count, 2I] -> silu-gated
  // [count, I] -> [count, H], added into its tokens' outputs with their weights, experts in
  // order. Experts with few rows (what gguf_linear gives its few-rows int8 kernels) are
  // computed together first, gate/up of all of them in one parallel region and down in
  // another: two gguf_linear calls an expert, 16 short parallel regions and weight streams a
  // layer at one token, took 10-20% longer (Qwen3-30B-A3B's shape, 2 threads).
  const bool int8 = activations != kFp32Activations && !is_float_type(w13_type) &&
                    !is_float_type(w2_type);
  if (int8) {
    check_int8_experts(w13, w13_type, hidden, "w13");
    check_int8_experts(w2, w2_type, width2 / 2, "w2");
  }
  // an expert's rows from which its two products take the int8 GEMM
  const int64_t gemm_rows = std::min(int8_gemm_min_rows(w13_type), int8_gemm_min_rows(w2_type));
  auto few_rows = [&](int64_t count) {
    return int8 && (count < gemm_rows || activations > kQ8Avx512Vnni);
  };
  std::vector<int64_t> small_starts{0};  // rows of the experts computed together, in order
  std::vector<const uint8_t*> small_w13, small_w2;
  std::vector<int64_t> small_ids;  // their expert ids
  int64_t most_large = 0;  // the largest group of the experts computed one at a time
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t count = offsets[e + 1] - offsets[e];
    if (count == 0) continue;
    if (!few_rows(count)) {
      most_large = std::max(most_large, count);
      continue;
    }
    small_starts.push_back(small_starts.back() + count);
    small_w13.push_back(w13[e].data_ptr<uint8_t>());
    small_w2.push_back(w2[e].data_ptr<uint8_t>());
    small_ids.push_back(e);
  }
  const int64_t small_rows = small_starts.back(), small_experts = small_w13.size();
  // The gather buffer is the calling thread's, kept from call to call: buffers of all n * k
  // rows, fresh each call, cost more in page faults than the experts' GEMMs in a 2048-token
  // prefill chunk (2 x 134 MB at Qwen3-30B-A3B's shape).
  thread_local std::vector<float> gather_buffer;
  const int64_t gather_rows = std::max(small_rows, most_large);
  if (gather_buffer.size() < static_cast<size_t>(gather_rows * hidden))
    gather_buffer.resize(gather_rows * hidden);
  at::Tensor out = at::zeros({n, hidden}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const float* wt = weights.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // rows a thread takes: serial for decode-sized groups
  const int64_t grain = std::max<int64_t>(1, 16384 / hidden);
  // rows [start, start + count) of `grouped` (an expert's pairs) into rows
  auto gather = [&](int64_t start, int64_t count, float* rows) {
    at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
      for (int64_t q = begin; q < end; ++q)
        std::memcpy(rows + q * hidden, xp + (grouped[start + q] / top_k) * hidden,
                    hidden * sizeof(float));
    });
  };
  at::Tensor small_down;
  if (small_experts > 0) {
    float* rows = gather_buffer.data();
    for (int64_t e = 0, g = 0; e < experts; ++e) {
      const int64_t count = offsets[e + 1] - offsets[e];
      if (count > 0 && few_rows(count))
        gather(offsets[e], count, rows + small_starts[g++] * hidden);
    }
    at::Tensor gate_up = at::empty({small_rows, width2}, xc.options());
    q8_linear_grouped(w13_type, activations, rows, small_starts.data(), small_experts, hidden,
                      small_w13.data(), width2, gate_up.data_ptr<float>());
    at::Tensor gated;
    if (plain_silu) {
      gated = silu_and_mul(gate_up);
    } else {
      gated = at::empty({small_rows, width2 / 2}, xc.options());
      for (int64_t g = 0; g < small_experts; ++g) {
        const int64_t first = small_starts[g], e = small_ids[g];
        gated_rows(gate_up.data_ptr<float>() + first * width2, small_starts[g + 1] - first,
                   width2 / 2, b13p != nullptr ? b13p + e * width2 : nullptr, act,
                   static_cast<float>(alpha), static_cast<float>(limit),
                   gated.data_ptr<float>() + first * (width2 / 2));
      }
    }
    small_down = at::empty({small_rows, hidden}, xc.options());
    q8_linear_grouped(w2_type, activations, gated.data_ptr<float>(), small_starts.data(),
                      small_experts, width2 / 2, small_w2.data(), hidden,
                      small_down.data_ptr<float>());
  }
  for (int64_t e = 0, g = 0; e < experts; ++e) {
    const int64_t start = offsets[e], count = offsets[e + 1] - start;
    if (count == 0) continue;
    const float* dp;
    at::Tensor down;
    if (few_rows(count)) {
      dp = small_down.data_ptr<float>() + small_starts[g++] * hidden;
    } else {
      float* rows = gather_buffer.data();
      gather(start, count, rows);
      const at::Tensor gate_up = gguf_linear(at::from_blob(rows, {count, hidden}, xc.options()),
                                             w13[e], w13_type, activations);
      down = gguf_linear(activate(gate_up, e), w2[e], w2_type, activations).contiguous();
      dp = down.data_ptr<float>();
    }
    // a token meets an expert at most once: the rows of one group are distinct tokens
    const float* bias2 = b2p != nullptr ? b2p + e * hidden : nullptr;
    at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
      for (int64_t q = begin; q < end; ++q) {
        const int64_t pair = grouped[start + q];
        float* o = op + (pair / top_k) * hidden;
        const float* src = dp + q * hidden;
        const float w = wt[pair];
        if (bias2 != nullptr) {
#pragma omp simd
          for (int64_t h = 0; h < hidden; ++h) o[h] += w * (src[h] + bias2[h]);
        } else {
#pragma omp simd
          for (int64_t h = 0; h < hidden; ++h) o[h] += w * src[h];
        }
      }
    });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(hybridllm, CPU, m) {
  m.impl("fused_moe", &fused_moe);
  m.impl("route_experts", &route_experts);
}
