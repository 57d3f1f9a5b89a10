// The CodeBlockDecoder (gguf_code_blocks.h) of each K-quant type computed as code blocks: Q2_K,
// Q3_K, and IQ4_XS (its non-linear 4-bit values). Layouts as gguf.quants' dequantize_blocks reads
// them; weight i of a super-block is weight i % 16 of unit i / 16.
//   Q2_K    84 bytes: 16 bytes of unit scales (low nibble) and mins (high nibble), 64 bytes of
//           2-bit q (weight 128 n + 32 j + l: bits 2 j of byte 32 n + l), fp16 d, fp16 dmin;
//           w = d * sc * q - dmin * m: codes q, scales sc, mins m, dmin stored negated.
//   Q3_K    110 bytes: 32 hmask bytes (weight i: bit i / 32 of byte i % 32), 64 bytes of 2-bit q
//           (as Q2_K's), 12 bytes of 6-bit unit scales (unit k: its low 4 bits the low nibble
//           of byte k % 8 for k < 8, else the high one; its top 2 at bits 2 (k / 4) of byte
//           8 + k % 4),
//           fp16 d; w = d * (sc - 32) * (q - 4 where the hmask bit is clear).
//   IQ4_XS  136 bytes: fp16 d, uint16 scales_h, 4 bytes scales_l, 128 bytes of nibbles; 32-weight
//           sub-block j: ls = nibble j % 2 of scales_l[j / 2] | bits 2 j of scales_h << 4, its
//           weights the low then the high nibbles of bytes 16 j .. 16 j + 15, w = d * (ls - 32) *
//           kIq4Values[nibble].
// kCodeOffset: Q2_K's codes are 0 .. 3, Q3_K's -4 .. 3. Types without mins store dmin = -0:
// (d * scale) * code + (-0 * 0) is then the product itself, its zeros' signs included.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "gguf_code_blocks.h"

namespace hybridllm_gguf {

namespace code_decoders {

// The 2-bit fields of Q2_K / Q3_K's 64 bytes qs (weight 128 n + 32 j + l: bits 2 j of
// qs[32 n + l]) as bytes. AVX-512: codes 64 z .. 64 z + 63 (half n = z / 2, fields j = 2 (z % 2)
// and 2 (z % 2) + 1), stored 64 at a time, the width the kernels load them at; AVX2: codes
// 32 b .. 32 b + 31. 16-bit shifts: what crosses from the neighbour byte is masked off.
#if defined(__AVX512F__) && defined(__AVX512BW__)
inline __m512i two_bit_codes64(const uint8_t* qs, int z) {
  const __m512i v = _mm512_broadcast_i64x4(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (z / 2))));
  const __m512i shifts =
      _mm512_inserti64x4(_mm512_set1_epi16(static_cast<short>(4 * (z % 2))),
                         _mm256_set1_epi16(static_cast<short>(4 * (z % 2) + 2)), 1);
  return _mm512_and_si512(_mm512_srlv_epi16(v, shifts), _mm512_set1_epi8(3));
}
#elif defined(__AVX2__)
inline __m256i two_bit_codes32(const uint8_t* qs, int b) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (b / 4)));
  return _mm256_and_si256(_mm256_srli_epi16(v, 2 * (b % 4)), _mm256_set1_epi8(3));
}
#endif
inline int8_t two_bit_code(const uint8_t* qs, int i) {
  return static_cast<int8_t>((qs[32 * (i / 128) + i % 32] >> (2 * (i / 32 % 4))) & 3);
}

inline void zero_mins(CodeBlock* out) {
#if defined(__AVX2__)
  _mm256_store_si256(reinterpret_cast<__m256i*>(out->mins), _mm256_setzero_si256());
#else
  std::memset(out->mins, 0, sizeof(out->mins));
#endif
}

}  // namespace code_decoders

template <>
struct CodeBlockDecoder<kQ2_K> {
  static constexpr bool kHasMins = true;
  static constexpr int kCodeOffset = 0;
  static void decode(const uint8_t* super, CodeBlock* out) {
    const uint8_t* qs = super + 16;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    for (int z = 0; z < 4; ++z)
      _mm512_store_si512(out->codes + 64 * z, code_decoders::two_bit_codes64(qs, z));
#elif defined(__AVX2__)
    for (int b = 0; b < 8; ++b)
      _mm256_store_si256(reinterpret_cast<__m256i*>(out->codes + 32 * b),
                         code_decoders::two_bit_codes32(qs, b));
#else
    for (int i = 0; i < 256; ++i) out->codes[i] = code_decoders::two_bit_code(qs, i);
#endif
#if defined(__AVX2__)
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(super));
    const __m128i low = _mm_set1_epi8(15);
    _mm256_store_si256(reinterpret_cast<__m256i*>(out->scales),
                       _mm256_cvtepu8_epi16(_mm_and_si128(bytes, low)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(out->mins),
                       _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), low)));
#else
    for (int u = 0; u < 16; ++u) {
      out->scales[u] = static_cast<int16_t>(super[u] & 15);
      out->mins[u] = static_cast<int16_t>(super[u] >> 4);
    }
#endif
    out->d = half_to_float(load_u16(super + 80));
    out->dmin = -half_to_float(load_u16(super + 82));
  }
};

template <>
struct CodeBlockDecoder<kQ3_K> {
  static constexpr bool kHasMins = false;
  static constexpr int kCodeOffset = 4;
  static void decode(const uint8_t* super, CodeBlock* out) {
    const uint8_t* hmask = super;
    const uint8_t* qs = super + 32;
    // q - 4 where weight i's bit i / 32 of hmask[i % 32] is clear
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512i hb =
        _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hmask)));
    for (int z = 0; z < 4; ++z) {
      const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << (2 * z))),
                                             _mm256_set1_epi8(static_cast<char>(2 << (2 * z))), 1);
      const __m512i q = code_decoders::two_bit_codes64(qs, z);
      _mm512_store_si512(out->codes + 64 * z,
                         _mm512_mask_sub_epi8(q, _mm512_testn_epi8_mask(hb, bit), q,
                                              _mm512_set1_epi8(4)));
    }
#elif defined(__AVX2__)
    const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hmask));
    for (int b = 0; b < 8; ++b) {
      const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << b));
      const __m256i clear = _mm256_cmpeq_epi8(_mm256_and_si256(hb, bit), _mm256_setzero_si256());
      _mm256_store_si256(reinterpret_cast<__m256i*>(out->codes + 32 * b),
                         _mm256_sub_epi8(code_decoders::two_bit_codes32(qs, b),
                                         _mm256_and_si256(clear, _mm256_set1_epi8(4))));
    }
#else
    for (int i = 0; i < 256; ++i)
      out->codes[i] = static_cast<int8_t>(code_decoders::two_bit_code(qs, i) -
                                          (((hmask[i % 32] >> (i / 32)) & 1) == 0 ? 4 : 0));
#endif
    // the 12 scale bytes (96 .. 107), loaded as bytes 2 .. 13 of the 16 at 94: no read past the
    // super-block
#if defined(__AVX2__)
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(super + 94));
    const __m128i b8 = _mm_srli_si128(v, 2);  // scale bytes 0-7 in bytes 0-7
    const __m128i low =
        _mm_and_si128(_mm_unpacklo_epi64(b8, _mm_srli_epi16(b8, 4)), _mm_set1_epi8(15));
    // byte 8 + k % 4 of unit k, shifted right by 2 (k / 4): a 32-bit word each k / 4
    const __m128i h = _mm_shuffle_epi8(
        v, _mm_setr_epi8(10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13));
    __m128i high = _mm_blend_epi32(h, _mm_srli_epi16(h, 2), 0b0010);
    high = _mm_blend_epi32(high, _mm_srli_epi16(h, 4), 0b0100);
    high = _mm_blend_epi32(high, _mm_srli_epi16(h, 6), 0b1000);
    high = _mm_slli_epi16(_mm_and_si128(high, _mm_set1_epi8(3)), 4);
    const __m128i sc = _mm_sub_epi8(_mm_or_si128(low, high), _mm_set1_epi8(32));
    _mm256_store_si256(reinterpret_cast<__m256i*>(out->scales), _mm256_cvtepi8_epi16(sc));
#else
    const uint8_t* s = super + 96;
    for (int k = 0; k < 16; ++k) {
      const int low = (s[k % 8] >> (4 * (k / 8))) & 15, high = (s[8 + k % 4] >> (2 * (k / 4))) & 3;
      out->scales[k] = static_cast<int16_t>((low | high << 4) - 32);
    }
#endif
    code_decoders::zero_mins(out);
    out->d = half_to_float(load_u16(super + 108));
    out->dmin = -0.f;
  }
};

// IQ4_NL / IQ4_XS's 16 values.
constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                   1,    13,   25,  38,  53,  69,  89,  113};

template <>
struct CodeBlockDecoder<kIQ4_XS> {
  static constexpr bool kHasMins = false;
  static void decode(const uint8_t* super, CodeBlock* out) {
    const uint8_t* qs = super + 8;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512i values =
        _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Values)));
    for (int z = 0; z < 4; ++z) {  // sub-blocks 2 z, 2 z + 1: 128-bit lanes A, A >> 4, B, B >> 4
      const __m512i ab =
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * z)));
      const __m512i v = _mm512_shuffle_i64x2(ab, ab, 0b01010000);
      const __m512i nibbles = _mm512_and_si512(_mm512_mask_srli_epi16(v, 0xFF00FF00u, v, 4),
                                               _mm512_set1_epi8(15));
      _mm512_store_si512(out->codes + 64 * z, _mm512_shuffle_epi8(values, nibbles));
    }
#elif defined(__AVX2__)
    const __m256i values =
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Values)));
    for (int j = 0; j < 8; ++j) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * j));
      const __m256i nibbles = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(a, 4), a),
                                               _mm256_set1_epi8(15));
      _mm256_store_si256(reinterpret_cast<__m256i*>(out->codes + 32 * j),
                         _mm256_shuffle_epi8(values, nibbles));
    }
#else
    for (int i = 0; i < 256; ++i)
      out->codes[i] = kIq4Values[(qs[16 * (i / 32) + i % 16] >> (4 * (i / 16 % 2))) & 15];
#endif
    uint16_t high;
    uint32_t low;
    std::memcpy(&high, super + 2, sizeof(high));
    std::memcpy(&low, super + 4, sizeof(low));
#if defined(__BMI2__) && defined(__AVX2__)
    // byte j of ls: nibble j of scales_l, and bits 2 j, 2 j + 1 of scales_h above it
    const uint64_t ls =
        _pdep_u64(low, 0x0f0f0f0f0f0f0f0full) | _pdep_u64(high, 0x0303030303030303ull) << 4;
    const __m128i bytes = _mm_cvtsi64_si128(static_cast<long long>(ls));
    _mm256_store_si256(reinterpret_cast<__m256i*>(out->scales),
                       _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(bytes, bytes)),
                                        _mm256_set1_epi16(32)));
#else
    for (int j = 0; j < 8; ++j) {
      const int ls = ((low >> (4 * j)) & 15) | ((high >> (2 * j)) & 3) << 4;
      out->scales[2 * j] = out->scales[2 * j + 1] = static_cast<int16_t>(ls - 32);
    }
#endif
    code_decoders::zero_mins(out);
    out->d = half_to_float(load_u16(super));
    out->dmin = -0.f;
  }
};

}  // namespace hybridllm_gguf
