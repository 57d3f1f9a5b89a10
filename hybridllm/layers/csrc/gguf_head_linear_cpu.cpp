// A per-head ("block-diagonal") linear from GGUF blocks: out[b, h] = W[h] x[b, h] for H heads,
// each head's own [out, in] matrix stored as gguf_linear stores one, all of them computed in one
// parallel region. DeepSeek's multi-head latent attention decodes in the absorbed form with two
// such products a layer (W_UK^T: 128 heads of [512, 128], W_UV: [128, 512]), which llama.cpp keeps
// in Q5_0 / Q4_K blocks; torch.bmm over their fp32 copies reads 6-7x the bytes. The kernels are
// gguf_linear's few-rows kernels (fp32_linear_grouped, q8_linear_grouped), their weight rows of
// all heads split among the threads together so that one token keeps every thread busy.
// Registered as the torch op hybridllm::gguf_head_linear; built on first use by
// hybridllm/layers/cpu_kernels.py with the other CPU kernels.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "gguf_linear.h"
#include "gguf_q8_linear.h"
#include "gguf_types.h"
#include "gguf_x8.h"

namespace {

using namespace hybridllm_gguf;

at::Tensor gguf_head_linear(const at::Tensor& x, const at::Tensor& qweight, int64_t ggml_type,
                            int64_t out_features, int64_t activations) {
  TORCH_CHECK(x.device().is_cpu() && qweight.device().is_cpu(),
              "gguf_head_linear: x and qweight must be CPU tensors, got ", x.device(), " and ",
              qweight.device());
  TORCH_CHECK(x.scalar_type() == at::kFloat, "gguf_head_linear: x must be float32, got ",
              x.scalar_type());
  TORCH_CHECK(x.dim() == 3, "gguf_head_linear: x must be 3-D [B, H, in], got ", x.dim(),
              " dims ", x.sizes());
  TORCH_CHECK(qweight.scalar_type() == at::kByte, "gguf_head_linear: qweight must be uint8, got ",
              qweight.scalar_type());
  TORCH_CHECK(supported_type(ggml_type), "gguf_head_linear: unsupported ggml_type ", ggml_type,
              " (supported: ", kGgufTypeNames, ")");
  const int64_t B = x.size(0), H = x.size(1), K = x.size(2), N = out_features;
  TORCH_CHECK(K % row_granule(ggml_type) == 0, "gguf_head_linear: in_features ", K,
              " (x's last dim) is not a multiple of ggml_type ", ggml_type, "'s block size ",
              row_granule(ggml_type));
  TORCH_CHECK(N >= 0, "gguf_head_linear: out_features must be >= 0, got ", N);
  const int64_t row_bytes = row_bytes_of(ggml_type, K);
  TORCH_CHECK(qweight.dim() == 3 && qweight.size(0) == H && qweight.size(1) == N &&
                  qweight.size(2) == row_bytes,
              "gguf_head_linear: qweight shape ", qweight.sizes(), " does not match ", H,
              " heads (x's dim 1), out_features=", N, " and in_features=", K, ": expected [", H,
              ", ", N, ", ", row_bytes, "] (", row_bytes, " bytes of blocks a row)");
  TORCH_CHECK(qweight.is_contiguous(), "gguf_head_linear: qweight must be contiguous");
  TORCH_CHECK(activations >= kFp32Activations && activations <= kQ8Scalar,
              "gguf_head_linear: activations must be 0 (fp32) to ", int64_t{kQ8Scalar}, ", got ",
              activations);
  if (is_x8_type(ggml_type)) check_x8_weight("gguf_head_linear", ggml_type, N, activations);

  // Heads outermost, each head's B rows together: [H, B, in] (a view, no copy, at B = 1), the
  // result [H, B, out] turned back. Any strides of x are fine.
  const at::Tensor xt = x.transpose(0, 1).contiguous();
  if (B == 0 || H == 0 || N == 0 || K == 0) return at::zeros({B, H, N}, xt.options());
  at::Tensor yt = at::empty({H, B, N}, xt.options());
  std::vector<int64_t> starts(H + 1);
  std::vector<const uint8_t*> weights(H);
  const uint8_t* qw = qweight.data_ptr<uint8_t>();
  for (int64_t h = 0; h <= H; ++h) starts[h] = h * B;
  for (int64_t h = 0; h < H; ++h) weights[h] = qw + h * N * row_bytes;
  const float* xp = xt.data_ptr<float>();
  float* yp = yt.data_ptr<float>();
  // int8 activations as gguf_linear quantizes them (F32 weights stay fp32), by its few-rows
  // kernels at every B (gguf_linear's int8 GEMM from kQ8GemmMinRows rows sums the same integers)
  if (activations != kFp32Activations && !is_float_type(ggml_type))
    q8_linear_grouped(ggml_type, activations, xp, starts.data(), H, K, weights.data(), N, yp);
  else
    fp32_linear_grouped(ggml_type, xp, starts.data(), H, K, weights.data(), N, yp);
  return yt.transpose(0, 1).contiguous();
}

}  // namespace

TORCH_LIBRARY_IMPL(hybridllm, CPU, m) {
  m.impl("gguf_head_linear", &gguf_head_linear);
}
