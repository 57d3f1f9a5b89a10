// torch.classes.hybridllm.DecodeStack (decode_stack_cpu.cpp): a model's run of native decoder
// layers in one call from Python. Declared here for its registration in torch_bindings.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace hybridllm_ops {

// An MoE layer's expert block: router weight (blocks, or fp32 as F32 blocks) and the experts.
struct MoeArgs {
  at::Tensor router;
  int64_t router_type, top_k;
  bool sigmoid, renormalize;
  at::Tensor w13;
  int64_t w13_type;
  at::Tensor w2;
  int64_t w2_type;
};

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
  std::optional<MoeArgs> moe;  // the layer's expert block, where decode_layer returns its input
};

struct DecodeStack : torch::CustomClassHolder {
  std::vector<LayerArgs> layers;

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, double eps,
                 std::vector<at::Tensor> qkv_weights, std::vector<int64_t> qkv_types,
                 std::optional<at::Tensor> qkv_bias, std::optional<at::Tensor> q_norm,
                 std::optional<at::Tensor> k_norm, at::Tensor o_weight, int64_t o_type,
                 std::vector<at::Tensor> gate_up_weights, std::vector<int64_t> gate_up_types,
                 std::optional<at::Tensor> down_weight, int64_t down_type, double scale,
                 int64_t window, int64_t num_heads, int64_t num_kv_heads, int64_t activations);

  // The last added layer's expert block (that layer has no gate/up and down of its own).
  void add_moe(at::Tensor router, int64_t router_type, int64_t top_k, bool sigmoid,
               bool renormalize, at::Tensor w13, int64_t w13_type, at::Tensor w2,
               int64_t w2_type);

  int64_t size() const { return static_cast<int64_t>(layers.size()); }

  // Every layer on a decode step: (output, residual) of the last, as decode_layer returns them.
  // kv_caches: one a layer, in order.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor hidden, std::optional<at::Tensor> residual,
                                             at::Tensor cos, at::Tensor sin,
                                             std::vector<at::Tensor> kv_caches,
                                             at::Tensor slot_mapping, at::Tensor block_tables,
                                             at::Tensor seq_lens);
};

}  // namespace hybridllm_ops
