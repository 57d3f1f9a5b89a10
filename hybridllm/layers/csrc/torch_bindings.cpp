// Every op schema and class of torch.ops.hybridllm / torch.classes.hybridllm, in one place, a
// section for each source file (in cpu_kernels.py's SOURCES order). The kernels register their
// implementations next to their code: TORCH_LIBRARY_IMPL(hybridllm, CPU, m) in each file, and
// CompositeImplicitAutograd for the ops without a tensor argument (what a kernel given to m.def
// registers), which have no backend to dispatch on.
// Built on first use by hybridllm/layers/cpu_kernels.py.
#include <torch/custom_class.h>
#include <torch/library.h>

#include "decode_stack.h"

TORCH_LIBRARY(hybridllm, m) {
  // --- paged_decode_cpu.cpp
  // softcap: Gemma 2's attention logit soft-capping (scores -> softcap * tanh(scores / softcap)
  // before the softmax), 0 for none; sinks: gpt-oss's per-head sink logits, fp32 [num_heads]
  m.def(
      "paged_decode_attention(Tensor query, Tensor kv_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, int window, float softcap=0., Tensor? sinks=None) "
      "-> Tensor");

  // --- mla_decode_cpu.cpp
  // DeepSeek MLA decode, absorbed form: query [B, H, D] float32 against the latent cache
  // [num_blocks, block_size, D] (rows [c_kv | k_pe], D = latent_dim + rope_dim) -> [B, H,
  // latent_dim] float32, the values being each row's first latent_dim entries
  m.def(
      "mla_decode_attention(Tensor query, Tensor kv_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, int latent_dim) -> Tensor");

  // --- gguf_linear_cpu.cpp (int8 activations: gguf_q8_linear_cpu.cpp, gguf_q8_gemm_cpu.cpp)
  // activations: 0 computes in fp32; 1 quantizes x to int8 for integer dot products (the
  // few-rows kernels, the int8 GEMM for many rows; 2-5 pick one path, for tests: gguf_q8_linear.h)
  m.def(
      "gguf_linear(Tensor x, Tensor qweight, int ggml_type, int out_features, int activations=0) "
      "-> Tensor");
  // The integer paths (the activations values above) this build has, best first.
  m.def("gguf_int8_paths() -> int[]");
  // Whether this CPU's BLAS (MKL) runs AVX-512 sgemm kernels; where not, CPU workers send their
  // fp32 linears through gguf_linear (type F32) too.
  m.def("blas_has_avx512_kernels() -> bool");

  // --- gguf_dequantize_cpu.cpp
  // Weight rows [rows, in_features / 32 * block_bytes] uint8 of a block type -> float [rows,
  // in_features], as gguf.quants.dequantize decodes them.
  m.def("gguf_dequantize(Tensor blocks, int ggml_type, int in_features) -> Tensor");

  // --- gguf_x8_cpu.cpp
  // Q4_K / Q5_K / Q6_K blocks (ggml_type 12 / 13 / 14) [..., rows, K / 256 * 144, 176 or 210]
  // (rows % 8 == 0) -> the x8 layout [..., rows, K / 256 * 148, 180 or 210] that gguf_linear
  // and fused_moe take as ggml_type 112 / 113 / 114; unpack_x8 is its inverse (ggml_type: the
  // source type).
  m.def("repack_x8(Tensor blocks, int ggml_type) -> Tensor");
  m.def("unpack_x8(Tensor blocks, int ggml_type) -> Tensor");
  // The ggml_types this build computes in x8 groups, and so repacks at load: every type with an
  // x8 form where the CPU has AVX512-VNNI, Q4_K, Q5_K and Q6_K on AVX2 alone, none else.
  m.def("x8_source_types() -> int[]");

  // --- rms_norm_cpu.cpp
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");

  // --- activation_cpu.cpp
  m.def("silu_and_mul(Tensor x) -> Tensor");

  // --- argmax_cpu.cpp
  m.def("argmax_rows(Tensor x) -> Tensor");

  // --- rotary_cpu.cpp
  m.def("rotary_embedding_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");

  // --- kv_cache_write_cpu.cpp
  m.def("write_kv_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");

  // --- fused_moe_cpu.cpp
  m.def(
      "fused_moe(Tensor x, Tensor topk_weights, Tensor topk_ids, Tensor w13, int w13_type, "
      "Tensor w2, int w2_type, int activations=0, Tensor? w13_bias=None, Tensor? w2_bias=None, "
      "int act=0, float alpha=1.702, float limit=7.0) -> Tensor");
  m.def(
      "route_experts(Tensor router_logits, int top_k, bool sigmoid, bool renormalize) "
      "-> (Tensor, Tensor)");

  // --- decode_layer_cpu.cpp
  m.def(
      "decode_layer(Tensor hidden, Tensor? residual, Tensor input_norm, Tensor post_norm, "
      "float eps, Tensor[] qkv_weights, int[] qkv_types, Tensor? qkv_bias, Tensor? q_norm, "
      "Tensor? k_norm, Tensor o_weight, int o_type, Tensor[] gate_up_weights, int[] gate_up_types, "
      "Tensor? down_weight, int down_type, "
      "Tensor cos, Tensor sin, Tensor(a!) kv_cache, Tensor slot_mapping, Tensor block_tables, "
      "Tensor seq_lens, float scale, int window, int num_heads, int num_kv_heads, "
      "int activations) -> (Tensor, Tensor)");

  // --- decode_stack_cpu.cpp (decode_stack.h): torch.classes.hybridllm.DecodeStack
  using hybridllm_ops::DecodeStack;
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("add_moe", &DecodeStack::add_moe)
      .def("size", &DecodeStack::size)
      .def("forward", &DecodeStack::forward);

  // --- prefill_attention_cpu.cpp
  // softcap and sinks as paged_decode_attention's
  m.def(
      "prefill_attention(Tensor query, Tensor key, Tensor value, float scale, int window, "
      "float softcap=0., Tensor? sinks=None) -> Tensor");

  // --- gguf_head_linear_cpu.cpp
  // x [B, H, in] float32 against H matrices qweight [H, out_features, bytes] (each as
  // gguf_linear's qweight) -> [B, H, out_features]: out[b, h] = W[h] x[b, h]; activations as
  // gguf_linear's
  m.def(
      "gguf_head_linear(Tensor x, Tensor qweight, int ggml_type, int out_features, "
      "int activations=0) -> Tensor");

  // --- gated_delta_net_cpu.cpp
  // Gated DeltaNet over a flattened batch: sequence s owns rows [query_start_loc[s],
  // query_start_loc[s+1]) and state slot slots[s] (int64). gdn_conv1d: x [T, C] fp32 ->
  // silu(causal depthwise conv) [T, C], conv_state [slots, C, K-1] fp32 updated in place (fresh:
  // bool [num_seqs], start from zeros); weight [C, K]. gdn_recurrent: qkv [T, 2 Hk Dk + Hv Dv],
  // g, beta [T, Hv] fp32 -> [T, Hv, Dv] fp32, state [slots, Hv, Dk, Dv] fp32 updated in place.
  m.def(
      "gdn_conv1d(Tensor x, Tensor(a!) conv_state, Tensor weight, Tensor query_start_loc, "
      "Tensor fresh, Tensor slots) -> Tensor");
  m.def(
      "gdn_recurrent(Tensor qkv, Tensor g, Tensor beta, Tensor(a!) state, "
      "Tensor query_start_loc, Tensor slots, int num_k_heads) -> Tensor");
}
