// This library's own ops called from another of its ops, through the dispatcher: they live in
// their own translation units, and the call keeps their checks. Each looks its op up once.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>

namespace hybridllm_ops {

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// hybridllm::gguf_linear: x [M, K] against qweight's rows [N, bytes] -> [M, N]
inline at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& qweight, int64_t type,
                              int64_t activations) {
  static const auto op = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t,
                                            int64_t, int64_t)>("hybridllm::gguf_linear");
  return op.call(x, qweight, type, qweight.size(0), activations);
}

inline at::Tensor silu_and_mul(const at::Tensor& x) {
  static const auto op = find_op<at::Tensor(const at::Tensor&)>("hybridllm::silu_and_mul");
  return op.call(x);
}

}  // namespace hybridllm_ops
