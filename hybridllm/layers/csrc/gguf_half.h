// IEEE half -> float for the blocks' fp16 scales, shared by every decoder.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__F16C__)
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

// An E8M0 exponent byte e (MXFP4's block scale) as half its power of two, 2^(e - 128) (exact:
// e < 2 are fp32 subnormals), which scales E2M1's values doubled. gguf's e8m0_to_fp32_half.
inline float e8m0_half_to_float(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

}  // namespace hybridllm_gguf
