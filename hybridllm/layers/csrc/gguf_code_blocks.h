// GGUF types computed as "code blocks": each super-block of 256 weights is decoded into signed
// int8 codes with an integer scale (and min) per 16 weights and two fp32 factors,
//   w[i] = d * scale[i / 16] * code[i] + dmin * min[i / 16],
// and the int8 dot products, the int8 GEMM and the fp32 decoding are written once over that form.
// Each type contributes only its decoder (a CodeBlockDecoder specialisation): Q2_K, Q3_K and
// IQ4_XS in gguf_code_decoders.h, the grid types (IQ1_S ... IQ3_S) in gguf_iq_blocks.h.
#pragma once

#include <cstdint>

#include "gguf_half.h"
#include "gguf_types.h"

namespace hybridllm_gguf {

constexpr int64_t kCodeBlockWeights = 256;
constexpr int64_t kCodeUnit = 16;  // weights a scale (and a min)

// One decoded super-block. Bounds the kernels rely on: |code| <= 127 (vpmaddubsw pairs of
// |code| * |x| stay within int16), |scale| <= 127 and 0 <= min <= 255.
struct CodeBlock {
  alignas(64) int8_t codes[kCodeBlockWeights];
  alignas(32) int16_t scales[kCodeBlockWeights / kCodeUnit];
  alignas(32) int16_t mins[kCodeBlockWeights / kCodeUnit];  // all 0 where the type has none
  float d;     // the codes' factor: w = d * scale * code (+ dmin * min)
  float dmin;  // the mins' factor (0 where the type has none)
};

// decode(super, out): the 256 weights of the super-block at `super` (gguf_type_info(kType)
// .unit_bytes bytes) into *out, computing what gguf.quants.dequantize computes once multiplied
// out as (d * scale) * code + (dmin * min) in fp32. kHasMins: whether mins are ever nonzero.
// Optionally kCodeOffset: an offset that makes every code of the type nonnegative and at most 128
// (the int8 kernels then multiply code + offset as unsigned bytes and take offset * scale times
// x's sums off, instead of applying the codes' signs to x; gguf_q8_dot.h's code_offset).
// Optionally kMaxCode: a bound on |code| below 128 (the grid types' values), so that the int8
// GEMM adds more than one of vpmaddubsw's pair sums in int16 (gguf_q8_dot.h's code_bound).
template <int64_t kType>
struct CodeBlockDecoder;

}  // namespace hybridllm_gguf
