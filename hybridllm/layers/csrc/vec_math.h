// Scalar math written so the compiler vectorizes the loops that call it (glibc's expf has no
// vector form without -ffast-math, which we do not use). Shared by the CPU kernels.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace hybridllm_math {

// exp(x) for x <= 0: x = n*ln2 + r with |r| <= ln2/2, e^r by its degree-6 Taylor polynomial
// (relative error < 2e-7), times 2^n built in the exponent bits.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // below this e^x underflows fp32 anyway
  const float n = std::nearbyint(x * 1.44269504f);
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;  // ln2 split in two for accuracy
  float p = 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// x * sigmoid(x), with e^-|x| only (never overflows): sigmoid(x) = 1 / (1 + e^-x) for x >= 0,
// e^x / (1 + e^x) below.
inline float silu(float x) {
  const float e = exp_nonpositive(-std::fabs(x));
  return x * (x >= 0.f ? 1.f : e) / (1.f + e);
}

}  // namespace hybridllm_math
