// hybridllm::gguf_linear with int8 activations: the entry points gguf_linear_cpu.cpp (and
// fused_moe_cpu.cpp) call, for few rows of x (gguf_q8_linear_cpu.cpp) and for many
// (gguf_q8_gemm_cpu.cpp).
#pragma once

#include <cstdint>
#include <vector>

namespace hybridllm_gguf {

// The op's `activations` argument: 0 computes in fp32; the others quantize x to int8 and take
// an integer path: kQ8Best the first of q8_paths(), the others one path each (tests, benchmarks).
enum Q8Path : int64_t {
  kFp32Activations = 0,
  kQ8Best = 1,
  kQ8Avx512Vnni = 2,  // 64-byte vectors, vpdpbusd / vpdpwssd; many rows: the int8 GEMM
  kQ8Avx2Vnni = 3,    // 32-byte vectors, vpdpbusd / vpdpwssd (AVX-VNNI or AVX512-VNNI + VL)
  kQ8Avx2 = 4,        // 32-byte vectors, vpmaddubsw + vpmaddwd
  kQ8Scalar = 5,      // portable C++
};

// With int8 activations, from this many rows of x on the int8 GEMM (gguf_q8_gemm_cpu.cpp) runs
// instead of the few-rows kernels: on the 2-core AMD EPYC of docs/benchmarks.md it took 0.85-1.1x
// their time at M = 8, about half at 12-24 and 2.5-3x at M = 2 (SmolLM2's and a 1B model's
// shapes).
constexpr int64_t kQ8GemmMinRows = 8;

// The integer paths this build has, best first (the first is what kQ8Best takes).
const std::vector<int64_t>& q8_paths();

// y [M, N] = x [M, K] W^T for a GGUF block type other than F32, x quantized to int8 in groups
// of 32 (256 for K-quants) with an fp32 scale each; `path` one of q8_paths().
void q8_linear(int64_t type, int64_t path, const float* x, int64_t M, int64_t K, const uint8_t* qw,
               int64_t N, float* y);

// Several such products in one parallel region, for few rows each (an MoE layer's experts at
// decode): rows [starts[g], starts[g + 1]) of x [starts[groups], K] times weight g [N, bytes]
// (weights[g]) into the same rows of y [starts[groups], N]. Every group's weight rows are split
// among the threads together; each output equals q8_linear's for that group alone.
void q8_linear_grouped(int64_t type, int64_t path, const float* x, const int64_t* starts,
                       int64_t groups, int64_t K, const uint8_t* const* weights, int64_t N,
                       float* y);

// The same product for many rows of x, as a GEMM (gguf_q8_gemm_cpu.cpp): x quantized as
// q8_linear quantizes it, the integer sums exact, the same up to fp32 rounding. False (y
// untouched) where this build has no such GEMM for the type: AVX512-VNNI builds have it for
// every int8 type, AVX2 builds (gguf_q8_gemm_avx2_cpu.cpp) too, others none.
bool q8_gemm(int64_t type, const float* x, int64_t M, int64_t K, const uint8_t* qw, int64_t N,
             float* y);

}  // namespace hybridllm_gguf
