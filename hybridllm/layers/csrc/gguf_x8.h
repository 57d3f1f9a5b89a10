// Q4_K, Q5_K and Q6_K weights repacked for the int8 kernels in groups of 8 rows (ggml_types
// kQ4_KX8, kQ5_KX8 and kQ6_KX8, not ggml types): the integer dot products then run with the 8
// rows in the vector lanes, so a super-block's scale and min arithmetic is done once for 8 rows
// instead of once a row, and no horizontal sums are needed. Q4_K / Q5_K take the type's bytes
// plus 4 a row per 256 weights (the 6-bit scales and mins stored as bytes); Q6_K its own 210.
//
// Group g (rows 8g .. 8g + 7), super-block s (weights 256 s ..) takes the B bytes below at
// (g * K / 256 + s) * B in the weight, which is [N, K / 256 * B / 8] uint8 like any rows.
// Chunk q (0-15) of a super-block is its weights 16 q .. 16 q + 15; its 64 code bytes hold in
// byte 4 L + b (lane L = 8 h + r) row r's code of weight 16 q + 4 h + b in the low nibble and
// of weight 16 q + 8 + 4 h + b in the high nibble.
// Q4_K / Q5_K (1184 / 1440 bytes):
//   [0, 16)      d of rows 0-7, fp16
//   [16, 32)     dmin of rows 0-7, fp16
//   [32, 96)     scale sc of sub-block j, row r at 32 + 8 j + r (6-bit values as bytes)
//   [96, 160)    min m of sub-block j, row r at 96 + 16 (j / 2) + 2 r + j % 2
//   [160, 1184)  Q4_K: the low 4 bits of the codes, chunk q at 160 + 64 q
//   [160, 1440)  Q5_K: chunk q at 160 + 80 q, 64 bytes of the codes' low 4 bits, then 16 of
//                their fifth bits: bit i of the first 8 for the low nibble of code byte i, of the
//                last 8 for the high nibble.
//   Weight = d * sc * code - dmin * m, as in Q4_K / Q5_K.
// Q6_K (1680 bytes):
//   [0, 16)      d of rows 0-7, fp16
//   [16, 144)    scale of chunk q, row r at 16 + 8 q + r (int8)
//   [144, 1680)  chunk q at 144 + 96 q: 64 bytes of the codes' low 4 bits, then 32 of their top
//                2 bits, the low nibbles' in the first 16 bytes and the high nibbles' in the
//                last 16; the nibble of code byte i = 16 G + t has them at bits 2 G, 2 G + 1 of
//                byte t (one 16-byte run for each 128-bit lane).
//   Weight = d * scale * (code - 32), as in Q6_K.
#pragma once

#include <cstdint>
#include <type_traits>

#include "gguf_blocks.h"

namespace hybridllm_gguf {

constexpr int64_t kX8GroupRows = 8;

// The x8 types and their source types: gguf_types.h (x8_type_of, x8_source_type, is_x8_type;
// dispatch_gguf_type<kX8Kernels> gives a body the source type).

// y [M, N] = x [M, K] W^T for W of an x8 type (N % 8 == 0), x quantized as q8_linear quantizes
// it for K-quants; the integer sums are the source type's int8 path's, so y equals it up to fp32
// rounding. False where this build has no AVX512-VNNI kernels (then no weight is repacked).
bool x8_linear(int64_t type, const float* x, int64_t M, int64_t K, const uint8_t* qw, int64_t N,
               float* y);

// q8_linear_grouped's product for x8 weights (N % 8 == 0).
bool x8_linear_grouped(int64_t type, const float* x, const int64_t* starts, int64_t groups,
                       int64_t K, const uint8_t* const* weights, int64_t N, float* y);

// Group `group`'s 8 rows unpacked for the int8 GEMM, as its source type's unpack gives them:
// codes [8][K] (rows `code_stride` apart); Q4_K / Q5_K: scales d * sc and 6-bit min codes m
// [8][K / 32], and min scales -dmin [8][K / 256]; Q6_K: scales d * scale [8][K / 16], no mins
// (rows `unit_stride` apart).
void x8_unpack_group(int64_t type, const uint8_t* group, int64_t K, uint8_t* codes,
                     int64_t code_stride, float* scales, int16_t* min_codes, float* min_scales,
                     int64_t unit_stride);

bool x8_kernels_built();

}  // namespace hybridllm_gguf
