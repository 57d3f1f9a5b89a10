// The GGUF block types the kernels compute, one line each in HYBRIDLLM_GGUF_TYPES: from it come
// the type constants (kQ4_K = 12, ...), their sizes (block_bytes, row_granule, row_bytes_of),
// which types an op takes (supported_type, is_x8_type, x8_type_of, x8_source_type), and
// dispatch_gguf_type, which turns a type id given at run time into the kernels' template
// instantiation for it, once per call. Adding a type is its line here plus its block code
// (decoding: gguf_blocks.h; int8 dot products: gguf_q8_dot.h, gguf_q8_gemm_cpu.cpp).
#pragma once

#include <cstdint>
#include <type_traits>

namespace hybridllm_gguf {

// Every format packs 32 weights a block; one weight row [K] is K/32 consecutive blocks (K-quants:
// K/256 super-blocks of 8 such blocks).
constexpr int64_t kBlock = 32;

// The kernel families of a type, a bit each.
constexpr unsigned kFp32Kernels = 1;  // fp32 activations: gguf_linear_cpu.cpp, gguf_panel_gemm.h
constexpr unsigned kInt8Kernels = 2;  // int8 activations: gguf_q8_linear_cpu.cpp, ..._gemm_cpu.cpp
constexpr unsigned kX8Kernels = 4;    // rows in groups of 8 (gguf_x8.h), int8 activations only
// Not a kernel family: the type's kernels are the code-block ones (gguf_code_blocks.h), which
// see its super-blocks through its CodeBlockDecoder.
constexpr unsigned kCodeBlocks = 8;

// X(name, id, weights a unit, bytes a unit, kernels, computed as): `id` the GGMLQuantizationType
// value; a row is whole units (a block of 32 weights or a super-block of 256); `computed as` the
// type whose template instantiations compute it (itself; for an x8 type, its source type).
//   F32   32 floats: w = the float. Plain fp32 weights are "blocks" of 32 floats with no scale,
//         so the same kernels serve unquantized CPU linears.
//   F16, BF16  32 halves / bfloat16s: w = the value widened to fp32 (F16 and BF16 GGUF files
//         computed from their own bytes, half of fp32's; fp32 activations, like F32).
//   Q4_0  fp16 d, 16 bytes of nibbles: w = d * (q - 8)
//   Q4_1  fp16 d, fp16 m, 16 bytes of nibbles: w = d * q + m
//   Q8_0  fp16 d, 32 int8: w = d * q
//   Q5_0  fp16 d, 4 bytes qh (bit i of the little-endian uint32: weight i's fifth bit), then
//         Q4_0's 16 bytes of nibbles: w = d * (q - 16) for the 5-bit q
//   Q5_1  fp16 d, fp16 m, qh, 16 bytes of nibbles: w = d * q + m for the 5-bit q
//   IQ4_NL  fp16 d, 16 bytes of nibbles: w = d * kIq4NlValues[q], a fixed 16-entry table
//   MXFP4  one E8M0 byte e, 16 bytes of nibbles (IQ4_NL's order): w = d * kMxfp4Values[q], the
//         E2M1 values doubled (exact int8s) and d = 2^(e - 128) their scale halved
//         (e8m0_half_to_float); gpt-oss's experts.
//   Q4_K  super-blocks of 256 weights: fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc_j and mins
//         m_j of its eight 32-weight sub-blocks, 128 bytes of nibbles; sub-block j: w = d sc_j q -
//         dmin m_j, a Q4_1 block with its own layout.
//   Q5_K  Q4_K's layout with a fifth bit: fp16 d, fp16 dmin, 12 scale bytes, 32 bytes of high bits
//         (bit j of byte l is weight l's of sub-block j), then the 128 bytes of nibbles.
//   Q6_K  super-blocks of 256 weights: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales
//         (one per 16 weights), fp16 d last; w = d * scale * (q - 32) for 6-bit q.
//   Q2_K, Q3_K, IQ4_XS  super-blocks of 256 weights computed as code blocks (their layouts:
//         gguf_code_decoders.h).
//   IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ3_S, IQ2_S, IQ1_M  super-blocks of 256 weights in groups
//         of 4 or 8 looked up in a grid, with signs; computed as code blocks (their formats:
//         gguf_iq_blocks.h).
//   Q4_KX8, Q5_KX8, Q6_KX8, Q2_KX8, Q3_KX8, Q4_0X8, Q4_1X8, Q8_0X8, IQ4_NLX8, IQ4_XSX8,
//         IQ2_XXSX8, IQ3_XXSX8  not ggml types: Q4_K / Q5_K / Q6_K / Q2_K / Q3_K / Q4_0 / Q4_1 /
//         Q8_0 / IQ4_NL / IQ4_XS / IQ2_XXS / IQ3_XXS rows repacked in groups of 8 for the int8
//         kernels (gguf_x8.h); a weight's row count is a multiple of 8.
#define HYBRIDLLM_GGUF_TYPES(X)                                               \
  X(F32, 0, 32, 128, kFp32Kernels, F32)                                       \
  X(F16, 1, 32, 64, kFp32Kernels, F16)                                        \
  X(BF16, 30, 32, 64, kFp32Kernels, BF16)                                     \
  X(Q4_0, 2, 32, 18, kFp32Kernels | kInt8Kernels, Q4_0)                       \
  X(Q4_1, 3, 32, 20, kFp32Kernels | kInt8Kernels, Q4_1)                       \
  X(Q5_0, 6, 32, 22, kFp32Kernels | kInt8Kernels, Q5_0)                       \
  X(Q5_1, 7, 32, 24, kFp32Kernels | kInt8Kernels, Q5_1)                       \
  X(Q8_0, 8, 32, 34, kFp32Kernels | kInt8Kernels, Q8_0)                       \
  X(IQ4_NL, 20, 32, 18, kFp32Kernels | kInt8Kernels, IQ4_NL)                  \
  X(MXFP4, 39, 32, 17, kFp32Kernels | kInt8Kernels, MXFP4)                    \
  X(Q4_K, 12, 256, 144, kFp32Kernels | kInt8Kernels, Q4_K)                    \
  X(Q5_K, 13, 256, 176, kFp32Kernels | kInt8Kernels, Q5_K)                    \
  X(Q6_K, 14, 256, 210, kFp32Kernels | kInt8Kernels, Q6_K)                    \
  X(Q2_K, 10, 256, 84, kFp32Kernels | kInt8Kernels | kCodeBlocks, Q2_K)       \
  X(Q3_K, 11, 256, 110, kFp32Kernels | kInt8Kernels | kCodeBlocks, Q3_K)      \
  X(IQ4_XS, 23, 256, 136, kFp32Kernels | kInt8Kernels | kCodeBlocks, IQ4_XS)  \
  X(IQ2_XXS, 16, 256, 66, kFp32Kernels | kInt8Kernels | kCodeBlocks, IQ2_XXS) \
  X(IQ2_XS, 17, 256, 74, kFp32Kernels | kInt8Kernels | kCodeBlocks, IQ2_XS)   \
  X(IQ3_XXS, 18, 256, 98, kFp32Kernels | kInt8Kernels | kCodeBlocks, IQ3_XXS) \
  X(IQ1_S, 19, 256, 50, kFp32Kernels | kInt8Kernels | kCodeBlocks, IQ1_S)     \
  X(IQ3_S, 21, 256, 110, kFp32Kernels | kInt8Kernels | kCodeBlocks, IQ3_S)    \
  X(IQ2_S, 22, 256, 82, kFp32Kernels | kInt8Kernels | kCodeBlocks, IQ2_S)     \
  X(IQ1_M, 29, 256, 56, kFp32Kernels | kInt8Kernels | kCodeBlocks, IQ1_M)     \
  X(Q4_KX8, 112, 256, 148, kX8Kernels, Q4_K)                                  \
  X(Q5_KX8, 113, 256, 180, kX8Kernels, Q5_K)                                  \
  X(Q6_KX8, 114, 256, 210, kX8Kernels, Q6_K)                                  \
  X(Q2_KX8, 115, 256, 84, kX8Kernels, Q2_K)                                   \
  X(Q3_KX8, 116, 256, 110, kX8Kernels, Q3_K)                                  \
  X(Q4_0X8, 117, 32, 18, kX8Kernels, Q4_0)                                    \
  X(Q4_1X8, 118, 32, 20, kX8Kernels, Q4_1)                                    \
  X(Q8_0X8, 119, 32, 34, kX8Kernels, Q8_0)                                    \
  X(IQ4_NLX8, 120, 32, 18, kX8Kernels, IQ4_NL)                                \
  X(IQ4_XSX8, 121, 256, 138, kX8Kernels, IQ4_XS)                              \
  X(IQ2_XXSX8, 122, 256, 70, kX8Kernels, IQ2_XXS)                             \
  X(IQ3_XXSX8, 123, 256, 102, kX8Kernels, IQ3_XXS)

// kF32, kQ4_0, ..., kIQ3_XXSX8: the type ids.
#define HYBRIDLLM_GGUF_TYPE_ID(name, id, weights, bytes, kernels, as) \
  constexpr int64_t k##name = id;
HYBRIDLLM_GGUF_TYPES(HYBRIDLLM_GGUF_TYPE_ID)
#undef HYBRIDLLM_GGUF_TYPE_ID

// "F32=0, Q4_0=2, ...": every type of the table, for messages.
#define HYBRIDLLM_GGUF_TYPE_NAME(name, id, weights, bytes, kernels, as) ", " #name "=" #id
constexpr const char* kGgufTypeNames = &(HYBRIDLLM_GGUF_TYPES(HYBRIDLLM_GGUF_TYPE_NAME))[2];
#undef HYBRIDLLM_GGUF_TYPE_NAME

// One line of the table; id -1 (no kernels, 0 bytes) for a type not in it.
struct GgufTypeInfo {
  int64_t id, unit_weights, unit_bytes;
  unsigned kernels;
  int64_t computed_as;
};

constexpr GgufTypeInfo gguf_type_info(int64_t type) {
  switch (type) {
#define HYBRIDLLM_GGUF_TYPE_INFO(name, id, weights, bytes, kernels, as) \
  case id: return {id, weights, bytes, kernels, k##as};
    HYBRIDLLM_GGUF_TYPES(HYBRIDLLM_GGUF_TYPE_INFO)
#undef HYBRIDLLM_GGUF_TYPE_INFO
    default: return {-1, kBlock, 0, 0, -1};
  }
}

constexpr bool supported_type(int64_t type) { return gguf_type_info(type).id >= 0; }

// Plain float weights (F32, F16, BF16): no scales, always fp32 activations.
constexpr bool is_float_type(int64_t type) {
  return type == kF32 || type == kF16 || type == kBF16;
}

// The 32-weight blocks of 4-bit codes in one run of 16 nibble bytes (weights 0-15 in the low
// nibbles, 16-31 in the high ones): Q4_0, Q4_1, and Q5_0 / Q5_1 (plus a fifth bit each), IQ4_NL
// and MXFP4 (codes looked up in a table).
constexpr bool is_nibble_block_type(int64_t type) {
  return type == kQ4_0 || type == kQ4_1 || type == kQ5_0 || type == kQ5_1 || type == kIQ4_NL ||
         type == kMXFP4;
}
// Where such a block's nibbles start; its fifth bits (Q5_0, Q5_1) are the 4 bytes before them.
constexpr int64_t nibble_offset(int64_t type) {
  return type == kQ4_1   ? 4
         : type == kQ5_0 ? 6
         : type == kQ5_1 ? 8
         : type == kMXFP4 ? 1
                          : 2;
}
constexpr bool has_fifth_bit(int64_t type) { return type == kQ5_0 || type == kQ5_1; }
// Types with an fp16 min m at byte 2 of each 32-weight block: w = d * q + m.
constexpr bool has_block_min(int64_t type) { return type == kQ4_1 || type == kQ5_1; }

// IQ4_NL's 16 weights (times d) a nibble stands for.
constexpr int8_t kIq4NlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                     1,    13,   25,  38,  53,  69,  89,  113};

// MXFP4's 16 weights (times d): E2M1's 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives, doubled.
constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// The 32-weight types whose nibbles index a table of signed values (IQ4_NL, MXFP4), the table;
// their codes are signed, as Q8_0's. Only MXFP4's scale is not an fp16 at byte 0 but an E8M0
// byte (has_e8m0_scale).
constexpr bool is_table_nibble_type(int64_t type) { return type == kIQ4_NL || type == kMXFP4; }
constexpr const int8_t* nibble_values(int64_t type) {
  return type == kMXFP4 ? kMxfp4Values : kIq4NlValues;
}
constexpr bool has_e8m0_scale(int64_t type) { return type == kMXFP4; }

// Whether a type is computed through its CodeBlockDecoder (gguf_code_blocks.h).
constexpr bool is_code_block_type(int64_t type) {
  return (gguf_type_info(type).kernels & kCodeBlocks) != 0;
}

// Bytes per 32 weights (Q4_K: 144 / 8). Q6_K has no whole number (210 bytes a 256-weight
// super-block), nor have the x8 groups: 0, and code that sizes or walks their rows uses
// row_bytes_of and q6_k_bits.
constexpr int64_t block_bytes(int64_t type) {
  const GgufTypeInfo t = gguf_type_info(type);
  return t.unit_bytes * kBlock % t.unit_weights == 0 ? t.unit_bytes * kBlock / t.unit_weights : 0;
}

// Weights a row's length must be a multiple of.
constexpr int64_t row_granule(int64_t type) { return gguf_type_info(type).unit_weights; }

// Bytes of one weight row of K weights.
constexpr int64_t row_bytes_of(int64_t type, int64_t K) {
  if (const int64_t bb = block_bytes(type); bb > 0) return K / kBlock * bb;
  const GgufTypeInfo t = gguf_type_info(type);
  return K / t.unit_weights * t.unit_bytes;
}

// An x8 type's source type (kQ4_KX8 -> kQ4_K) and back; -1 for others.
constexpr int64_t x8_source_type(int64_t x8_type) {
  const GgufTypeInfo t = gguf_type_info(x8_type);
  return (t.kernels & kX8Kernels) != 0 ? t.computed_as : -1;
}
constexpr int64_t x8_type_of(int64_t type) {
#define HYBRIDLLM_GGUF_X8_OF(name, id, weights, bytes, kernels, as) \
  if (((kernels) & kX8Kernels) != 0 && k##as == type) return id;
  HYBRIDLLM_GGUF_TYPES(HYBRIDLLM_GGUF_X8_OF)
#undef HYBRIDLLM_GGUF_X8_OF
  return -1;
}
constexpr bool is_x8_type(int64_t type) { return x8_source_type(type) >= 0; }

// body(std::integral_constant<int64_t, T>{}) for a `type` of the table that has the kernels
// kKernels (kFp32Kernels, kInt8Kernels or kX8Kernels), T the type its kernels are instantiated
// for (`computed as`: the type itself, or an x8 type's source type); otherwise() for any other.
// A switch inlined into the caller, once a call, as the hand-written switches it replaced were.
template <unsigned kKernels, class Body, class Otherwise>
[[gnu::always_inline]] inline auto dispatch_gguf_type(int64_t type, Body body,
                                                      Otherwise otherwise) {
  switch (type) {
#define HYBRIDLLM_GGUF_TYPE_CASE(name, id, weights, bytes, kernels, as)        \
  case id:                                                                     \
    if constexpr (((kernels) & kKernels) != 0)                                 \
      return body(std::integral_constant<int64_t, k##as>{});                   \
    else                                                                       \
      return otherwise();
    HYBRIDLLM_GGUF_TYPES(HYBRIDLLM_GGUF_TYPE_CASE)
#undef HYBRIDLLM_GGUF_TYPE_CASE
    default: return otherwise();
  }
}

}  // namespace hybridllm_gguf
