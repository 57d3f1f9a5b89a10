// Q4_K weights repacked for the int8 kernels in groups of 8 rows (ggml_type kQ4_KX8, not a
// ggml type): the integer dot products then run with the 8 rows in the vector lanes, so a
// super-block's scale and min arithmetic is done once for 8 rows instead of once a row, and no
// horizontal sums are needed. The bytes are Q4_K's plus 4 a row per 256 weights (the 6-bit scales
// and mins stored as bytes).
//
// Group g (rows 8g .. 8g + 7), super-block s (weights 256 s ..) is 1184 bytes at
// (g * K / 256 + s) * 1184 of the weight, which is [N, K / 256 * 148] uint8 like any rows:
//   [0, 16)      d of rows 0-7, fp16
//   [16, 32)     dmin of rows 0-7, fp16
//   [32, 96)     scale sc of sub-block j, row r at 32 + 8 j + r (6-bit values as bytes)
//   [96, 160)    min m of sub-block j, row r at 96 + 16 (j / 2) + 2 r + j % 2
//   [160, 1184)  codes: chunk q = 2 j + c (c = 0, 1) of sub-block j at 160 + 64 q; its byte
//                4 L + b (lane L = 8 h + r) holds in its low nibble row r's code of weight
//                32 j + 16 c + 4 h + b and in its high nibble that of weight 32 j + 16 c + 8 + 4 h + b.
// Weight = d * sc * code - dmin * m, as in Q4_K.
#pragma once

#include <cstdint>

namespace hybridllm_gguf {

constexpr int64_t kX8GroupRows = 8;
constexpr int64_t kX8GroupSuperBytes = 1184;

// y [M, N] = x [M, K] W^T for W in kQ4_KX8 (N % 8 == 0), x quantized as q8_linear quantizes
// it for Q4_K; the integer sums are Q4_K's int8 path's, so y equals it up to fp32 rounding.
// False where this build has no AVX512-VNNI kernels (then no weight is repacked).
bool x8_linear(const float* x, int64_t M, int64_t K, const uint8_t* qw, int64_t N, float* y);

// q8_linear_grouped's product for kQ4_KX8 weights (N % 8 == 0).
bool x8_linear_grouped(const float* x, const int64_t* starts, int64_t groups, int64_t K,
                       const uint8_t* const* weights, int64_t N, float* y);

// Group `group`'s 8 rows unpacked for the int8 GEMM: codes [8][K] (rows `code_stride` apart),
// scales d * sc and mins -dmin * m [8][K / 32] (rows `unit_stride` apart), as its Q4_K unpack.
void x8_unpack_group(const uint8_t* group, int64_t K, uint8_t* codes, int64_t code_stride,
                     float* scales, float* mins, int64_t unit_stride);

bool x8_kernels_built();

}  // namespace hybridllm_gguf
