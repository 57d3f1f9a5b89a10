// Rows of x quantized to int8 for the integer dot products of gguf_q8_dot.h: groups of 32 values
// (Q4_0, Q4_1, Q8_0 weights) or 256 (K-quants), each with an fp32 scale, plus the sums the
// weights' offsets (mins, the -8 of Q4_0, the -32 of Q6_K) are multiplied with.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace hybridllm_gguf {

// A group's values x become q = round(x / d) with d = max |x| / 127 (q in [-127, 127]; ties to
// even, as torch.round: tests rebuild the same q in Python). Row r of M:
//   q[r * q_stride ...]       K int8 values, then zeros up to q_stride (a multiple of 128), so
//                             a kernel may read whole vectors past an odd last block;
//   d[r * g_stride + g]       group g's scale, zeros up to g_stride (a multiple of 16);
//   s[r * g_stride + g]       32-value groups: d * (sum of the group's q);
//   bsums[r * (K / 16) + j]   256-value groups: the sum of q over values 16 j .. 16 j + 15.
struct Q8Rows {
  const int8_t* q;
  const float* d;
  const float* s;
  const int16_t* bsums;
  int64_t q_stride, g_stride, bsum_stride;

  Q8Rows row(int64_t r) const {
    return {q + r * q_stride,
            d + r * g_stride,
            s ? s + r * g_stride : nullptr,
            bsums ? bsums + r * bsum_stride : nullptr,
            q_stride,
            g_stride,
            bsum_stride};
  }
};

// One group: q and the scale d; returns the sum of q.
inline int32_t quantize_group(const float* x, int64_t n, int8_t* q, float* d) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  __m512 amax = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16)
    amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
  const float scale = _mm512_reduce_max_ps(amax) / 127.f;
  const __m512 inverse = _mm512_set1_ps(scale > 0.f ? 1.f / scale : 0.f);
  __m512i sum = _mm512_setzero_si512();
  for (int64_t i = 0; i < n; i += 16) {
    // cvtps rounds to nearest even (the default MXCSR mode), like torch.round
    const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), inverse));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtsepi32_epi8(v));
    sum = _mm512_add_epi32(sum, v);
  }
  *d = scale;
  return _mm512_reduce_add_epi32(sum);
#elif defined(__AVX2__)
  // As above, 8 values a step (n is a multiple of 32). Scalar, a 2048-token prefill's x took a
  // fifth of the int8 GEMM's time on a 2-core Zen 3.
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 amax = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8)
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float scale = _mm_cvtss_f32(m4) / 127.f;
  const __m256 inverse = _mm256_set1_ps(scale > 0.f ? 1.f / scale : 0.f);
  __m256i sum = _mm256_setzero_si256();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), inverse));
    const __m128i words =
        _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packs_epi16(words, words));
    sum = _mm256_add_epi32(sum, v);
  }
  *d = scale;
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  return _mm_cvtsi128_si32(s4);
#else
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = amax / 127.f, inverse = scale > 0.f ? 1.f / scale : 0.f;
  int32_t sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(x[i] * inverse));  // ties to even
    q[i] = static_cast<int8_t>(v);
    sum += v;
  }
  *d = scale;
  return sum;
#endif
}

// Quantizes M rows of x [M, K] in groups of kGroup (32 or 256) into `buffer`, which it sizes;
// returns the rows' view of it. kNibbleQuads (groups of 32) stores each run of 4 groups (128
// values) as the 4 groups' first 16 values, then their last 16, zeros for groups past K: the
// order of Q4_0/Q4_1 nibbles when 4 blocks' 16 nibble bytes are loaded as one vector (low
// nibbles: their weights 0-15, high nibbles: 16-31).
template <int64_t kGroup, bool kNibbleQuads = false>
Q8Rows quantize_rows(const float* x, int64_t M, int64_t K, std::vector<uint8_t>& buffer) {
  static_assert(kGroup == 32 || kGroup == 256, "groups of 32 or 256 values");
  static_assert(!kNibbleQuads || kGroup == 32, "quads of 32-value groups");
  const int64_t groups = K / kGroup;
  const int64_t q_stride = (K + 127) / 128 * 128, g_stride = (groups + 15) / 16 * 16;
  const int64_t bsum_stride = kGroup == 256 ? K / 16 : 0;
  // q, then d, s (32) or bsums (256), each part 64-byte aligned
  const int64_t q_bytes = M * q_stride, d_bytes = M * g_stride * 4;
  const int64_t extra_bytes = kGroup == 32 ? d_bytes : (M * bsum_stride * 2 + 63) / 64 * 64;
  buffer.resize(q_bytes + d_bytes + extra_bytes + 64);
  uint8_t* base = buffer.data() + (64 - reinterpret_cast<uintptr_t>(buffer.data()) % 64) % 64;
  int8_t* q = reinterpret_cast<int8_t*>(base);
  float* d = reinterpret_cast<float*>(base + q_bytes);
  float* s = kGroup == 32 ? reinterpret_cast<float*>(base + q_bytes + d_bytes) : nullptr;
  int16_t* bsums = kGroup == 256 ? reinterpret_cast<int16_t*>(base + q_bytes + d_bytes) : nullptr;

  auto quantize_row = [&](int64_t r) {
    const float* xr = x + r * K;
    int8_t* qr = q + r * q_stride;
    float* dr = d + r * g_stride;
    std::memset(qr + K, 0, q_stride - K);
    for (int64_t g = 0; g < groups; ++g) {
      int8_t group[kGroup];
      int8_t* out = kNibbleQuads ? group : qr + g * kGroup;
      const int32_t sum = quantize_group(xr + g * kGroup, kGroup, out, dr + g);
      if constexpr (kGroup == 32) s[r * g_stride + g] = dr[g] * static_cast<float>(sum);
      if constexpr (kNibbleQuads) {
        int8_t* quad = qr + g / 4 * 128 + g % 4 * 16;
        std::memcpy(quad, group, 16);
        std::memcpy(quad + 64, group + 16, 16);
      }
    }
    if constexpr (kNibbleQuads)  // the missing groups of a last partial quad
      for (int64_t g = groups; g % 4 != 0; ++g) {
        std::memset(qr + g / 4 * 128 + g % 4 * 16, 0, 16);
        std::memset(qr + g / 4 * 128 + g % 4 * 16 + 64, 0, 16);
      }
    if constexpr (kGroup == 256) {
      for (int64_t j = 0; j < K / 16; ++j) {
        int32_t sum = 0;  // |sum| <= 16 * 127: fits int16
        for (int64_t i = 0; i < 16; ++i) sum += qr[16 * j + i];
        bsums[r * bsum_stride + j] = static_cast<int16_t>(sum);
      }
    }
    std::fill(dr + groups, dr + g_stride, 0.f);
    if constexpr (kGroup == 32) std::fill(s + r * g_stride + groups, s + (r + 1) * g_stride, 0.f);
  };
  // a few microseconds a row of 8192 values: one row stays on this thread
  at::parallel_for(0, M, M * K >= (1 << 16) ? 1 : M, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize_row(r);
  });
  return {q, d, s, bsums, q_stride, g_stride, bsum_stride};
}

}  // namespace hybridllm_gguf
