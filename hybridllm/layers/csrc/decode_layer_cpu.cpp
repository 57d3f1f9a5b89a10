// One Llama-family decoder layer of a decode step in one native call: input RMSNorm (with the
// residual add), qkv from GGUF blocks (+ bias, + Qwen3's per-head q/k RMSNorm), rotary, KV cache
// write, paged decode attention, o-proj, post-attention RMSNorm, and, for a dense layer, gate/up,
// SiLU gate and down (an MoE layer returns the normed input of its expert block instead). qkv
// and gate/up come as one tensor of blocks, or one a shard where their block types differ (as
// the v of Q4_K_M files often does).
// Each piece is this library's own op
// (called through the dispatcher, so every check and kernel is the per-op path's: the result is
// bit for bit the same); what goes away is Python: ~12 module calls and ~10 op dispatches a
// layer, measured at ~90 us a layer on a 2-core EPYC, as long as SmolLM2's linears take.
// Registered as hybridllm::decode_layer; built on first use by hybridllm/layers/cpu_kernels.py.
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "library_ops.h"

namespace {

using hybridllm_ops::find_op;
using hybridllm_ops::gguf_linear;
using hybridllm_ops::silu_and_mul;

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  static const auto op =
      find_op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("hybridllm::rms_norm");
  return op.call(x, weight, eps);
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  static const auto op =
      find_op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                 const at::Tensor&, double)>(
          "hybridllm::add_rms_norm");
  return op.call(x, residual, weight, eps);
}

// x times the rows of each shard's blocks, side by side: [n, sum of the shards' rows]
at::Tensor sharded_linear(const at::Tensor& x, at::TensorList weights, at::IntArrayRef types,
                          int64_t activations, const char* what) {
  TORCH_CHECK(!weights.empty() && weights.size() == types.size(), "decode_layer: ", what, " has ",
              weights.size(), " weight shards and ", types.size(), " block types");
  if (weights.size() == 1) return gguf_linear(x, weights[0], types[0], activations);
  std::vector<at::Tensor> parts;
  parts.reserve(weights.size());
  for (size_t i = 0; i < weights.size(); ++i)
    parts.push_back(gguf_linear(x, weights[i], types[i], activations));
  return at::cat(parts, 1);
}

int64_t total_rows(at::TensorList weights) {
  int64_t rows = 0;
  for (const at::Tensor& w : weights) rows += w.size(0);
  return rows;
}

std::tuple<at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& hidden, const std::optional<at::Tensor>& residual,
    const at::Tensor& input_norm, const at::Tensor& post_norm, double eps,
    at::TensorList qkv_weights, at::IntArrayRef qkv_types,
    const std::optional<at::Tensor>& qkv_bias,
    const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
    const at::Tensor& o_weight, int64_t o_type, at::TensorList gate_up_weights,
    at::IntArrayRef gate_up_types, const std::optional<at::Tensor>& down_weight, int64_t down_type,
    const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kv_cache,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    double scale, int64_t window, int64_t num_heads, int64_t num_kv_heads, int64_t activations) {
  static const auto rotary =
      find_op<void(at::Tensor&, const at::Tensor&, const at::Tensor&)>(
          "hybridllm::rotary_embedding_");
  static const auto write_kv =
      find_op<void(const at::Tensor&, const at::Tensor&, at::Tensor&, const at::Tensor&)>(
          "hybridllm::write_kv_cache");
  static const auto attention =
      find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, double, int64_t, double,
                         const std::optional<at::Tensor>&)>("hybridllm::paged_decode_attention");

  TORCH_CHECK(hidden.dim() == 2, "decode_layer: hidden must be [tokens, hidden], got ",
              hidden.sizes());
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "decode_layer: num_heads ", num_heads, " must be a multiple of num_kv_heads ",
              num_kv_heads);
  const int64_t n = hidden.size(0);
  const int64_t head_dim = kv_cache.size(-1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  TORCH_CHECK(total_rows(qkv_weights) == q_size + 2 * kv_size, "decode_layer: qkv has ",
              total_rows(qkv_weights), " rows, expected ", q_size + 2 * kv_size);

  at::Tensor normed, res;
  if (residual.has_value()) {
    std::tie(normed, res) = add_rms_norm(hidden, *residual, input_norm, eps);
  } else {
    res = hidden;
    normed = rms_norm(hidden, input_norm, eps);
  }
  at::Tensor qkv =
      sharded_linear(normed, qkv_weights, qkv_types, activations, "qkv");  // [n, q + 2 kv]
  if (qkv_bias.has_value()) qkv.add_(*qkv_bias);
  at::Tensor q = qkv.narrow(1, 0, q_size).view({n, num_heads, head_dim});
  at::Tensor k = qkv.narrow(1, q_size, kv_size).view({n, num_kv_heads, head_dim});
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({n, num_kv_heads, head_dim});
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(),
              "decode_layer: q_norm and k_norm come together");
  if (q_norm.has_value()) {
    q = rms_norm(q, *q_norm, eps);  // Qwen3's per-head norms: views into qkv's output
    k = rms_norm(k, *k_norm, eps);
    rotary.call(q, cos, sin);
    rotary.call(k, cos, sin);
  } else {
    // q and k are adjacent: one rotation over both sets of heads, in place
    at::Tensor qk =
        qkv.narrow(1, 0, q_size + kv_size).view({n, num_heads + num_kv_heads, head_dim});
    rotary.call(qk, cos, sin);
  }
  write_kv.call(k, v, kv_cache, slot_mapping);
  // no soft-capping, no sinks: native_layer leaves layers with either to Python
  const at::Tensor attn =
      attention.call(q.contiguous(), kv_cache, block_tables, seq_lens, scale, window, 0.0,
                     std::nullopt);
  const at::Tensor o = gguf_linear(attn.view({n, q_size}), o_weight, o_type, activations);
  std::tie(normed, res) = add_rms_norm(o, res, post_norm, eps);
  TORCH_CHECK(gate_up_weights.empty() != down_weight.has_value(),
              "decode_layer: gate_up_weights and down_weight come together");
  if (!down_weight.has_value()) return {normed, res};  // the caller's expert block next
  const at::Tensor gate_up =
      sharded_linear(normed, gate_up_weights, gate_up_types, activations, "gate_up");
  const at::Tensor out = gguf_linear(silu_and_mul(gate_up), *down_weight, down_type, activations);
  return {out, res};
}

}  // namespace

TORCH_LIBRARY_IMPL(hybridllm, CPU, m) {
  m.impl("decode_layer", &decode_layer);
}
