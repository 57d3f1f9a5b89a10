// hybridllm::gguf_dequantize: weight rows of any block type the kernels compute, decoded to fp32
// (dequantize_row, gguf_blocks.h). For embedding rows looked up from their blocks, and the
// reference the kernel tests hold the block decoders to.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gguf_blocks.h"
#include "gguf_types.h"

namespace {

using namespace hybridllm_gguf;

at::Tensor gguf_dequantize(const at::Tensor& blocks, int64_t ggml_type, int64_t in_features) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte,
              "gguf_dequantize: blocks must be a uint8 CPU tensor, got ", blocks.scalar_type(),
              " on ", blocks.device());
  TORCH_CHECK(blocks.dim() == 2, "gguf_dequantize: blocks must be 2-D [rows, bytes], got ",
              blocks.dim(), " dims");
  const int64_t K = in_features;
  TORCH_CHECK(supported_type(ggml_type) && !is_x8_type(ggml_type),
              "gguf_dequantize: unsupported ggml_type ", ggml_type, " (supported: ",
              kGgufTypeNames, ", x8 types excepted)");
  TORCH_CHECK(K > 0 && K % row_granule(ggml_type) == 0, "gguf_dequantize: in_features ", K,
              " is not a positive multiple of the block size ", row_granule(ggml_type));
  const int64_t row_bytes = row_bytes_of(ggml_type, K);
  TORCH_CHECK(blocks.size(1) == row_bytes, "gguf_dequantize: rows of ", blocks.size(1),
              " bytes, expected ", row_bytes, " for in_features=", K);
  const at::Tensor b = blocks.contiguous();
  const int64_t R = b.size(0);
  at::Tensor out = at::empty({R, K}, b.options().dtype(at::kFloat));
  const uint8_t* src = b.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  const auto run = [&](auto type_constant) {
    constexpr int64_t kType = decltype(type_constant)::value;
    const int64_t nb = K / kBlock;
    at::parallel_for(0, R, std::max<int64_t>(1, (1 << 16) / K), [&](int64_t begin, int64_t end) {
      std::vector<float> scales(2 * (nb + 16));  // block_scales writes whole 16-wide vectors
      for (int64_t r = begin; r < end; ++r)
        dequantize_row<kType>(src + r * row_bytes, nb, dst + r * K, scales.data(),
                              scales.data() + nb + 16);
    });
  };
  dispatch_gguf_type<kFp32Kernels | kCodeBlocks>(ggml_type, run, [&] {
    TORCH_CHECK(false, "gguf_dequantize: no decoder for ggml_type ", ggml_type);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(hybridllm, CPU, m) {
  m.impl("gguf_dequantize", &gguf_dequantize);
}
