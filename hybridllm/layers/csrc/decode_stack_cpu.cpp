// A model's run of native decoder layers in one call from Python: torch.classes.hybridllm.
// DecodeStack holds each layer's step-invariant arguments of hybridllm::decode_layer (weights,
// block types, norms, attention sizes), given once with add_layer; forward runs the layers one
// after the other through that op, so the result is bit for bit the per-layer calls'. What goes
// away is Python between layers (a loop, a method frame and 27 arguments parsed a layer): SmolLM2
// at batch 1 decoded 229.7-234.9 tok/s with one call against 206.8-225.8 with a call a layer.
// Built on first use by hybridllm/layers/cpu_kernels.py.
#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "library_ops.h"

namespace {

using hybridllm_ops::find_op;

using DecodeLayerOp = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
    double, at::TensorList, at::IntArrayRef, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, const at::Tensor&, int64_t,
    at::TensorList, at::IntArrayRef, const std::optional<at::Tensor>&, int64_t, const at::Tensor&,
    const at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
    int64_t, int64_t, int64_t, int64_t);

// One layer's arguments of hybridllm::decode_layer that do not change from step to step.
struct LayerArgs {
  at::Tensor input_norm, post_norm;
  double eps;
  std::vector<at::Tensor> qkv_weights;
  std::vector<int64_t> qkv_types;
  std::optional<at::Tensor> qkv_bias, q_norm, k_norm;
  at::Tensor o_weight;
  int64_t o_type;
  std::vector<at::Tensor> gate_up_weights;
  std::vector<int64_t> gate_up_types;
  std::optional<at::Tensor> down_weight;
  int64_t down_type;
  double scale;
  int64_t window, num_heads, num_kv_heads, activations;
};

struct DecodeStack : torch::CustomClassHolder {
  std::vector<LayerArgs> layers;

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, double eps,
                 std::vector<at::Tensor> qkv_weights, std::vector<int64_t> qkv_types,
                 std::optional<at::Tensor> qkv_bias, std::optional<at::Tensor> q_norm,
                 std::optional<at::Tensor> k_norm, at::Tensor o_weight, int64_t o_type,
                 std::vector<at::Tensor> gate_up_weights, std::vector<int64_t> gate_up_types,
                 std::optional<at::Tensor> down_weight, int64_t down_type, double scale,
                 int64_t window, int64_t num_heads, int64_t num_kv_heads, int64_t activations) {
    layers.push_back({std::move(input_norm), std::move(post_norm), eps, std::move(qkv_weights),
                      std::move(qkv_types), std::move(qkv_bias), std::move(q_norm),
                      std::move(k_norm), std::move(o_weight), o_type, std::move(gate_up_weights),
                      std::move(gate_up_types), std::move(down_weight), down_type, scale, window,
                      num_heads, num_kv_heads, activations});
  }

  int64_t size() const { return static_cast<int64_t>(layers.size()); }

  // Every layer on a decode step: (output, residual) of the last, as decode_layer returns them.
  // kv_caches: one a layer, in order.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor hidden, std::optional<at::Tensor> residual,
                                             at::Tensor cos, at::Tensor sin,
                                             std::vector<at::Tensor> kv_caches,
                                             at::Tensor slot_mapping, at::Tensor block_tables,
                                             at::Tensor seq_lens) {
    static const auto op = find_op<DecodeLayerOp>("hybridllm::decode_layer");
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
    }
    TORCH_CHECK(residual.has_value(), "DecodeStack: no layers");
    return {hidden, *residual};
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(hybridllm, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("size", &DecodeStack::size)
      .def("forward", &DecodeStack::forward);
}
