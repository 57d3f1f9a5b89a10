// hybridllm::gguf_linear's few-rows fp32 kernels (gguf_linear_cpu.cpp) as an entry point for
// the ops that compute several weights in one call (gguf_head_linear_cpu.cpp); their int8
// counterpart is q8_linear_grouped (gguf_q8_linear.h).
#pragma once

#include <cstdint>

namespace hybridllm_gguf {

// Rows [starts[g], starts[g + 1]) of x [starts[groups], K] times weight g [N, bytes] of blocks
// of `type` (weights[g]) into the same rows of y [starts[groups], N], in fp32, for every g in
// one parallel region: every group's weight rows split among the threads together, so one row
// of x a group still keeps every thread busy. Each group's output is what gguf_linear's direct
// (or code-block) kernel gives for it alone, at any row count (gguf_linear itself switches to
// GEMMs above kDirectMaxRows rows), up to the order of fp32 sums. Throws for a type without
// fp32 kernels.
void fp32_linear_grouped(int64_t type, const float* x, const int64_t* starts, int64_t groups,
                         int64_t K, const uint8_t* const* weights, int64_t N, float* y);

}  // namespace hybridllm_gguf
