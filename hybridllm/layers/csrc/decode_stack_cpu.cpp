// A model's run of native decoder layers in one call from Python: torch.classes.hybridllm.
// DecodeStack holds each layer's step-invariant arguments of hybridllm::decode_layer (weights,
// block types, norms, attention sizes), given once with add_layer; forward runs the layers one
// after the other through that op, so the result is bit for bit the per-layer calls'. What goes
// away is Python between layers (a loop, a method frame and 27 arguments parsed a layer): SmolLM2
// at batch 1 decoded 229.7-234.9 tok/s with one call against 206.8-225.8 with a call a layer.
// An MoE layer (add_moe after its add_layer: router, routing, routed experts, no shared expert)
// runs its expert block through the ops its Python runs (gguf_linear for the router logits,
// route_experts, fused_moe), so it too is bit for bit the per-layer path.
// The class is declared in decode_stack.h and registered in torch_bindings.cpp; built on first use
// by hybridllm/layers/cpu_kernels.py.
#include "decode_stack.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "library_ops.h"

namespace hybridllm_ops {

namespace {

// hybridllm::decode_layer's signature, for its dispatcher handle
using DecodeLayerOp = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
    double, at::TensorList, at::IntArrayRef, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, const at::Tensor&, int64_t,
    at::TensorList, at::IntArrayRef, const std::optional<at::Tensor>&, int64_t, const at::Tensor&,
    const at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
    int64_t, int64_t, int64_t, int64_t);

}  // namespace

void DecodeStack::add_layer(at::Tensor input_norm, at::Tensor post_norm, double eps,
                            std::vector<at::Tensor> qkv_weights, std::vector<int64_t> qkv_types,
                            std::optional<at::Tensor> qkv_bias, std::optional<at::Tensor> q_norm,
                            std::optional<at::Tensor> k_norm, at::Tensor o_weight,
                            int64_t o_type, std::vector<at::Tensor> gate_up_weights,
                            std::vector<int64_t> gate_up_types,
                            std::optional<at::Tensor> down_weight, int64_t down_type,
                            double scale, int64_t window, int64_t num_heads,
                            int64_t num_kv_heads, int64_t activations) {
  layers.push_back({std::move(input_norm), std::move(post_norm), eps, std::move(qkv_weights),
                    std::move(qkv_types), std::move(qkv_bias), std::move(q_norm),
                    std::move(k_norm), std::move(o_weight), o_type, std::move(gate_up_weights),
                    std::move(gate_up_types), std::move(down_weight), down_type, scale, window,
                    num_heads, num_kv_heads, activations, std::nullopt});
}

void DecodeStack::add_moe(at::Tensor router, int64_t router_type, int64_t top_k, bool sigmoid,
                          bool renormalize, at::Tensor w13, int64_t w13_type, at::Tensor w2,
                          int64_t w2_type) {
  TORCH_CHECK(!layers.empty() && !layers.back().down_weight.has_value() &&
                  !layers.back().moe.has_value(),
              "DecodeStack: add_moe follows the add_layer of a layer without an MLP of its own");
  layers.back().moe = MoeArgs{std::move(router), router_type, top_k, sigmoid, renormalize,
                              std::move(w13), w13_type, std::move(w2), w2_type};
}

std::tuple<at::Tensor, at::Tensor> DecodeStack::forward(
    at::Tensor hidden, std::optional<at::Tensor> residual, at::Tensor cos, at::Tensor sin,
    std::vector<at::Tensor> kv_caches, at::Tensor slot_mapping, at::Tensor block_tables,
    at::Tensor seq_lens) {
  static const auto op = find_op<DecodeLayerOp>("hybridllm::decode_layer");
  static const auto route = find_op<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, int64_t, bool, bool)>("hybridllm::route_experts");
  static const auto experts =
      find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, int64_t, const at::Tensor&, int64_t, int64_t,
                         const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                         int64_t, double, double)>("hybridllm::fused_moe");
  TORCH_CHECK(kv_caches.size() == layers.size(), "DecodeStack: ", layers.size(),
              " layers but ", kv_caches.size(), " KV caches");
  for (size_t i = 0; i < layers.size(); ++i) {
    const LayerArgs& l = layers[i];
    std::tie(hidden, residual) =
        op.call(hidden, residual, l.input_norm, l.post_norm, l.eps, l.qkv_weights, l.qkv_types,
                l.qkv_bias, l.q_norm, l.k_norm, l.o_weight, l.o_type, l.gate_up_weights,
                l.gate_up_types, l.down_weight, l.down_type, cos, sin, kv_caches[i],
                slot_mapping, block_tables, seq_lens, l.scale, l.window, l.num_heads,
                l.num_kv_heads, l.activations);
    if (l.moe.has_value()) {  // hidden is the expert block's normed input [n, hidden]
      const MoeArgs& m = *l.moe;
      const at::Tensor logits = hybridllm_ops::gguf_linear(hidden, m.router, m.router_type,
                                                           l.activations);  // [n, E]
      const auto [weights, ids] = route.call(logits, m.top_k, m.sigmoid, m.renormalize);
      // SiLU without biases: the stack takes only such layers (models/native_decode.py)
      hidden = experts.call(hidden, weights, ids, m.w13, m.w13_type, m.w2, m.w2_type,
                            l.activations, std::nullopt, std::nullopt, 0, 1.702, 7.0);
    }
  }
  TORCH_CHECK(residual.has_value(), "DecodeStack: no layers");
  return {hidden, *residual};
}

}  // namespace hybridllm_ops
