// IEEE half -> float for the blocks' fp16 scales, shared by every decoder.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace hybridllm_gguf {

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// IEEE half -> float for one scale (exact).
inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf / nan
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);  // rebias 15 -> 127
  } else {
    const float v = static_cast<float>(mantissa) * 5.9604645e-8f;  // zero / subnormal: m * 2^-24
    return sign ? -v : v;
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

// bfloat16 -> float (exact: its bits are the float's top half).
inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// One 16-bit float of an F16 (`bf16` false) or BF16 weight row as a float (exact).
inline float half_bits_to_float(uint16_t h, bool bf16) {
  return bf16 ? bf16_to_float(h) : half_to_float(h);
}

#if defined(__AVX512F__)
// 16 consecutive F16 or BF16 values at `p` widened to floats (exact; a bfloat16 is the top
// half of its float: widened to 32 bits and shifted into place).
inline __m512 widen_halves(const uint8_t* p, bool bf16) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
              : _mm512_cvtph_ps(h);
}
#endif

// An E8M0 exponent byte e (MXFP4's block scale) as half its power of two, 2^(e - 128) (exact:
// e < 2 are fp32 subnormals), which scales E2M1's values doubled. gguf's e8m0_to_fp32_half.
inline float e8m0_half_to_float(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

}  // namespace hybridllm_gguf
