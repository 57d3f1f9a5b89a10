// Q4_K, Q5_K, Q6_K, Q2_K, Q3_K, IQ4_XS, IQ2_XXS, IQ3_XXS, Q4_0, Q4_1, Q8_0 and IQ4_NL weights
// repacked for the int8 kernels in groups of 8 rows (ggml_types kQ4_KX8 ... kIQ3_XXSX8, not ggml
// types): the integer products then run with the 8 rows in the vector lanes, so a (super-)block's
// scale and min arithmetic is done once for 8 rows instead of once a row, and no horizontal sums
// are needed (the grid types, whose lookups are a row's, keep a row's fields together and sum
// 8 rows' vectors into one). Q4_K / Q5_K take the type's bytes plus 4 a row per 256 weights (the
// 6-bit scales and mins stored as bytes), IQ4_XS plus 2 (its 6-bit scales as bytes), IQ2_XXS and
// IQ3_XXS plus 4 (their signs' parity bits stored); the others their own bytes.
//
// Group g (rows 8g .. 8g + 7), super-block s (weights 256 s ..) takes the B bytes below at
// (g * K / 256 + s) * B in the weight, which is [N, K / 256 * B / 8] uint8 like any rows (the
// 32-weight block types below: block b at (g * K / 32 + b) * B, the weight [N, K / 32 * B / 8]).
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
// IQ4_XS (1104 bytes; AVX2 builds only):
//   [0, 16)      d of rows 0-7, fp16
//   [16, 80)     scale of sub-block j (32 weights), row r at 16 + 8 j + r: IQ4_XS's 6-bit scale
//                minus 32, as int8
//   [80, 1104)   chunk q at 80 + 64 q: the codes (indices into IQ4_XS's 16 values) as Q4_K's
//   Weight = d * scale * kIq4Values[code], as in IQ4_XS.
// Q2_K and Q3_K (gguf_x8_code_cpu.cpp) keep 2-bit codes, chunk pair p (units 2 p, 2 p + 1) in 64
// bytes: bits 2 f, 2 f + 1 of byte 4 L + b (lane L = 8 h + r) hold row r's code of weight
// 16 (2 p + f / 2) + 8 (f % 2) + 4 h + b. Unit u's scale (and min) of row r is the group's
// scale j = 16 (u / 2) + 2 r + u % 2.
// Q2_K (672 bytes):
//   [0, 16)      d of rows 0-7, fp16
//   [16, 32)     dmin of rows 0-7, fp16
//   [32, 160)    scale j: Q2_K's byte, the scale in its low nibble and the min in the high one
//   [160, 672)   chunk pair p's codes at 160 + 64 p
//   Weight = d * scale * code - dmin * min, as in Q2_K.
// Q3_K (880 bytes):
//   [0, 16)      d of rows 0-7, fp16
//   [16, 80)     the low 4 bits of 6-bit scale j: nibble j / 64 of byte 16 + j % 64
//   [80, 112)    its top 2 bits: bits 2 (j / 32) of byte 80 + j % 32
//   [112, 880)   chunk pair p at 112 + 96 p: its 64 code bytes (q, Q3_K's low 2 bits), then 32
//                bytes of their high bits (q3_high_place): with AVX-512, 8 bytes each field f,
//                bit i set where code byte i's field has Q3_K's high bit set (a mask); AVX2
//                builds keep code byte i's 4 in the nibble i / 32 of byte i % 32, field f at its
//                bit f, to shift into place
//   Weight = d * (scale - 32) * (q - 4 where the high bit is clear), as in Q3_K.
// IQ2_XXS and IQ3_XXS (560 / 816 bytes; AVX2 builds only; gguf_x8_grid_cpu.cpp) keep each
// row's fields apart, E = 32 (IQ2_XXS: an entry of 8 weights) or 64 (IQ3_XXS: 4) grid indices:
//   [0, 16)      d of rows 0-7, fp16
//   [16, 48)     row r's 4-bit scales s at 16 + 4 r, nibble j (low first) of 32 weights j
//   [48, 48+8E)  row r's E grid indices (bytes) at 48 + E r
//   then 256     row r's signs at 48 + 8 E + 32 r: bit z of byte i set where weight 32 z + i is
//                negative (the 7-bit sign indices with their parity, as bit planes)
//   Weight = d / 8 (IQ3_XXS: d / 4) * (2 s + 1) * grid value * sign, as in the source types
//   (IQ2_XXS: 70 bytes a row's super-block against 66; IQ3_XXS: 102 against 98).
// The layouts are in memory only (repacked at load by the build that computes them).
// Q4_0, Q4_1, Q8_0 and IQ4_NL (gguf_x8_block_cpu.cpp) go a 32-weight block at a time, chunks 0
// and 1 (weights 0-15, 16-31) as the K-quants' chunks:
// Q4_0 / IQ4_NL / Q4_1 (144 / 144 / 160 bytes):
//   [0, 16)      d of rows 0-7, fp16
//   [16, 32)     Q4_1: m of rows 0-7, fp16
//   then         chunk c's 64 code bytes at 16 + 64 c (Q4_1: 32 + 64 c), nibbles as Q4_K's
//   Weight = d * (code - 8) (Q4_0), d * kIq4NlValues[code] (IQ4_NL), d * code + m (Q4_1), as in
//   the source types.
// Q8_0 (272 bytes):
//   [0, 16)      d of rows 0-7, fp16
//   [16, 272)    chunk c's half h at 16 + 128 c + 64 h: byte 4 L + b (lane L = 8 h' + r) holds
//                row r's code of weight 16 c + 8 h + 4 h' + b plus 128, as an unsigned byte
//   Weight = d * (code - 128), as in Q8_0.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gguf_blocks.h"
#include "gguf_prefetch.h"
#include "gguf_q8_linear.h"
#include "gguf_q8_quantize.h"
#include "gguf_q8_simd.h"

// AVX2 builds without AVX-512 have x8 kernels of their own: Q4_K, Q5_K, Q6_K, IQ4_XS
// (gguf_x8_avx2_cpu.cpp), Q2_K and Q3_K (gguf_x8_code_avx2_cpu.cpp), Q4_0, Q4_1, Q8_0 and IQ4_NL
// (gguf_x8_block_cpu.cpp), IQ2_XXS and IQ3_XXS (gguf_x8_grid_cpu.cpp).
#if defined(HYBRIDLLM_Q8_AVX2) && !defined(HYBRIDLLM_Q8_AVX512)
#define HYBRIDLLM_X8_AVX2 1
#endif

namespace hybridllm_gguf {

constexpr int64_t kX8GroupRows = 8;

// For an x8 source type (kQ4_K, ...): one unit's bytes (a super-block or a 32-weight block) in
// its own layout, and a group unit's (8 rows) in the x8 layout.
template <int64_t kType>
constexpr int64_t kSourceBytes = gguf_type_info(kType).unit_bytes;
template <int64_t kType>
constexpr int64_t kGroupBytes = 8 * gguf_type_info(x8_type_of(kType)).unit_bytes;

// Where a Q4_K / Q5_K / Q6_K / IQ4_XS group super-block's codes start.
template <int64_t kType>
constexpr int64_t kGroupCodes = kType == kQ6_K ? 144 : kType == kIQ4_XS ? 80 : 160;
// Where chunk q's 64 code bytes start in a group super-block; Q5_K's 16 bytes of fifth bits and
// Q6_K's 32 of top 2 bits follow them. Chunk by chunk the kernel reads one forward stream: with
// the extra bits apart (a second stream 1 KB on), Q6_K read 2.5-3x slower from DRAM than from
// cache on the 2-core Zen 5, the prefetchers following neither stream well.
template <int64_t kType>
constexpr int64_t chunk_code_offset(int q) {
  return kGroupCodes<kType> + (kType == kQ5_K ? 80 : kType == kQ6_K ? 96 : 64) * q;
}
constexpr int64_t q5_high_offset(int q) { return chunk_code_offset<kQ5_K>(q) + 64; }
constexpr int64_t q6_top_offset(int q) { return chunk_code_offset<kQ6_K>(q) + 64; }

// Where a Q2_K / Q3_K group super-block's chunk pair p starts: its 64 code bytes, then Q3_K's
// 32 bytes of high bits.
template <int64_t kType>
constexpr int64_t code_pair_offset(int p) {
  return kType == kQ2_K ? 160 + 64 * p : 112 + 96 * p;
}
// Q3_K: where chunk pair code byte i's field f keeps its high bit, from the pair's start.
struct HighBitPlace {
  int byte, bit;
};
constexpr HighBitPlace q3_high_place(int i, int f) {
#if defined(HYBRIDLLM_X8_AVX2)
  return {64 + i % 32, 4 * (i / 32) + f};
#else
  return {64 + 8 * f + i / 8, i % 8};
#endif
}
// Q2_K / Q3_K: the group's scale j of unit u (16 weights) of row r; the two units of a pair side
// by side for each row, as vpmaddwd / vpdpwssd take them as int16 pairs.
constexpr int code_unit_index(int u, int r) { return 16 * (u / 2) + 2 * r + u % 2; }

// The 32-weight block types with an x8 form (gguf_x8_block_cpu.cpp).
constexpr bool is_block_x8_source(int64_t type) {
  return type == kQ4_0 || type == kQ4_1 || type == kQ8_0 || type == kIQ4_NL;
}
// The types whose x8 form keeps 2-bit code fields in chunk pairs (gguf_x8_code_cpu.cpp).
constexpr bool is_code_x8_source(int64_t type) { return type == kQ2_K || type == kQ3_K; }
// The grid types with an x8 form (gguf_x8_grid_cpu.cpp).
constexpr bool is_grid_x8_source(int64_t type) { return type == kIQ2_XXS || type == kIQ3_XXS; }

// The x8 types and their source types: gguf_types.h (x8_type_of, x8_source_type, is_x8_type;
// dispatch_gguf_type<kX8Kernels> gives a body the source type).

// x's sums over a K-quant's sub-blocks 2 p and 2 p + 1, from its four 16-value bsums at b, as
// the int16 pair a 32-bit lane holds against the two sub-blocks' min codes (vpmaddwd); each sum
// is at most 32 * 127.
inline int32_t k_min_pair(const int16_t* b) {
  const uint32_t lo = static_cast<uint16_t>(b[0] + b[1]);
  const uint32_t hi = static_cast<uint16_t>(b[2] + b[3]);
  return static_cast<int32_t>(lo | (hi << 16));
}

// Whether this build computes weights of x8 source type `type` in x8 groups, and so repacks
// them at load: with AVX512-VNNI every x8 source type but IQ4_XS, IQ2_XXS and IQ3_XXS (their
// kernels are AVX2's), on AVX2 alone every x8 source type, none else.
constexpr bool x8_source_built(int64_t type) {
#if defined(HYBRIDLLM_Q8_AVX512)
  return x8_type_of(type) >= 0 && type != kIQ4_XS && !is_grid_x8_source(type);
#elif defined(HYBRIDLLM_X8_AVX2)
  return x8_type_of(type) >= 0;
#else
  (void)type;
  return false;
#endif
}

// y [M, N] = x [M, K] W^T for W of an x8 type (N % 8 == 0), x quantized as q8_linear quantizes
// it for K-quants; the integer sums are the source type's int8 path's, so y equals it up to fp32
// rounding. False where this build has no kernels for the type (x8_source_built).
bool x8_linear(int64_t type, const float* x, int64_t M, int64_t K, const uint8_t* qw, int64_t N,
               float* y);

// q8_linear_grouped's product for x8 weights (N % 8 == 0).
bool x8_linear_grouped(int64_t type, const float* x, const int64_t* starts, int64_t groups,
                       int64_t K, const uint8_t* const* weights, int64_t N, float* y);

// Group `group`'s 8 rows unpacked for the int8 GEMM, as its source type's unpack gives them:
// codes [8][K] (rows `code_stride` apart); Q4_K / Q5_K: scales d * sc and 6-bit min codes m
// [8][K / 32], and min scales -dmin [8][K / 256]; Q6_K: scales d * scale [8][K / 16], no mins;
// Q2_K / Q3_K: on AVX-512 builds the scaled codes (scaled_field below), scales d or -d
// [8][K / 256], on AVX2 builds the codes (Q3_K's plus 4) and scales d * scale [8][K / 16], and
// Q2_K's 4-bit min codes [8][K / 16] and -dmin [8][K / 256]; IQ4_XS: its signed values as
// codes and scales d * scale [8][K / 16] (a sub-block's twice); Q4_0 / Q4_1 / Q8_0 / IQ4_NL:
// scales d [8][K / 32], Q4_1's m in min_scales; IQ2_XXS / IQ3_XXS: their signed grid values as
// codes and scales d / 8 (d / 4) * (2 s + 1) [8][K / 16] (rows `unit_stride` apart).
void x8_unpack_group(int64_t type, const uint8_t* group, int64_t K, uint8_t* codes,
                     int64_t code_stride, float* scales, int16_t* min_codes, float* min_scales,
                     int64_t unit_stride);

// An op's check of x8 weights (ggml_type `type`, N rows): whole groups of 8 rows, and int8
// activations on the build's best path, the only one with x8 kernels.
inline void check_x8_weight(const char* op, int64_t type, int64_t N, int64_t activations) {
  TORCH_CHECK(N % kX8GroupRows == 0, op, ": x8 weights come in groups of ", kX8GroupRows,
              " rows, got out_features=", N);
  TORCH_CHECK(activations == kQ8Best || activations == q8_paths().front(), op,
              ": x8 weights (ggml_type ", type,
              ") need int8 activations on this build's best path (activations 1 or ",
              q8_paths().front(), "), got ", activations);
}

#if defined(HYBRIDLLM_X8_AVX2)
// x's 4 int8 values at p, in every 32-bit lane
inline __m256i avx2_x_quad(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_set1_epi32(v);
}

// A chunk's 4 code vectors (vector k, lane r: row r's codes of the chunk's weights 4 k .. 4 k + 3)
// times x's 16 values at x: 4 int16 pair sums a lane each.
inline void avx2_chunk_products(const __m256i codes[4], const int8_t* x, __m256i products[4]) {
  for (int k = 0; k < 4; ++k) products[k] = _mm256_maddubs_epi16(codes[k], avx2_x_quad(x + 4 * k));
}

// The int8 GEMM's unpacking: a chunk's 4 code vectors, a 4 x 8 matrix of 32-bit words (4 codes
// of a row each), transposed into 16 bytes a row in weight order, row r at dst + r * stride.
inline void avx2_store_chunk_rows(const __m256i c[4], uint8_t* dst, int64_t stride) {
  const __m256i a = _mm256_unpacklo_epi32(c[0], c[1]), b = _mm256_unpackhi_epi32(c[0], c[1]);
  const __m256i e = _mm256_unpacklo_epi32(c[2], c[3]), f = _mm256_unpackhi_epi32(c[2], c[3]);
  // rows 0 and 4, 1 and 5, 2 and 6, 3 and 7 (the low and high 128-bit lanes)
  const __m256i rows[4] = {_mm256_unpacklo_epi64(a, e), _mm256_unpackhi_epi64(a, e),
                           _mm256_unpacklo_epi64(b, f), _mm256_unpackhi_epi64(b, f)};
  for (int r = 0; r < 4; ++r) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + r * stride), _mm256_castsi256_si128(rows[r]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (r + 4) * stride),
                     _mm256_extracti128_si256(rows[r], 1));
  }
}

// The AVX2 x8 kernels' walk over groups [g0, g1) and tiles of 2 rows of x (each group super-block's
// codes decoded once for both, and the tile's sums and codes kept in the 16 vector registers):
// tile(g, r0, rows, first), rows a std::integral_constant<int, 1 or 2>; `first`: the tile that
// reads the group from memory (and prefetches ahead).
template <class Tile>
void avx2_x8_tiles(int64_t M, int64_t g0, int64_t g1, Tile tile) {
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t r0 = 0; r0 < M; r0 += 2) {
      if (M - r0 == 1)
        tile(g, r0, std::integral_constant<int, 1>{}, r0 == 0);
      else
        tile(g, r0, std::integral_constant<int, 2>{}, r0 == 0);
    }
}

// x8_linear_grouped's and x8_unpack_group's kernels on AVX2 builds for Q4_K, Q5_K, Q6_K and
// IQ4_XS (gguf_x8_avx2_cpu.cpp; Q2_K and Q3_K: code_x8_linear_grouped, code_x8_unpack_group).
void avx2_x8_linear_grouped(int64_t source_type, const float* x, const int64_t* starts,
                            int64_t groups, int64_t K, const uint8_t* const* weights, int64_t N,
                            float* y);
void avx2_x8_unpack_group(int64_t source_type, const uint8_t* group, int64_t K, uint8_t* codes,
                          int64_t code_stride, float* scales, int16_t* min_codes,
                          float* min_scales, int64_t unit_stride);
#endif

// From this many rows of x the int8 GEMM runs for weights of `type` instead of the few-rows
// kernels: kQ8GemmMinRows, except Q2_K and Q3_K in x8 groups, whose kernels take a tile of 4
// rows of x a group: on the 1B Q2_K file's gate (8192 x 2048, Q2_K) and down (2048 x 8192, Q3_K),
// 2 threads, they took 0.64 / 0.53 of the GEMM's time at 8 rows, 0.95 / 0.81 at 12, 1.25 / 1.07
// at 16. Q4_0, Q4_1 and Q8_0 (IQ4_NL alike) in x8 groups, tiles of 5 rows, took 0.46-0.68 of its
// time at 8 rows, 0.67-0.94 at 12, 0.86-1.18 at 16 (SmolLM2's 3072 x 576, 576 x 1536 and
// 49,152 x 576). Q4_K, Q5_K and Q6_K in x8 groups, tiles of 4 rows, from DRAM: 0.53-0.72 of its
// time at 8 rows, 0.76-0.99 at 12, 1.10-1.26 at 16 (the 1B Q4_K_M file's gate, Q4_K 8192 x 2048,
// and down, Q6_K 2048 x 8192; Qwen3-Next's 512 experts' gate and down, Q4_K, as one matrix).
// AVX2 builds (tiles of 2 rows) on the Zen 3 of docs/benchmarks.md, 8192 x 2048, 2 threads: the
// Q2_K and Q3_K kernels took 0.17 ms a row of x at 13 rows, the GEMM 0.18-0.23 at 14-16 and
// 0.16 at 32; IQ4_XS's 0.18 at 8-12 rows and 0.23-0.25 at 16-32, the GEMM (whose signed codes
// cost a vpmaddwd every 4 products) 0.24-0.30 at 13-32 and 0.21-0.22 from 64: 24 rows for the
// three. The grid types' kernels, whose lookups are made for each weight row and whose every row
// of x costs about as much again, took 1.64 / 2.28 / 2.37 / 3.20 ms at 4-7 rows (IQ2_XXS; IQ3_XXS
// 2.61 / 2.37 / 2.64 / 4.37), the GEMM 2.44 (2.39) at 8, whose tile of 8 rows of x costs the same
// from 1 row: 6 rows.
inline int64_t int8_gemm_min_rows(int64_t type) {
  if (!is_x8_type(type)) return kQ8GemmMinRows;
  const int64_t source = x8_source_type(type);
#if defined(HYBRIDLLM_X8_AVX2)
  if (is_code_x8_source(source) || source == kIQ4_XS) return 24;
  if (is_grid_x8_source(source)) return 6;
#endif
  if (is_code_x8_source(source)) return 14;
  return is_block_x8_source(source) ? 16 : 13;
}

// Below this many (256-weight super-block x row of x) products one thread does it all.
constexpr int64_t kX8SerialSuperBlocks = 256;
// How far ahead the x8 kernels prefetch at most, for more than one row of x (one row: none, see
// for_x8_row_groups): each thread reads one contiguous run, which the hardware prefetchers
// follow. Tuned at one row of x, when that still prefetched: on the 1B Q4_K_M-like file (2-core
// Zen 5, one process switching between the two), its q, gate and down GEMVs streamed at 0.91,
// 0.96, 0.95 of torch.sum's rate at 32 KB against 0.77, 0.93, 0.90 at the row kernels' 128 KB,
// and decode won 14 of 20 pairs.
constexpr int64_t kX8MaxPrefetchBytes = 32 * 1024;

// The row groups of products p = 0 .. groups - 1 (rows [starts[p], starts[p + 1]) of x times
// weights[p], N rows of group_bytes a group of 8), one product's after the other, split among
// the threads in contiguous runs: body(p, g0, g1, window) for groups [g0, g1) of product p.
template <class Body>
void for_x8_row_groups(const int64_t* starts, int64_t groups, int64_t K,
                       const uint8_t* const* weights, int64_t N, int64_t group_bytes, Body body) {
  const int64_t M = starts[groups];
  const int64_t row_groups = N / kX8GroupRows, total = groups * row_groups;
  const int64_t threads = at::get_num_threads();
  const int64_t grain =
      K / 256 * M * N < kX8SerialSuperBlocks ? total : (total + threads - 1) / threads;
  // One row of x a product: each weight byte is read once, and the hardware prefetchers alone
  // follow each thread's run. In one process switching between the two every 64 tokens (8
  // rounds, 2-core Zen 5), batch-1 decode of the 1B Q4_K_M file ran 38.1 against 32.6 tok/s
  // (median) without software prefetching than with start_prefetch's streaming window, faster
  // in 8 of 8 rounds; the Qwen3-30B-A3B-shaped Q2_K MoE file 104.7 against 84.2 (4 of 5); the
  // compute-bound 1B Q2_K file alike (52.3 against 52.6). With more rows of x (64 sequences'
  // decode on the MoE file) no prefetching at all was 4% slower, so those keep their window.
  // On the AVX2-only Zen 3 (machine C) the hardware prefetchers alone fell far short instead:
  // a loop over Q4_K groups at one row of x (8192 x 2048, 2 threads) read 41-45 G multiply-adds
  // a second from DRAM with them, 46-59 with a non-temporal window 4-8 KB ahead.
  constexpr bool kHardwareOnly =
#if defined(HYBRIDLLM_X8_AVX2)
      false;
#else
      true;
#endif
  bool streaming = true;
  for (int64_t p = 0; p < groups; ++p) streaming = streaming && starts[p + 1] - starts[p] <= 1;
  at::parallel_for(0, total, grain, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin / row_groups; p < groups && p * row_groups < end; ++p) {
      const int64_t g0 = std::max(begin, p * row_groups) - p * row_groups;
      const int64_t g1 = std::min(end, (p + 1) * row_groups) - p * row_groups;
      if (starts[p + 1] == starts[p]) continue;
      const uint8_t* first = weights[p] + g0 * group_bytes;
      const int64_t bytes = (g1 - g0) * group_bytes;
      body(p, g0, g1,
           !streaming      ? start_prefetch(first, bytes, kX8MaxPrefetchBytes)
           : kHardwareOnly ? hardware_prefetch_only(first)
                           : start_prefetch(first, bytes, kX8MaxPrefetchBytes, true));
    }
  });
}

#if defined(HYBRIDLLM_X8_AVX2)
// x8_linear_grouped on AVX2 for the kernels that take x as quantize_rows<256> gives it (Q2_K,
// Q3_K, IQ2_XXS, IQ3_XXS): x quantized once a call, then each thread's groups in tiles of rows of
// x: tile(rows, x from the tile's first row, the group's bytes, y at that row and the group's
// first column, first, window), with avx2_x8_tiles' rows and first; y's rows N apart.
template <class Tile>
void avx2_x8_linear_rows256(const float* x, const int64_t* starts, int64_t groups, int64_t K,
                            const uint8_t* const* weights, int64_t N, float* y,
                            int64_t group_bytes, Tile tile) {
  thread_local std::vector<uint8_t> quantized;  // kept from call to call
  const Q8Rows xq = quantize_rows<256>(x, starts[groups], K, quantized);
  for_x8_row_groups(starts, groups, K, weights, N, group_bytes,
                    [&](int64_t p, int64_t g0, int64_t g1, const PrefetchWindow& window) {
                      const int64_t r0 = starts[p];
                      const auto at = [&](int64_t g, int64_t t, auto rows, bool first) {
                        tile(rows, xq.row(r0 + t), weights[p] + g * group_bytes,
                             y + (r0 + t) * N + 8 * g, first, window);
                      };
                      avx2_x8_tiles(starts[p + 1] - r0, g0, g1, at);
                    });
}
#endif

#if defined(HYBRIDLLM_Q8_AVX512)
// x's values that the code vector of a 16-weight chunk's `half` (0: its low nibbles or first
// fields, 1: the next) meets, from the chunk's 16 int8 values: lanes 0-7 values 8 half .. + 3,
// lanes 8-15 the next 4. Built as the kernel goes: stored as vectors, 16 times x's bytes, a long
// row (K = 8192: 64 KB) did not stay in L1, and a down projection read 15% slower than a gate's.
inline __m512i x_quads(const int8_t* chunk, int half) {
  const __m512i v =
      _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk)));
  const __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  return _mm512_permutexvar_epi32(_mm512_add_epi32(halves, _mm512_set1_epi32(2 * half)), v);
}

// The inverse, for the int8 GEMM's unpacking: a 16-weight chunk's codes from the vectors of its
// two halves (`low`, `high`: lane 8 h + r holds row r's codes 8 half + 4 h .. + 3) stored as
// 16 bytes a row in weight order, row r at dst + r * stride.
inline void store_chunk_rows(__m512i low, __m512i high, uint8_t* dst, int64_t stride) {
  // output dword 4 i + k: row i's codes 4k .. 4k + 3 (rows 0-3; +4: 4-7)
  const __m512i rows03 =
      _mm512_setr_epi32(0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27);
  const __m512i a = _mm512_permutex2var_epi32(low, rows03, high);
  const __m512i b =
      _mm512_permutex2var_epi32(low, _mm512_add_epi32(rows03, _mm512_set1_epi32(4)), high);
  const __m128i parts[8] = {_mm512_castsi512_si128(a),       _mm512_extracti32x4_epi32(a, 1),
                            _mm512_extracti32x4_epi32(a, 2), _mm512_extracti32x4_epi32(a, 3),
                            _mm512_castsi512_si128(b),       _mm512_extracti32x4_epi32(b, 1),
                            _mm512_extracti32x4_epi32(b, 2), _mm512_extracti32x4_epi32(b, 3)};
  for (int r = 0; r < 8; ++r)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + r * stride), parts[r]);
}

// Q2_K / Q3_K codes as the int8 GEMM takes them: each code with its 16-weight unit's integer
// scale s folded in, one unsigned byte a weight: Q2_K's s * q (s 0..15, q 0..3: at most 45),
// Q3_K's 128 - s * q (s -32..31, q -4..3: 0..252). A super-block's products with x then add up
// in integers and meet one float scale, d (Q2_K) or -d (Q3_K), instead of a conversion and an FMA
// every 16 weights. `v` holds the codes as bytes (Q2_K: q; Q3_K: v = q + 4), `scale` each 16-bit
// word's unit scale. Q2_K's product stays in its byte, so one 16-bit product serves a word's two
// codes; Q3_K's 128 - s * (v - 4) = 128 + 4 s - s * v is exact in bytes taken mod 256, the odd
// bytes multiplied apart so that no borrow crosses from the even ones.
template <int64_t kType>
inline __m512i scaled_field(__m512i v, __m512i scale) {
  static_assert(kType == kQ2_K || kType == kQ3_K);
  if constexpr (kType == kQ2_K) {
    return _mm512_mullo_epi16(v, scale);
  } else {
    const __m512i base = _mm512_add_epi16(_mm512_slli_epi16(scale, 2), _mm512_set1_epi16(128));
    const __m512i even = _mm512_sub_epi16(base, _mm512_mullo_epi16(v, scale));
    const __m512i odd =
        _mm512_sub_epi16(base, _mm512_mullo_epi16(_mm512_srli_epi16(v, 8), scale));
    // even's low bytes, odd's low bytes moved up
    return _mm512_mask_blend_epi8(0xAAAAAAAAAAAAAAAAull, even, _mm512_slli_epi16(odd, 8));
  }
}
#endif

// The 32-weight block types' groups (source_type kQ4_0, kQ4_1, kQ8_0, kIQ4_NL): `nb` blocks of 8
// source rows (src, rows nb blocks apart) into one group (repack), or back.
void block_x8_convert(int64_t source_type, const uint8_t* src, int64_t nb, uint8_t* dst,
                      bool repack);
#if defined(HYBRIDLLM_Q8_AVX512) || defined(HYBRIDLLM_X8_AVX2)
void block_x8_linear_grouped(int64_t source_type, const float* x, const int64_t* starts,
                             int64_t groups, int64_t K, const uint8_t* const* weights, int64_t N,
                             float* y);
void block_x8_unpack_group(int64_t source_type, const uint8_t* group, int64_t K, uint8_t* codes,
                           int64_t code_stride, float* scales, float* mins, int64_t unit_stride);
#endif

// body(std::integral_constant<int64_t, T>) for source type T: kQ2_K, else kQ3_K.
template <class Body>
void dispatch_code_x8(int64_t source_type, Body body) {
  if (source_type == kQ2_K)
    body(std::integral_constant<int64_t, kQ2_K>{});
  else
    body(std::integral_constant<int64_t, kQ3_K>{});
}

// body(std::integral_constant<int64_t, T>) for source type T: kIQ2_XXS, else kIQ3_XXS.
template <class Body>
void dispatch_grid_x8(int64_t source_type, Body body) {
  if (source_type == kIQ2_XXS)
    body(std::integral_constant<int64_t, kIQ2_XXS>{});
  else
    body(std::integral_constant<int64_t, kIQ3_XXS>{});
}

// IQ2_XXS's and IQ3_XXS's groups (gguf_x8_grid_cpu.cpp): `nsb` super-blocks of 8 source rows
// (src, rows nsb super-blocks apart) into one group (repack), or back.
void grid_x8_convert(int64_t source_type, const uint8_t* src, int64_t nsb, uint8_t* dst,
                     bool repack);
#if defined(HYBRIDLLM_X8_AVX2)
void grid_x8_linear_grouped(int64_t source_type, const float* x, const int64_t* starts,
                            int64_t groups, int64_t K, const uint8_t* const* weights, int64_t N,
                            float* y);
void grid_x8_unpack_group(int64_t source_type, const uint8_t* group, int64_t K, uint8_t* codes,
                          int64_t code_stride, float* scales, int64_t unit_stride);
#endif

// Q2_K and Q3_K's groups (gguf_x8_code_cpu.cpp; source_type kQ2_K or kQ3_K): `nsb` super-blocks
// of 8 source rows (src, rows nsb super-blocks apart) into one group (repack), or back.
void code_x8_convert(int64_t source_type, const uint8_t* src, int64_t nsb, uint8_t* dst,
                     bool repack);
#if defined(HYBRIDLLM_Q8_AVX512) || defined(HYBRIDLLM_X8_AVX2)
// (AVX2 builds: gguf_x8_code_avx2_cpu.cpp)
void code_x8_linear_grouped(int64_t source_type, const float* x, const int64_t* starts,
                            int64_t groups, int64_t K, const uint8_t* const* weights, int64_t N,
                            float* y);
void code_x8_unpack_group(int64_t source_type, const uint8_t* group, int64_t K, uint8_t* codes,
                          int64_t code_stride, float* scales, int16_t* min_codes,
                          float* min_scales, int64_t unit_stride);
#endif

}  // namespace hybridllm_gguf
