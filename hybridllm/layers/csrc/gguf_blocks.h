// GGUF block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4, Q4_K, Q5_K, Q6_K; their table:
// gguf_types.h) and their
// decoding to fp32, shared by the linear kernels in gguf_linear_cpu.cpp and gguf_panel_gemm.h.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "gguf_code_blocks.h"
#include "gguf_code_decoders.h"
#include "gguf_iq_blocks.h"
#include "gguf_types.h"

namespace hybridllm_gguf {

// Bytes a row takes per super-block of 256 weights (gguf_types.h has the formats).
constexpr int64_t kSuperBytes = gguf_type_info(kQ4_K).unit_bytes;    // 144
constexpr int64_t kQ5SuperBytes = gguf_type_info(kQ5_K).unit_bytes;  // 176
constexpr int64_t kQ6SuperBytes = gguf_type_info(kQ6_K).unit_bytes;  // 210

// The 32 nibbles of 4-bit block b of a row (`row`: its first byte), as two 16-byte runs: weights
// 0-15 are the nibbles at bits `shift` of lo[0..15], weights 16-31 those of hi[0..15]. Q4_0/Q4_1
// hold them in one run (low nibbles, then high); Q4_K's sub-block pairs share 32 bytes, the
// even sub-block in the low nibbles, the odd one in the high. Q5_0, Q5_1, IQ4_NL, MXFP4: as Q4_0.
template <int64_t kType>
inline void nibble_runs(const uint8_t* row, int64_t b, const uint8_t** lo, const uint8_t** hi,
                        int* lo_shift, int* hi_shift) {
  if constexpr (kType == kQ4_K || kType == kQ5_K) {
    constexpr int64_t kSuper = kType == kQ4_K ? kSuperBytes : kQ5SuperBytes;
    constexpr int64_t kNibbles = kType == kQ4_K ? 16 : 48;  // where the nibbles start
    const uint8_t* pair = row + (b / 8) * kSuper + kNibbles + (b % 8 / 2) * 32;
    *lo = pair;
    *hi = pair + 16;
    *lo_shift = *hi_shift = (b % 2) * 4;
  } else {
    *lo = *hi = row + b * block_bytes(kType) + nibble_offset(kType);
    *lo_shift = 0;
    *hi_shift = 4;
  }
}

// Q5_0, Q5_1: the fifth bits of the block at blk, bit i weight i's.
template <int64_t kType>
inline uint32_t fifth_bits(const uint8_t* blk) {
  uint32_t bits;
  std::memcpy(&bits, blk + nibble_offset(kType) - 4, sizeof(bits));
  return bits;
}

// Q5_K: the 32 high-bit bytes of block b's super-block; block b's bits are bit b % 8.
inline const uint8_t* q5_k_high_bits(const uint8_t* row, int64_t b) {
  return row + (b / 8) * kQ5SuperBytes + 16;
}

// The first 64-byte aligned float at or after p (p is 4-byte aligned): 64-byte loads and stores
// that straddle two cache lines cost two.
inline float* align64(float* p) {
  return p + (16 - reinterpret_cast<uintptr_t>(p) / 4 % 16) % 16;
}

// A 64-byte aligned scratch of at least n floats that the calling thread keeps from call to
// call, grown as needed and never shrunk: a fresh buffer of these sizes would be mapped anew,
// and its pages faulted in, by every call. kSlot tells apart the buffers a thread holds at once.
enum ScratchSlot { kPackedXSlot, kPanelSlot, kDecodedWeightSlot };
template <ScratchSlot kSlot>
inline float* thread_scratch(size_t n) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < n + 16) buffer.resize(n + 16);
  return align64(buffer.data());
}

// Whether block_scales writes a block's min (w = d * q + m) into m: Q4_1's and Q5_1's fp16 m, a
// K-quant sub-block's -dmin * m_j (Q6_K's m holds scales, see block_scales).
constexpr bool scales_have_mins(int64_t type) {
  return has_block_min(type) || type == kQ4_K || type == kQ5_K;
}

// The fp32 scales of `count` consecutive blocks (a run of whole weight rows: the blocks of
// consecutive rows are evenly spaced too): d[i] = the fp16 at byte 0 of block i (MXFP4: its
// E8M0 byte, as e8m0_half_to_float) and, for Q4_1 and Q5_1, m[i] = the fp16 at byte 2. d and m
// have room for count rounded up to 16.
template <int64_t kType>
inline void block_scales(const uint8_t* blocks, int64_t count, float* d, float* m) {
  constexpr int64_t bb = block_bytes(kType);
  if constexpr (is_float_type(kType)) return;
  if constexpr (has_e8m0_scale(kType)) {
    for (int64_t i = 0; i < count; ++i) d[i] = e8m0_half_to_float(blocks[i * bb]);
    return;
  }
  if constexpr (kType == kQ6_K) {
    // count is a whole number of super-blocks; d holds the scale of each 32-weight block's first
    // 16 weights and m (no minimum in this format) that of its last 16
    for (int64_t s = 0; s < count / 8; ++s) {
      const uint8_t* super = blocks + s * kQ6SuperBytes;
      const float scale = half_to_float(load_u16(super + 208));
#if defined(__AVX512F__)
      // the 16 int8 scales as floats, evens (first halves) to lanes 0-7, odds to 8-15
      const __m512i evens_then_odds =
          _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
      const __m512 scales = _mm512_permutexvar_ps(
          evens_then_odds,
          _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(super + 192)))),
                        _mm512_set1_ps(scale)));
      _mm256_storeu_ps(d + s * 8, _mm512_castps512_ps256(scales));
      const __m512d upper = _mm512_castps_pd(scales);  // lanes 8-15 as the upper 256 bits
      _mm256_storeu_ps(m + s * 8, _mm256_castpd_ps(_mm512_extractf64x4_pd(upper, 1)));
#else
      const int8_t* scales = reinterpret_cast<const int8_t*>(super + 192);
      for (int j = 0; j < 8; ++j) {
        d[s * 8 + j] = scale * static_cast<float>(scales[2 * j]);
        m[s * 8 + j] = scale * static_cast<float>(scales[2 * j + 1]);
      }
#endif
    }
    return;
  }
  if constexpr (kType == kQ4_K || kType == kQ5_K) {
    constexpr int64_t kSuper = kType == kQ4_K ? kSuperBytes : kQ5SuperBytes;
    // count is a whole number of super-blocks: 8 sub-blocks each. ggml packs the 6-bit scales
    // and mins in 12 bytes q: sub-block j < 4 has scale q[j] & 63 and min q[j + 4] & 63; j >= 4
    // has scale (q[j + 4] & 15) | (q[j - 4] >> 6) << 4 and min (q[j + 4] >> 4) | (q[j] >> 6) << 4.
    // Read as three 32-bit words, that is four sub-blocks per word operation.
    constexpr uint32_t kLow6 = 0x3f3f3f3f, kLow4 = 0x0f0f0f0f, kLow2 = 0x03030303;
    for (int64_t s = 0; s < count / 8; ++s) {
      const uint8_t* super = blocks + s * kSuper;
      uint32_t w[3];
      std::memcpy(w, super + 4, sizeof(w));
      const uint32_t scales[2] = {w[0] & kLow6, (w[2] & kLow4) | (((w[0] >> 6) & kLow2) << 4)};
      const uint32_t mins[2] = {w[1] & kLow6, ((w[2] >> 4) & kLow4) | (((w[1] >> 6) & kLow2) << 4)};
      const float scale = half_to_float(load_u16(super));
      const float min_scale = -half_to_float(load_u16(super + 2));
#if defined(__AVX2__)
      const auto widen = [](const uint32_t* bytes) {  // 8 bytes -> 8 floats
        return _mm256_cvtepi32_ps(
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes))));
      };
      _mm256_storeu_ps(d + s * 8, _mm256_mul_ps(widen(scales), _mm256_set1_ps(scale)));
      _mm256_storeu_ps(m + s * 8, _mm256_mul_ps(widen(mins), _mm256_set1_ps(min_scale)));
#else
      uint8_t sc[8], mn[8];
      std::memcpy(sc, scales, 8);
      std::memcpy(mn, mins, 8);
      for (int j = 0; j < 8; ++j) {
        d[s * 8 + j] = scale * static_cast<float>(sc[j]);
        m[s * 8 + j] = min_scale * static_cast<float>(mn[j]);
      }
#endif
    }
    return;
  }
#if defined(__AVX512F__)
  // 16 blocks a step: one gather of each block's first 32-bit word (d in the low half, Q4_1's
  // m in the high half), then one 16-wide fp16 -> fp32 convert. Cheaper than scalar converts,
  // and no store-forwarding stall from writing halves one by one and reloading them as a vector.
  const __m512i index = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int>(bb)));
  for (int64_t i = 0; i < count; i += 16) {
    const int64_t n = std::min<int64_t>(16, count - i);
    const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
    const __m512i words =
        _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, index, blocks + i * bb, 1);
    _mm512_storeu_ps(d + i, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words)));
    if (has_block_min(kType))
      _mm512_storeu_ps(m + i, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(words, 16))));
  }
#else
  for (int64_t i = 0; i < count; ++i) {
    d[i] = half_to_float(load_u16(blocks + i * bb));
    if (has_block_min(kType)) m[i] = half_to_float(load_u16(blocks + i * bb + 2));
  }
#endif
}

// Q6_K: where 32-weight block b of a row keeps its bits. Super-block b / 8 holds two halves of
// 128 weights; in each, weights 32 g + l (g = 0..3, l = 0..31) take their low 4 bits from byte
// l + 32 (g % 2) of the half's 64 (low nibble for g < 2, high for g >= 2) and their top 2 bits
// from bits 2 g of byte l of the half's 32 high-bit bytes.
struct Q6Bits {
  const uint8_t* low;   // 32 bytes
  const uint8_t* high;  // 32 bytes
  int low_shift, high_shift;
};
inline Q6Bits q6_k_bits(const uint8_t* row, int64_t b) {
  const uint8_t* super = row + (b / 8) * kQ6SuperBytes;
  const int half = static_cast<int>(b % 8) / 4, g = static_cast<int>(b % 4);
  return {super + half * 64 + (g % 2) * 32, super + 128 + half * 32, (g / 2) * 4, 2 * g};
}

#if defined(__AVX2__)
// A Q6_K block's 32 weights as signed bytes q - 32, in [-32, 31]: the 6-bit values put together
// 32 at a time (16-bit shifts: what crosses into a byte from its neighbour is masked off).
inline __m256i q6_k_codes(const Q6Bits& bits) {
  const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits.low));
  const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits.high));
  const __m256i low4 = _mm256_and_si256(_mm256_srl_epi16(low, _mm_cvtsi32_si128(bits.low_shift)),
                                        _mm256_set1_epi8(15));
  const __m256i high2 = _mm256_and_si256(
      _mm256_srl_epi16(high, _mm_cvtsi32_si128(bits.high_shift)), _mm256_set1_epi8(3));
  return _mm256_sub_epi8(_mm256_or_si256(low4, _mm256_slli_epi16(high2, 4)),
                         _mm256_set1_epi8(32));
}

// 8 floats summed.
inline float sum8(__m256 v) {
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
#endif

#if defined(__AVX512F__)
// The 16 bytes at p, each zero-extended into a 32-bit lane.
inline __m512i widen_bytes(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// A Q6_K block's 32 weights as floats q - 32 (weights 0-15 in lo, 16-31 in hi): the 6-bit values
// are put together as bytes (q6_k_codes), and only then widened.
inline void q6_k_values(const Q6Bits& bits, __m512* lo, __m512* hi) {
  const __m256i q = q6_k_codes(bits);
  *lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
  *hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
}
#endif

#if defined(__AVX512F__)
// The fp32 weights a 4-bit block's nibble values 0-15 stand for, a table for vpermps (which
// reads each index's low 4 bits): d (q - 8) for Q4_0, d (q - 16) for Q5_0, d values[q] for
// IQ4_NL and MXFP4 (nibble_values), else d q + m (a K-quant's m the negative min). Q5_0 / Q5_1
// also set *upper (if given) to the weights of 5-bit values 16-31, for vpermt2ps with the fifth
// bit as bit 4 of the index. Every product d q is exact in fp32 (an fp16 d times at most 8
// bits), so d q + m in one rounding is gguf's (d * q) + m.
template <int64_t kType>
inline __m512 nibble_table(float d, float m, __m512* upper = nullptr) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 scale = _mm512_set1_ps(d);
  if constexpr (kType == kQ4_0)
    return _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(8.f)), scale);
  if constexpr (is_table_nibble_type(kType)) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                             reinterpret_cast<const __m128i*>(nibble_values(kType))))),
                         scale);
  }
  if constexpr (kType == kQ5_0) {
    if (upper) *upper = _mm512_mul_ps(iota, scale);
    return _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(16.f)), scale);
  }
  if constexpr (kType == kQ5_1)
    if (upper)
      *upper = _mm512_fmadd_ps(_mm512_add_ps(iota, _mm512_set1_ps(16.f)), scale, _mm512_set1_ps(m));
  return _mm512_fmadd_ps(iota, scale, _mm512_set1_ps(m));
}

// Q5_0, Q5_1: 16 nibbles (int32 lanes, 0-15) with their fifth bits (bits of `fifth`) decoded
// through nibble_table's two halves.
inline __m512 fifth_bit_lookup(__m512i nibbles, uint32_t fifth, __m512 table, __m512 upper) {
  const __m512i index = _mm512_mask_or_epi32(nibbles, static_cast<__mmask16>(fifth), nibbles,
                                             _mm512_set1_epi32(16));
  return _mm512_permutex2var_ps(table, index, upper);
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HYBRIDLLM_FP32_AVX2 1
// AVX2 without AVX-512: block b of a row (`row`: its first byte; d, m its block_scales) decoded
// into four 8-lane vectors, weights 0-7 to 24-31. A quantized block is first put together as 32
// signed byte codes (q - 8 for Q4_0, q - 16 for Q5_0, Q6_K's q - 32, the table's values for IQ4_NL
// and MXFP4), then widened: d q, or d q + m in one rounding where the type has a min (d q is
// exact, see nibble_table), so the weights are dequantize_row's bit for bit.
template <int64_t kType>
inline void decode_block8(const uint8_t* row, int64_t b, float d, float m, __m256 out[4]) {
  constexpr int64_t bb = block_bytes(kType);
  const uint8_t* blk = row + b * bb;
  const auto load16 = [](const uint8_t* p) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  };
  if constexpr (kType == kF32) {
    for (int q = 0; q < 4; ++q)
      out[q] = _mm256_loadu_ps(reinterpret_cast<const float*>(blk) + 8 * q);
    return;
  } else if constexpr (kType == kF16) {
    for (int q = 0; q < 4; ++q) out[q] = _mm256_cvtph_ps(load16(blk + 16 * q));
    return;
  } else if constexpr (kType == kBF16) {
    for (int q = 0; q < 4; ++q)
      out[q] = _mm256_castsi256_ps(
          _mm256_slli_epi32(_mm256_cvtepu16_epi32(load16(blk + 16 * q)), 16));
    return;
  } else {
    __m256i codes;  // [32] int8
    if constexpr (kType == kQ8_0) {
      codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    } else if constexpr (kType == kQ6_K) {
      codes = q6_k_codes(q6_k_bits(row, b));
    } else {
      const uint8_t *lo, *hi;
      int lo_shift, hi_shift;
      nibble_runs<kType>(row, b, &lo, &hi, &lo_shift, &hi_shift);
      const __m128i nibble = _mm_set1_epi8(15);
      codes = _mm256_set_m128i(
          _mm_and_si128(_mm_srl_epi16(load16(hi), _mm_cvtsi32_si128(hi_shift)), nibble),
          _mm_and_si128(_mm_srl_epi16(load16(lo), _mm_cvtsi32_si128(lo_shift)), nibble));
      const __m256i sixteen = _mm256_set1_epi8(16);
      if constexpr (kType == kQ5_K) {
        // weight j's fifth bit: bit b % 8 of high-bit byte j
        const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << (b % 8)));
        const __m256i high = _mm256_and_si256(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q5_k_high_bits(row, b))), bit);
        codes = _mm256_or_si256(codes, _mm256_and_si256(_mm256_cmpeq_epi8(high, bit), sixteen));
      }
      if constexpr (has_fifth_bit(kType)) {
        // weight j's fifth bit: bit j of the 32-bit word, spread to byte j
        const __m256i spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(static_cast<int>(fifth_bits<kType>(blk))),
            _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
        const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
        codes = _mm256_or_si256(
            codes, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select),
                                    sixteen));
      }
      if constexpr (kType == kQ4_0) codes = _mm256_sub_epi8(codes, _mm256_set1_epi8(8));
      if constexpr (kType == kQ5_0) codes = _mm256_sub_epi8(codes, sixteen);
      if constexpr (is_table_nibble_type(kType))
        codes = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(load16(
                                        reinterpret_cast<const uint8_t*>(nibble_values(kType)))),
                                    codes);
    }
    const __m128i first = _mm256_castsi256_si128(codes), last = _mm256_extracti128_si256(codes, 1);
    const __m128i quarters[4] = {first, _mm_unpackhi_epi64(first, first), last,
                                 _mm_unpackhi_epi64(last, last)};
    for (int q = 0; q < 4; ++q) {
      const __m256 value = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(quarters[q]));
      // Q6_K: d scales weights 0-15, m weights 16-31 (see block_scales)
      const __m256 scale = _mm256_set1_ps(kType == kQ6_K && q >= 2 ? m : d);
      out[q] = scales_have_mins(kType) ? _mm256_fmadd_ps(value, scale, _mm256_set1_ps(m))
                                       : _mm256_mul_ps(value, scale);
    }
  }
}
#endif

inline int q6_k_value(const Q6Bits& bits, int l) {
  const int low = (bits.low[l] >> bits.low_shift) & 15;
  const int high = (bits.high[l] >> bits.high_shift) & 3;
  return (low | high << 4) - 32;
}

// Decodes one weight row [K] (nb blocks) into fp32, bit for bit what gguf.quants.dequantize
// gives (see nibble_table).
template <int64_t kType>
void dequantize_row(const uint8_t* row, int64_t nb, float* out, float* d, float* m) {
  constexpr int64_t bb = block_bytes(kType);
  if constexpr (kType == kF32) {
    std::memcpy(out, row, nb * bb);
    return;
  }
  if constexpr (kType == kF16 || kType == kBF16) {
    int64_t j = 0;
#if defined(__AVX512F__)
    for (; j + 16 <= nb * kBlock; j += 16)
      _mm512_storeu_ps(out + j, widen_halves(row + 2 * j, kType == kBF16));
#endif
    for (; j < nb * kBlock; ++j) out[j] = half_bits_to_float(load_u16(row + 2 * j), kType == kBF16);
    return;
  }
  if constexpr (is_code_block_type(kType)) {
    constexpr int64_t kSuper = gguf_type_info(kType).unit_bytes;
    CodeBlock cb;
    for (int64_t s = 0; s < nb * kBlock / kCodeBlockWeights; ++s) {
      CodeBlockDecoder<kType>::decode(row + s * kSuper, &cb);
      float* o = out + s * kCodeBlockWeights;
#if defined(__AVX512F__)
      // (d * scale) * code + (dmin * min): gguf's order of roundings, the product rounded
      // before the add (the empty asm keeps the compiler from fusing them into an FMA)
      const __m512 scales = _mm512_mul_ps(
          _mm512_set1_ps(cb.d),
          _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(
              _mm256_load_si256(reinterpret_cast<const __m256i*>(cb.scales)))));
      const __m512 mins = _mm512_mul_ps(
          _mm512_set1_ps(cb.dmin),
          _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(
              _mm256_load_si256(reinterpret_cast<const __m256i*>(cb.mins)))));
      alignas(64) float unit_scales[16], unit_mins[16];
      _mm512_store_ps(unit_scales, scales);
      _mm512_store_ps(unit_mins, mins);
      for (int64_t u = 0; u < kCodeBlockWeights / kCodeUnit; ++u) {
        const __m512 codes = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_load_si128(reinterpret_cast<const __m128i*>(cb.codes + u * kCodeUnit))));
        __m512 product = _mm512_mul_ps(_mm512_set1_ps(unit_scales[u]), codes);
        asm("" : "+v"(product));
        _mm512_storeu_ps(o + u * kCodeUnit, _mm512_add_ps(product, _mm512_set1_ps(unit_mins[u])));
      }
#else
      for (int64_t u = 0; u < kCodeBlockWeights / kCodeUnit; ++u) {
        // (d * scale) * code + (dmin * min): gguf's order of roundings
        const float scale = cb.d * static_cast<float>(cb.scales[u]);
        const float min = cb.dmin * static_cast<float>(cb.mins[u]);
        for (int64_t i = 0; i < kCodeUnit; ++i) {
#if defined(__x86_64__)
          float product = scale * static_cast<float>(cb.codes[u * kCodeUnit + i]);
          asm("" : "+x"(product));  // rounded before the add, as above
#else
          volatile float product = scale * static_cast<float>(cb.codes[u * kCodeUnit + i]);
#endif
          o[u * kCodeUnit + i] = product + min;
        }
      }
#endif
    }
    return;
  }
  block_scales<kType>(row, nb, d, m);
  if constexpr (kType == kQ6_K) {
    for (int64_t b = 0; b < nb; ++b) {
      const Q6Bits bits = q6_k_bits(row, b);
      float* o = out + b * kBlock;
#if defined(__AVX512F__)
      __m512 lo, hi;
      q6_k_values(bits, &lo, &hi);
      _mm512_storeu_ps(o, _mm512_mul_ps(lo, _mm512_set1_ps(d[b])));
      _mm512_storeu_ps(o + 16, _mm512_mul_ps(hi, _mm512_set1_ps(m[b])));
#else
      for (int l = 0; l < 16; ++l) o[l] = d[b] * static_cast<float>(q6_k_value(bits, l));
      for (int l = 16; l < 32; ++l) o[l] = m[b] * static_cast<float>(q6_k_value(bits, l));
#endif
    }
    return;
  }
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * bb;
    float* o = out + b * kBlock;
#if defined(__AVX512F__)
    if constexpr (kType == kQ8_0) {
      const __m512 scale = _mm512_set1_ps(d[b]);
      for (int h = 0; h < 2; ++h) {
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 + 16 * h));
        const __m512 qf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
        _mm512_storeu_ps(o + 16 * h, _mm512_mul_ps(qf, scale));
      }
    } else {
      // table[i] = the weight a nibble i stands for; vpermps indexes it by each lane's low 4 bits
      __m512 upper;
      const __m512 table = nibble_table<kType>(d[b], m[b], &upper);
      const uint8_t *lo, *hi;
      int lo_shift, hi_shift;
      nibble_runs<kType>(row, b, &lo, &hi, &lo_shift, &hi_shift);
      const __m512i qlo =
          _mm512_and_si512(_mm512_srli_epi32(widen_bytes(lo), lo_shift), _mm512_set1_epi32(15));
      const __m512i qhi =
          _mm512_and_si512(_mm512_srli_epi32(widen_bytes(hi), hi_shift), _mm512_set1_epi32(15));
      if constexpr (kType == kQ5_K) {
        // the fifth bit picks the upper table: weights 16-31 of the block's range
        const uint8_t* bits = q5_k_high_bits(row, b);
        const int bit = static_cast<int>(b % 8);
        const __m512 q5_k_upper = _mm512_add_ps(table, _mm512_set1_ps(16.f * d[b]));
        const auto index = [&](__m512i nibbles, const uint8_t* high) {
          const __m512i fifth = _mm512_and_si512(_mm512_srli_epi32(widen_bytes(high), bit),
                                                 _mm512_set1_epi32(1));
          return _mm512_or_si512(nibbles, _mm512_slli_epi32(fifth, 4));
        };
        _mm512_storeu_ps(o, _mm512_permutex2var_ps(table, index(qlo, bits), q5_k_upper));
        _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(table, index(qhi, bits + 16), q5_k_upper));
        continue;
      }
      if constexpr (has_fifth_bit(kType)) {
        const uint32_t fifth = fifth_bits<kType>(blk);
        _mm512_storeu_ps(o, fifth_bit_lookup(qlo, fifth, table, upper));
        _mm512_storeu_ps(o + 16, fifth_bit_lookup(qhi, fifth >> 16, table, upper));
        continue;
      }
      _mm512_storeu_ps(o, _mm512_permutexvar_ps(qlo, table));
      _mm512_storeu_ps(o + 16, _mm512_permutexvar_ps(qhi, table));
    }
#else
    if constexpr (kType == kQ8_0) {
      const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
      for (int j = 0; j < 32; ++j) o[j] = d[b] * static_cast<float>(q[j]);
    } else {
      const uint8_t *lo, *hi;
      int lo_shift, hi_shift;
      nibble_runs<kType>(row, b, &lo, &hi, &lo_shift, &hi_shift);
      const uint8_t* bits = kType == kQ5_K ? q5_k_high_bits(row, b) : nullptr;
      const uint32_t fifth = has_fifth_bit(kType) ? fifth_bits<kType>(blk) : 0;
      for (int j = 0; j < 16; ++j) {
        int q0 = (lo[j] >> lo_shift) & 15, q1 = (hi[j] >> hi_shift) & 15;
        if (kType == kQ5_K) {
          q0 |= ((bits[j] >> (b % 8)) & 1) << 4;
          q1 |= ((bits[j + 16] >> (b % 8)) & 1) << 4;
        }
        if (has_fifth_bit(kType)) {
          q0 |= ((fifth >> j) & 1) << 4;
          q1 |= ((fifth >> (j + 16)) & 1) << 4;
        }
        if constexpr (kType == kQ4_0 || kType == kQ5_0) {
          const int offset = kType == kQ4_0 ? 8 : 16;
          o[j] = d[b] * static_cast<float>(q0 - offset);
          o[j + 16] = d[b] * static_cast<float>(q1 - offset);
        } else if constexpr (is_table_nibble_type(kType)) {
          o[j] = d[b] * static_cast<float>(nibble_values(kType)[q0]);
          o[j + 16] = d[b] * static_cast<float>(nibble_values(kType)[q1]);
        } else {
          o[j] = d[b] * static_cast<float>(q0) + m[b];
          o[j + 16] = d[b] * static_cast<float>(q1) + m[b];
        }
      }
    }
#endif
  }
}

}  // namespace hybridllm_gguf
