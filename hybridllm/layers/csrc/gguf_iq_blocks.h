// The CodeBlockDecoder (gguf_code_blocks.h) of each grid type: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS,
// IQ2_S, IQ3_XXS, IQ3_S, whose weights are groups of 4 or 8 values looked up in a grid
// (gguf_iq_grids.h) with signs.
//
// Formats (byte offsets in a super-block of 256 weights; d an fp16; "group" 8 weights):
//   IQ2_XXS  66 B: d, then per 32 weights 4 grid indices (bytes) and a uint32 whose bits
//            7i..7i+6 index the sign table for group i and whose top 4 bits are s;
//            w = d * (0.5 + s) / 4 * grid * sign.
//   IQ2_XS   74 B: d, 32 uint16 (9-bit grid index, 7-bit sign index) a group, 8 bytes of
//            4-bit s (one per 16 weights, low nibble first); w as IQ2_XXS.
//   IQ2_S    82 B: d, 32 low index bytes, 32 sign bytes (bit k: weight k of the group), 8 bytes
//            of 2-bit high index parts (bits 2i of byte j: group 4j + i), 8 bytes of 4-bit s
//            per 16 weights; w as IQ2_XXS over a 1024-entry grid.
//   IQ3_XXS  98 B: d, 64 grid indices (4 weights each), then per 32 weights a uint32 of four
//            7-bit sign indices and a 4-bit s; w = d * (0.5 + s) / 2 * grid * sign.
//   IQ3_S   110 B: d, 64 low index bytes, 8 bytes of high index bits (bit k of byte j: entry
//            8j + k), 32 sign bytes, 4 bytes of 4-bit s per 32 weights; w = d (1 + 2s) grid sign.
//   IQ1_S    50 B: d, 32 low index bytes, 8 uint16 per 32 weights: 3 high index bits a group
//            (bits 3i), 3-bit s (bits 12-14), delta sign (bit 15);
//            w = d (2s + 1) (grid + delta), grid in {-1, 0, 1}, delta = +-1/8.
//   IQ1_M    56 B: 32 low index bytes, 16 bytes of a nibble a group (3 high index bits, delta
//            sign in bit 3; low nibble first), 4 uint16 of four 3-bit s each (one per 16
//            weights, bits 3i of word j: s of the 16 weights 4j + i) whose top nibbles hold d
//            (word j's bits 12-15 are d's bits 4j..4j+3); w as IQ1_S.
//
// Exactly as gguf.quants computes them: its per-group factor (e.g. d * (0.5 + s) * 0.25) is
// d' * (2s + 1) with d' = d / 8 a power-of-two multiple of d (exact, fp16 d being far from
// fp32's range limits), so fp32 rounds (d' * (2s + 1)) exactly as it rounds gguf's product, and
// the code's product with it as gguf's product with the grid value (signs are exact). IQ1's
// grid + delta is (8 g +- 1) / 8: code 8 g +- 1 with d' = d / 8.
//
// A decoder unpacks its super-block into grid indices, a sign byte a group and the 16 scales
// (plain scalar code), then expands the indices through the grid: AVX-512BW (gathers, masked
// negation), AVX2 (gathers, compare-made masks) or scalar, chosen at compile time; all three
// write the same codes.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "gguf_code_blocks.h"
#include "gguf_iq_grids.h"

namespace hybridllm_gguf {

namespace iq {

inline uint16_t load16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline uint32_t load32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// IEEE half -> float (exact).
inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else {
    const float v = static_cast<float>(mantissa) * 5.9604645e-8f;  // m * 2^-24
    return sign ? -v : v;
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

// A super-block unpacked: grid entry indices (32 of 8 weights or 64 of 4), and a byte a group
// of 8 weights (bit k for weight k): the sign bits (negate), or for IQ1 the delta's sign
// (all 8 bits set when the group's delta is -1/8).
struct Unpacked {
  alignas(64) uint32_t index[64];
  alignas(32) uint8_t signs[32];
};

// Writes scales[2u], scales[2u + 1] (the two 16-weight units of 32 weights u) = 2 s + 1.
inline void set_scale32(CodeBlock* out, int u, int s) {
  out->scales[2 * u] = out->scales[2 * u + 1] = static_cast<int16_t>(2 * s + 1);
}

inline void clear_mins(CodeBlock* out) {
  std::memset(out->mins, 0, sizeof(out->mins));
  out->dmin = 0.0f;
}

// codes[8g + k] for the 32 groups g: the grid's values at the unpacked indices, negated where
// the group's sign bit k is set; kDelta (IQ1): instead value + 1, or value - 1 where it is set.
// kWidth: 8 (a uint64_t grid, 32 indices) or 4 (a uint32_t grid, 64 indices).
template <int kWidth, bool kDelta, class Entry>
inline void expand(const Entry* grid, const Unpacked& u, int8_t* codes) {
  static_assert(kWidth == 8 || kWidth == 4, "grids of 8 or 4 values");
#if defined(__AVX512BW__)
  const __m512i zero = _mm512_setzero_si512();
  for (int c = 0; c < 4; ++c) {  // 64 codes a step
    __m512i v;
    if constexpr (kWidth == 8) {
      const __m256i vi = _mm256_load_si256(reinterpret_cast<const __m256i*>(u.index + 8 * c));
      v = _mm512_i32gather_epi64(vi, grid, 8);
    } else {
      const __m512i vi = _mm512_load_si512(u.index + 16 * c);
      v = _mm512_i32gather_epi32(vi, grid, 4);
    }
    uint64_t bits;
    std::memcpy(&bits, u.signs + 8 * c, sizeof(bits));
    const __mmask64 m = _cvtu64_mask64(bits);
    if constexpr (kDelta) {
      v = _mm512_add_epi8(v, _mm512_set1_epi8(1));
      v = _mm512_mask_sub_epi8(v, m, v, _mm512_set1_epi8(2));
    } else {
      v = _mm512_mask_sub_epi8(v, m, zero, v);
    }
    _mm512_storeu_si512(codes + 64 * c, v);
  }
#elif defined(__AVX2__)
  // Sign byte j of the 4 broadcast into bytes 8j..8j+7, then bit k of byte 8j + k tested.
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  //
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  for (int c = 0; c < 8; ++c) {  // 32 codes a step
    __m256i v;
    if constexpr (kWidth == 8) {
      const __m128i vi = _mm_load_si128(reinterpret_cast<const __m128i*>(u.index + 4 * c));
      v = _mm256_i32gather_epi64(reinterpret_cast<const long long*>(grid), vi, 8);
    } else {
      const __m256i vi = _mm256_load_si256(reinterpret_cast<const __m256i*>(u.index + 8 * c));
      v = _mm256_i32gather_epi32(reinterpret_cast<const int*>(grid), vi, 4);
    }
    const __m256i s = _mm256_shuffle_epi8(
        _mm256_set1_epi32(static_cast<int>(load32(u.signs + 4 * c))), spread);
    const __m256i m = _mm256_cmpeq_epi8(_mm256_and_si256(s, bit), bit);
    if constexpr (kDelta)
      v = _mm256_sub_epi8(_mm256_add_epi8(v, _mm256_set1_epi8(1)),
                          _mm256_and_si256(m, _mm256_set1_epi8(2)));
    else
      v = _mm256_sub_epi8(_mm256_xor_si256(v, m), m);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 32 * c), v);
  }
#else
  for (int g = 0; g < 32; ++g) {
    uint64_t values;
    if constexpr (kWidth == 8)
      values = grid[u.index[g]];
    else
      values = grid[u.index[2 * g]] | static_cast<uint64_t>(grid[u.index[2 * g + 1]]) << 32;
    for (int k = 0; k < 8; ++k) {
      const int v = static_cast<int8_t>(values >> (8 * k));
      const bool set = (u.signs[g] >> k) & 1;
      codes[8 * g + k] = static_cast<int8_t>(kDelta ? (set ? v - 1 : v + 1) : (set ? -v : v));
    }
  }
#endif
}

}  // namespace iq

template <>
struct CodeBlockDecoder<kIQ2_XXS> {
  static constexpr bool kHasMins = false;
  static void decode(const uint8_t* super, CodeBlock* out) {
    iq::Unpacked u;
    for (int j = 0; j < 8; ++j) {  // 32 weights a step
      const uint8_t* q = super + 2 + 8 * j;
      const uint32_t aux = iq::load32(q + 4);
      for (int i = 0; i < 4; ++i) {
        u.index[4 * j + i] = q[i];
        u.signs[4 * j + i] = kIQSigns[(aux >> (7 * i)) & 127];
      }
      iq::set_scale32(out, j, static_cast<int>(aux >> 28));
    }
    out->d = iq::half_to_float(iq::load16(super)) * 0.125f;
    iq::clear_mins(out);
    iq::expand<8, false>(kIQ2XXSGrid, u, out->codes);
  }
};

template <>
struct CodeBlockDecoder<kIQ2_XS> {
  static constexpr bool kHasMins = false;
  static void decode(const uint8_t* super, CodeBlock* out) {
    iq::Unpacked u;
    for (int g = 0; g < 32; ++g) {
      const uint16_t q = iq::load16(super + 2 + 2 * g);
      u.index[g] = q & 511;
      u.signs[g] = kIQSigns[q >> 9];
    }
    for (int j = 0; j < 8; ++j) {
      const uint8_t s = super[66 + j];
      out->scales[2 * j] = static_cast<int16_t>(2 * (s & 15) + 1);
      out->scales[2 * j + 1] = static_cast<int16_t>(2 * (s >> 4) + 1);
    }
    out->d = iq::half_to_float(iq::load16(super)) * 0.125f;
    iq::clear_mins(out);
    iq::expand<8, false>(kIQ2XSGrid, u, out->codes);
  }
};

template <>
struct CodeBlockDecoder<kIQ2_S> {
  static constexpr bool kHasMins = false;
  static void decode(const uint8_t* super, CodeBlock* out) {
    iq::Unpacked u;
    const uint8_t* qs = super + 2;
    const uint8_t* qh = super + 66;
    for (int g = 0; g < 32; ++g) u.index[g] = qs[g] | ((qh[g / 4] >> (2 * (g % 4))) & 3) << 8;
    std::memcpy(u.signs, super + 34, 32);
    for (int j = 0; j < 8; ++j) {
      const uint8_t s = super[74 + j];
      out->scales[2 * j] = static_cast<int16_t>(2 * (s & 15) + 1);
      out->scales[2 * j + 1] = static_cast<int16_t>(2 * (s >> 4) + 1);
    }
    out->d = iq::half_to_float(iq::load16(super)) * 0.125f;
    iq::clear_mins(out);
    iq::expand<8, false>(kIQ2SGrid, u, out->codes);
  }
};

template <>
struct CodeBlockDecoder<kIQ3_XXS> {
  static constexpr bool kHasMins = false;
  static void decode(const uint8_t* super, CodeBlock* out) {
    iq::Unpacked u;
    for (int e = 0; e < 64; ++e) u.index[e] = super[2 + e];
    for (int j = 0; j < 8; ++j) {  // 32 weights a step
      const uint32_t aux = iq::load32(super + 66 + 4 * j);
      for (int i = 0; i < 4; ++i) u.signs[4 * j + i] = kIQSigns[(aux >> (7 * i)) & 127];
      iq::set_scale32(out, j, static_cast<int>(aux >> 28));
    }
    out->d = iq::half_to_float(iq::load16(super)) * 0.25f;
    iq::clear_mins(out);
    iq::expand<4, false>(kIQ3XXSGrid, u, out->codes);
  }
};

template <>
struct CodeBlockDecoder<kIQ3_S> {
  static constexpr bool kHasMins = false;
  static void decode(const uint8_t* super, CodeBlock* out) {
    iq::Unpacked u;
    const uint8_t* qs = super + 2;
    const uint8_t* qh = super + 66;
    for (int e = 0; e < 64; ++e) u.index[e] = qs[e] | ((qh[e / 8] >> (e % 8)) & 1) << 8;
    std::memcpy(u.signs, super + 74, 32);
    for (int j = 0; j < 4; ++j) {
      const uint8_t s = super[106 + j];
      iq::set_scale32(out, 2 * j, s & 15);
      iq::set_scale32(out, 2 * j + 1, s >> 4);
    }
    out->d = iq::half_to_float(iq::load16(super));
    iq::clear_mins(out);
    iq::expand<4, false>(kIQ3SGrid, u, out->codes);
  }
};

template <>
struct CodeBlockDecoder<kIQ1_S> {
  static constexpr bool kHasMins = false;
  static void decode(const uint8_t* super, CodeBlock* out) {
    iq::Unpacked u;
    const uint8_t* qs = super + 2;
    for (int j = 0; j < 8; ++j) {  // 32 weights a step
      const uint16_t h = iq::load16(super + 34 + 2 * j);
      const uint8_t delta = (h & 0x8000) ? 0xff : 0;
      for (int i = 0; i < 4; ++i) {
        u.index[4 * j + i] = qs[4 * j + i] | ((h >> (3 * i)) & 7) << 8;
        u.signs[4 * j + i] = delta;
      }
      iq::set_scale32(out, j, (h >> 12) & 7);
    }
    out->d = iq::half_to_float(iq::load16(super)) * 0.125f;
    iq::clear_mins(out);
    iq::expand<8, true>(kIQ1Grid8, u, out->codes);
  }
};

template <>
struct CodeBlockDecoder<kIQ1_M> {
  static constexpr bool kHasMins = false;
  static void decode(const uint8_t* super, CodeBlock* out) {
    iq::Unpacked u;
    const uint8_t* qh = super + 32;
    for (int g = 0; g < 32; ++g) {
      const int nibble = (qh[g / 2] >> (4 * (g % 2))) & 15;
      u.index[g] = super[g] | (nibble & 7) << 8;
      u.signs[g] = (nibble & 8) ? 0xff : 0;
    }
    uint16_t sc[4];
    for (int j = 0; j < 4; ++j) {
      sc[j] = iq::load16(super + 48 + 2 * j);
      for (int i = 0; i < 4; ++i)
        out->scales[4 * j + i] = static_cast<int16_t>(2 * ((sc[j] >> (3 * i)) & 7) + 1);
    }
    const uint16_t d = (sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) |
                       (sc[3] & 0xf000);
    out->d = iq::half_to_float(d) * 0.125f;
    iq::clear_mins(out);
    iq::expand<8, true>(kIQ1Grid8, u, out->codes);
  }
};

}  // namespace hybridllm_gguf
