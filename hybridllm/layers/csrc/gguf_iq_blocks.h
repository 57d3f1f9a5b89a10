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
// d' * (2s + 1) with d' a power-of-two multiple of d (d / 8 for IQ2, d / 4 for IQ3_XXS, d for
// IQ3_S; exact, fp16 d being far from fp32's range limits), so fp32 rounds d' * (2s + 1)
// exactly as it rounds gguf's product, and the code's product with it as gguf's product with
// the grid value (signs are exact). IQ1's grid + delta is (8 g +- 1) / 8: code 8 g +- 1 with
// d' = d / 8. Codes stay within +-63 (IQ1: +-9), scales within 31.
//
// Three paths, chosen at compile time, write the same CodeBlocks (tests/unit/
// test_gguf_iq_decoders.py builds each): AVX-512 (BW, VL) unpacks in vector lanes, reads the
// grids by gathers or, with VBMI and grids of up to 512 entries, by byte permutes, and applies
// signs by masked subtraction; AVX2 unpacks in vector lanes into an Unpacked, then gathers;
// scalar code unpacks one index at a time and signs a group of 8 codes in a uint64_t. On a Zen 5
// core (one thread, benchmarks/bench_iq_decode.cpp): AVX-512 VBMI 8-19 ns a super-block, AVX2
// 16-24, scalar 40-83.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

// The decoders' path: AVX-512 or AVX2 (HYBRIDLLM_IQ_SIMD: both are iq::decode_*), else scalar.
#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define HYBRIDLLM_IQ_AVX512 1
#define HYBRIDLLM_IQ_SIMD 1
#elif defined(__AVX2__)
#define HYBRIDLLM_IQ_AVX512 0
#define HYBRIDLLM_IQ_SIMD 1
#else
#define HYBRIDLLM_IQ_AVX512 0
#define HYBRIDLLM_IQ_SIMD 0
#endif
// AVX2 builds without AVX-512: IQ2_XXS, IQ2_XS and IQ2_S also serve the grid path of
// gguf_q8_dot.h's q8_dot_code_blocks (their CodeBlockDecoder's kGrid, grid_index and unpack).
#define HYBRIDLLM_IQ_AVX2_GRID (HYBRIDLLM_IQ_SIMD && !HYBRIDLLM_IQ_AVX512)

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

// of[s]: 0xff in byte k where bit k of s is set (the scalar path's sign masks).
struct ByteMasks {
  uint64_t of[256];
};
constexpr ByteMasks byte_masks() {
  ByteMasks t{};
  for (int s = 0; s < 256; ++s)
    for (int k = 0; k < 8; ++k)
      if ((s >> k) & 1) t.of[s] |= 0xffull << (8 * k);
  return t;
}
inline constexpr ByteMasks kByteMasks = byte_masks();

#if defined(__AVX2__)
// The 8-byte table entries table[a], table[b], table[c], table[d] in one vector: vmovq and vmovhpd
// from memory, not vpinsrq (its shuffle takes an FP pipe 3 cycles in llvm-mca's Zen 3 model).
inline __m256i table_entries4(const uint64_t* table, uint32_t a, uint32_t b, uint32_t c,
                              uint32_t d) {
  const auto pair = [&](uint32_t i, uint32_t j) {
    const __m128d low =
        _mm_castsi128_pd(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(table + i)));
    return _mm_castpd_si128(_mm_loadh_pd(low, reinterpret_cast<const double*>(table + j)));
  };
  return _mm256_inserti128_si256(_mm256_castsi128_si256(pair(a, b)), pair(c, d), 1);
}

// Step c's 32 grid values (unsigned bytes, weights 32 c ..): kWidth 8, a uint64_t grid's entries
// at indices 4 c .. 4 c + 3; kWidth 4, a uint32_t grid's at 8 c .. 8 c + 7.
template <int kWidth, class Entry>
inline __m256i grid_values(const Entry* grid, const Unpacked& u, int c) {
  static_assert(kWidth == 8 || kWidth == 4, "grids of 8 or 4 values");
  if constexpr (kWidth == 8) {
#if HYBRIDLLM_IQ_AVX512
    const __m128i vi = _mm_load_si128(reinterpret_cast<const __m128i*>(u.index + 4 * c));
    return _mm256_i32gather_epi64(reinterpret_cast<const long long*>(grid), vi, 8);
#else
    // four scalar loads: on a 2-core Zen 3, IQ2_XXS at one row of x (8192 x 2048) took
    // 1.10-1.13 ms against 1.28 with vpgatherdq
    const uint32_t* at = u.index + 4 * c;
    return table_entries4(grid, at[0], at[1], at[2], at[3]);
#endif
  } else {
    const __m256i vi = _mm256_load_si256(reinterpret_cast<const __m256i*>(u.index + 8 * c));
    return _mm256_i32gather_epi32(reinterpret_cast<const int*>(grid), vi, 4);
  }
}

// 0xff in byte 8 j + k where bit k of signs[j] (j = 0..3) is set, else 0.
inline __m256i sign_mask(const uint8_t* signs) {
  // sign byte j broadcast into bytes 8j..8j+7, then bit k of byte 8j + k tested
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  //
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  const __m256i s =
      _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(load32(signs))), spread);
  return _mm256_cmpeq_epi8(_mm256_and_si256(s, bit), bit);
}
#endif

// codes[8g + k] for the 32 groups g: the grid's values at the unpacked indices, negated where
// the group's sign bit k is set; kDelta (IQ1): instead value + 1, or value - 1 where it is set.
// kWidth: 8 (a uint64_t grid, 32 indices) or 4 (a uint32_t grid, 64 indices).
template <int kWidth, bool kDelta, class Entry>
inline void expand(const Entry* grid, const Unpacked& u, int8_t* codes) {
  static_assert(kWidth == 8 || kWidth == 4, "grids of 8 or 4 values");
#if defined(__AVX2__)
  for (int c = 0; c < 8; ++c) {  // 32 codes a step
    __m256i v = grid_values<kWidth>(grid, u, c);
    const __m256i m = sign_mask(u.signs + 4 * c);
    if constexpr (kDelta)
      v = _mm256_sub_epi8(_mm256_add_epi8(v, _mm256_set1_epi8(1)),
                          _mm256_and_si256(m, _mm256_set1_epi8(2)));
    else
      v = _mm256_sub_epi8(_mm256_xor_si256(v, m), m);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 32 * c), v);
  }
#else
  // Eight codes a step in a uint64_t: bytes negated (bytes v >= 1: ~v + 1 carries into no
  // other byte), or IQ1's +-1 added bytewise without carries.
  constexpr uint64_t kOnes = 0x0101010101010101ull, kHigh = 0x8080808080808080ull;
  for (int g = 0; g < 32; ++g) {
    uint64_t values;
    if constexpr (kWidth == 8)
      values = grid[u.index[g]];
    else
      values = grid[u.index[2 * g]] | static_cast<uint64_t>(grid[u.index[2 * g + 1]]) << 32;
    const uint64_t set = kByteMasks.of[u.signs[g]];  // 0xff in byte k where bit k is set
    uint64_t v;
    if constexpr (kDelta) {
      const uint64_t add = set | kOnes;  // +1, or 0xff: -1
      v = ((values & ~kHigh) + (add & ~kHigh)) ^ ((values ^ add) & kHigh);
    } else {
      v = (values ^ set) + (set & kOnes);
    }
    std::memcpy(codes + 8 * g, &v, sizeof(v));
  }
#endif
}

#if HYBRIDLLM_IQ_AVX512 || defined(__AVX2__)
// Helpers of both the AVX-512 and the AVX2 decoders.

// IQ2_XS, IQ2_S: the 16 scales 2 s + 1 of 8 bytes of nibbles (low nibble first).
inline void nibble_scales16(const uint8_t* p, CodeBlock* out) {
  const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i lo = _mm_and_si128(x, _mm_set1_epi16(15)), hi = _mm_srli_epi16(x, 4);
  const __m128i one = _mm_set1_epi16(1);
  const __m128i a = _mm_unpacklo_epi16(lo, hi), b = _mm_unpackhi_epi16(lo, hi);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out->scales),
                   _mm_add_epi16(_mm_slli_epi16(a, 1), one));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out->scales + 8),
                   _mm_add_epi16(_mm_slli_epi16(b, 1), one));
}

// 8 scales 2 s + 1 (one per 32 weights, in int16 lanes) to the 16 per 16 weights.
inline void scales32_to_16(__m128i s, CodeBlock* out) {
  const __m128i v = _mm_add_epi16(_mm_slli_epi16(s, 1), _mm_set1_epi16(1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out->scales), _mm_unpacklo_epi16(v, v));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out->scales + 8), _mm_unpackhi_epi16(v, v));
}

// IQ2_XXS, IQ3_XXS: from 8 aux words, the 32 sign bytes (group 4j + i: bits 7i of word j, with
// its parity as bit 7) and the 16 scales 2 (aux >> 28) + 1. The four 7-bit indices of a word
// packed into its four bytes, each byte's parity folds into its bit 0 without crossing bytes.
inline __m256i aux_signs(__m256i aux, CodeBlock* out) {
  const __m256i low7 = _mm256_set1_epi32(127);
  __m256i y = _mm256_and_si256(aux, low7);
  y = _mm256_or_si256(y, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(aux, 7), low7), 8));
  y = _mm256_or_si256(y,
                      _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(aux, 14), low7), 16));
  y = _mm256_or_si256(y,
                      _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(aux, 21), low7), 24));
  __m256i t = _mm256_xor_si256(y, _mm256_srli_epi32(y, 4));
  t = _mm256_xor_si256(t, _mm256_srli_epi32(t, 2));
  t = _mm256_xor_si256(t, _mm256_srli_epi32(t, 1));
  y = _mm256_or_si256(y, _mm256_slli_epi32(_mm256_and_si256(t, _mm256_set1_epi8(1)), 7));
  const __m256i sc = _mm256_add_epi32(_mm256_slli_epi32(_mm256_srli_epi32(aux, 28), 1),
                                      _mm256_set1_epi32(1));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out->scales),
                      _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16)));
  return y;
}
#endif

#if HYBRIDLLM_IQ_AVX512
// The AVX-512 decoders: the unpacking vectorized too, the grids read by gathers (with VBMI, the
// grids of up to 512 entries by byte permutes instead, below), the signs (or IQ1's deltas)
// applied by masked subtraction, 64 codes a step.

// c = 0..3 called as f(std::integral_constant<int, c>): the four 64-code chunks, unrolled with
// their indices as constants (intrinsics' immediates).
template <class F>
[[gnu::always_inline]] inline void for_chunks(F f) {
  f(std::integral_constant<int, 0>{});
  f(std::integral_constant<int, 1>{});
  f(std::integral_constant<int, 2>{});
  f(std::integral_constant<int, 3>{});
}

template <int kLane>
inline __m256i half_of(__m512i x) {
  return kLane == 0 ? _mm512_castsi512_si256(x) : _mm512_extracti64x4_epi64(x, kLane);
}

// Qword c of a 256-bit vector as a mask (its byte j's bit k: weight 8 (8c + j) + k).
template <int c>
inline __mmask64 qword_mask(__m256i x) {
  return _cvtu64_mask64(static_cast<uint64_t>(_mm256_extract_epi64(x, c)));
}

inline __mmask64 load_mask(const uint8_t* p) {
  uint64_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return _cvtu64_mask64(bits);
}

inline void store_signed(int8_t* codes, __m512i v, __mmask64 negative) {
  _mm512_storeu_si512(codes, _mm512_mask_sub_epi8(v, negative, _mm512_setzero_si512(), v));
}

// IQ1: value + 1, or value - 1 where the delta is negative.
inline void store_delta(int8_t* codes, __m512i v, __mmask64 negative) {
  v = _mm512_add_epi8(v, _mm512_set1_epi8(1));
  _mm512_storeu_si512(codes, _mm512_mask_sub_epi8(v, negative, v, _mm512_set1_epi8(2)));
}

// 7-bit sign indices (in 16-bit lanes) to their sign bytes: the index with its parity as bit 7
// (kIQSigns[x], computed).
inline __m512i with_parity16(__m512i x) {
  __m512i t = _mm512_xor_si512(x, _mm512_srli_epi16(x, 4));
  t = _mm512_xor_si512(t, _mm512_srli_epi16(t, 2));
  t = _mm512_xor_si512(t, _mm512_srli_epi16(t, 1));
  return _mm512_or_si512(x, _mm512_slli_epi16(_mm512_and_si512(t, _mm512_set1_epi16(1)), 7));
}

// Grid indices in 32 int16 lanes (one a group of 8) to the dword indices of chunk c's 8 groups.
template <int c>
inline __m256i chunk_index(__m512i index16) {
  return half_of<c % 2>(_mm512_cvtepu16_epi32(half_of<c / 2>(index16)));
}

#if !defined(__AVX512VBMI__)  // else the permute decoder below
inline void decode_iq2_xxs(const uint8_t* super, CodeBlock* out) {
  const __m512i raw = _mm512_loadu_si512(super + 2);  // 8 x (4 index bytes, aux word)
  const __m256i index8 = _mm512_cvtepi64_epi32(raw);
  const __m256i signs = aux_signs(_mm512_cvtepi64_epi32(_mm512_srli_epi64(raw, 32)), out);
  for_chunks([&](auto c) {
    const __m128i bytes = _mm256_extracti128_si256(index8, c / 2);
    const __m256i vi = _mm256_cvtepu8_epi32(c % 2 ? _mm_srli_si128(bytes, 8) : bytes);
    store_signed(out->codes + 64 * c, _mm512_i32gather_epi64(vi, kIQ2XXSGrid, 8),
                 qword_mask<c>(signs));
  });
}
#endif

#if !defined(__AVX512VBMI__)  // else the permute decoder below
inline void decode_iq2_xs(const uint8_t* super, CodeBlock* out) {
  const __m512i q = _mm512_loadu_si512(super + 2);  // 32 x (9-bit index, 7-bit sign index)
  const __m512i index = _mm512_and_si512(q, _mm512_set1_epi16(511));
  const __m256i signs = _mm512_cvtepi16_epi8(with_parity16(_mm512_srli_epi16(q, 9)));
  nibble_scales16(super + 66, out);
  for_chunks([&](auto c) {
    store_signed(out->codes + 64 * c,
                 _mm512_i32gather_epi64(chunk_index<c>(index), kIQ2XSGrid, 8),
                 qword_mask<c>(signs));
  });
}
#endif

alignas(64) inline constexpr uint16_t kQuarterLane[32] = {
    0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3,
    4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7};
alignas(64) inline constexpr uint16_t kHalfLane[32] = {
    0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7,
    8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15};
alignas(64) inline constexpr uint16_t kShift2[32] = {
    0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6};
alignas(64) inline constexpr uint16_t kShift3[32] = {
    0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9};
alignas(64) inline constexpr uint16_t kShift4[32] = {
    0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4};

inline __m512i load512(const void* p) { return _mm512_loadu_si512(p); }

inline void decode_iq2_s(const uint8_t* super, CodeBlock* out) {
  const __m512i low = _mm512_cvtepu8_epi16(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(super + 2)));
  const __m512i qh = _mm512_castsi256_si512(
      _mm256_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(super + 66))));
  const __m512i high = _mm512_and_si512(
      _mm512_srlv_epi16(_mm512_permutexvar_epi16(load512(kQuarterLane), qh), load512(kShift2)),
      _mm512_set1_epi16(3));
  const __m512i index = _mm512_or_si512(low, _mm512_slli_epi16(high, 8));
  nibble_scales16(super + 74, out);
  for_chunks([&](auto c) {
    store_signed(out->codes + 64 * c,
                 _mm512_i32gather_epi64(chunk_index<c>(index), kIQ2SGrid, 8),
                 load_mask(super + 34 + 8 * c));
  });
}

#if !defined(__AVX512VBMI__)  // else the permute decoder below
inline void decode_iq3_xxs(const uint8_t* super, CodeBlock* out) {
  const __m256i signs =
      aux_signs(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(super + 66)), out);
  for_chunks([&](auto c) {
    const __m512i vi = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(super + 2 + 16 * c)));
    store_signed(out->codes + 64 * c, _mm512_i32gather_epi32(vi, kIQ3XXSGrid, 4),
                 qword_mask<c>(signs));
  });
}
#endif

#if !defined(__AVX512VBMI__)  // else the permute decoder below
inline void decode_iq3_s(const uint8_t* super, CodeBlock* out) {
  const __m128i x = _mm_cvtepu8_epi16(_mm_cvtsi32_si128(static_cast<int>(load32(super + 106))));
  scales32_to_16(_mm_unpacklo_epi16(_mm_and_si128(x, _mm_set1_epi16(15)), _mm_srli_epi16(x, 4)),
                 out);
  for_chunks([&](auto c) {
    __m512i vi = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(super + 2 + 16 * c)));
    vi = _mm512_mask_or_epi32(vi, _cvtu32_mask16(load16(super + 66 + 2 * c)), vi,
                              _mm512_set1_epi32(256));
    store_signed(out->codes + 64 * c, _mm512_i32gather_epi32(vi, kIQ3SGrid, 4),
                 load_mask(super + 74 + 8 * c));
  });
}
#endif

inline void decode_iq1_s(const uint8_t* super, CodeBlock* out) {
  const __m512i low = _mm512_cvtepu8_epi16(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(super + 2)));
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(super + 34));
  const __m512i hg = _mm512_permutexvar_epi16(load512(kQuarterLane), _mm512_castsi128_si512(h));
  const __m512i high =
      _mm512_and_si512(_mm512_srlv_epi16(hg, load512(kShift3)), _mm512_set1_epi16(7));
  const __m512i index = _mm512_or_si512(low, _mm512_slli_epi16(high, 8));
  const __m256i negative = _mm256_movm_epi8(_mm512_movepi16_mask(hg));  // bit 15: delta < 0
  scales32_to_16(_mm_and_si128(_mm_srli_epi16(h, 12), _mm_set1_epi16(7)), out);
  for_chunks([&](auto c) {
    store_delta(out->codes + 64 * c,
                _mm512_i32gather_epi64(chunk_index<c>(index), kIQ1Grid8, 8),
                qword_mask<c>(negative));
  });
}

// IQ1_M's 16 scales: 2 s + 1, s the 3-bit fields at bits 3i of word j (scale 4j + i).
inline void iq1_m_scales(const uint8_t* super, CodeBlock* out) {
  const __m256i w = _mm256_castsi128_si256(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(super + 48)));
  const __m256i s = _mm256_and_si256(
      _mm256_srlv_epi16(
          _mm256_permutexvar_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                       kQuarterLane)),
                                   w),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kShift3))),
      _mm256_set1_epi16(7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out->scales),
                      _mm256_add_epi16(_mm256_slli_epi16(s, 1), _mm256_set1_epi16(1)));
}

inline void decode_iq1_m(const uint8_t* super, CodeBlock* out) {
  const __m512i low =
      _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(super)));
  const __m512i qh = _mm512_castsi256_si512(
      _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(super + 32))));
  const __m512i nibble = _mm512_and_si512(
      _mm512_srlv_epi16(_mm512_permutexvar_epi16(load512(kHalfLane), qh), load512(kShift4)),
      _mm512_set1_epi16(15));
  const __m512i index = _mm512_or_si512(
      low, _mm512_slli_epi16(_mm512_and_si512(nibble, _mm512_set1_epi16(7)), 8));
  const __m256i negative =
      _mm256_movm_epi8(_mm512_test_epi16_mask(nibble, _mm512_set1_epi16(8)));
  iq1_m_scales(super, out);
  for_chunks([&](auto c) {
    store_delta(out->codes + 64 * c,
                _mm512_i32gather_epi64(chunk_index<c>(index), kIQ1Grid8, 8),
                qword_mask<c>(negative));
  });
}

#if defined(__AVX512VBMI__)
// Without gathers (VBMI): a grid's entries looked up as 16-bit level codes (gguf_iq_grids.h),
// whose two byte planes are looked up by byte permutes of 128-byte tables, blended by the
// index's higher bits; then each code's levels cut into bytes by a multishift and mapped to
// their values by a byte shuffle.

// Bytes table[index] of a kEntries-byte table for the 64 indices whose low 8 bits are the bytes
// of `low` and whose bits 8, 9, ... are the masks high[0], high[1], ...
template <int kEntries>
[[gnu::always_inline]] inline __m512i lookup_bytes(const uint8_t* table, __m512i low,
                                                   const __mmask64* high) {
  static_assert(kEntries >= 256 && kEntries % 128 == 0, "whole 128-byte tables, at least two");
  constexpr int kParts = kEntries / 128;
  __m512i part[kParts];
  for (int k = 0; k < kParts; ++k)
    part[k] = _mm512_permutex2var_epi8(load512(table + 128 * k), low,
                                       load512(table + 128 * k + 64));
  __mmask64 upper = _mm512_movepi8_mask(low);  // bit 7
  for (int width = 1, b = 0; width < kParts; width *= 2) {
    for (int k = 0; k < kParts; k += 2 * width)
      part[k] = _mm512_mask_blend_epi8(upper, part[k], part[k + width]);
    if (2 * width < kParts) upper = high[b++];
  }
  return part[0];
}

// A 16-byte value table (kIQ2Values, ...) in every 128-bit lane, for _mm512_shuffle_epi8.
inline __m512i value_table(const int8_t* values) {
  return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(values)));
}

// For byte permutes of two 64-byte code planes (lo: entry e's low code byte at byte e, hi: its
// high one): at[c] places the codes of chunk c's entries (entry_bytes bytes an entry of values,
// 64 / entry_bytes entries a chunk) in the low 16 bits of their value lanes (the rest copies).
struct CodeBytes {
  alignas(64) uint8_t at[4][64];
};
constexpr CodeBytes code_bytes(int entry_bytes) {
  CodeBytes t{};
  for (int c = 0; c < 4; ++c)
    for (int i = 0; i < 64; ++i) {
      const int e = c * (64 / entry_bytes) + i / entry_bytes;
      t.at[c][i] = static_cast<uint8_t>(i % entry_bytes == 1 ? 64 + e : e);
    }
  return t;
}
inline constexpr CodeBytes kCodeBytes8 = code_bytes(8), kCodeBytes4 = code_bytes(4);

// Entries 8c .. 8c + 7 of a grid of 8 values (their codes' byte planes lo, hi: 2 bits a
// weight) to the 64 values of their 8 groups.
template <int c>
inline __m512i values8(__m512i lo, __m512i hi, __m512i values) {
  const __m512i x = _mm512_permutex2var_epi8(lo, load512(kCodeBytes8.at[c]), hi);
  const __m512i shifts = _mm512_set1_epi64(0x0e0c0a0806040200);  // byte k: bits 2k
  const __m512i levels = _mm512_and_si512(_mm512_multishift_epi64_epi8(shifts, x),
                                          _mm512_set1_epi8(3));
  return _mm512_shuffle_epi8(values, levels);
}

// Entries 16c .. 16c + 15 of a grid of 4 values (their codes' byte planes lo, hi: 3 bits a
// weight) to their 64 values.
template <int c>
inline __m512i values4(__m512i lo, __m512i hi, __m512i values) {
  const __m512i x = _mm512_permutex2var_epi8(lo, load512(kCodeBytes4.at[c]), hi);
  const __m512i shifts = _mm512_set1_epi64(0x2926232009060300);  // bytes: bits 3k, 32 + 3k
  const __m512i levels = _mm512_and_si512(_mm512_multishift_epi64_epi8(shifts, x),
                                          _mm512_set1_epi8(7));
  return _mm512_shuffle_epi8(values, levels);
}

inline void decode_iq2_xxs(const uint8_t* super, CodeBlock* out) {
  const __m512i raw = _mm512_loadu_si512(super + 2);  // 8 x (4 index bytes, aux word)
  const __m256i signs = aux_signs(_mm512_cvtepi64_epi32(_mm512_srli_epi64(raw, 32)), out);
  const __m512i low = _mm512_castsi256_si512(_mm512_cvtepi64_epi32(raw));
  const __m512i lo = lookup_bytes<256>(kIQ2XXSLevels[0], low, nullptr);
  const __m512i hi = lookup_bytes<256>(kIQ2XXSLevels[1], low, nullptr);
  const __m512i values = value_table(kIQ2Values);
  for_chunks([&](auto c) {
    store_signed(out->codes + 64 * c, values8<c>(lo, hi, values), qword_mask<c>(signs));
  });
}

inline void decode_iq2_xs(const uint8_t* super, CodeBlock* out) {
  const __m512i q = _mm512_loadu_si512(super + 2);  // 32 x (9-bit index, 7-bit sign index)
  const __mmask64 bit8 = _mm512_test_epi16_mask(q, _mm512_set1_epi16(256));
  const __m512i low = _mm512_castsi256_si512(_mm512_cvtepi16_epi8(q));
  const __m512i lo = lookup_bytes<512>(kIQ2XSLevels[0], low, &bit8);
  const __m512i hi = lookup_bytes<512>(kIQ2XSLevels[1], low, &bit8);
  const __m256i signs = _mm512_cvtepi16_epi8(with_parity16(_mm512_srli_epi16(q, 9)));
  nibble_scales16(super + 66, out);
  const __m512i values = value_table(kIQ2Values);
  for_chunks([&](auto c) {
    store_signed(out->codes + 64 * c, values8<c>(lo, hi, values), qword_mask<c>(signs));
  });
}

inline void decode_iq3_xxs(const uint8_t* super, CodeBlock* out) {
  const __m256i signs =
      aux_signs(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(super + 66)), out);
  const __m512i low = load512(super + 2);
  const __m512i lo = lookup_bytes<256>(kIQ3XXSLevels[0], low, nullptr);
  const __m512i hi = lookup_bytes<256>(kIQ3XXSLevels[1], low, nullptr);
  const __m512i values = value_table(kIQ3XXSValues);
  for_chunks([&](auto c) {
    store_signed(out->codes + 64 * c, values4<c>(lo, hi, values), qword_mask<c>(signs));
  });
}

inline void decode_iq3_s(const uint8_t* super, CodeBlock* out) {
  const __m128i x = _mm_cvtepu8_epi16(_mm_cvtsi32_si128(static_cast<int>(load32(super + 106))));
  scales32_to_16(_mm_unpacklo_epi16(_mm_and_si128(x, _mm_set1_epi16(15)), _mm_srli_epi16(x, 4)),
                 out);
  const __m512i low = load512(super + 2);
  const __mmask64 bit8 = load_mask(super + 66);
  const __m512i lo = lookup_bytes<512>(kIQ3SLevels[0], low, &bit8);
  const __m512i hi = lookup_bytes<512>(kIQ3SLevels[1], low, &bit8);
  const __m512i values = value_table(kIQ3SValues);
  for_chunks([&](auto c) {
    store_signed(out->codes + 64 * c, values4<c>(lo, hi, values), load_mask(super + 74 + 8 * c));
  });
}

#endif  // __AVX512VBMI__
#endif  // HYBRIDLLM_IQ_AVX512


#if !HYBRIDLLM_IQ_AVX512 && defined(__AVX2__)
// The AVX2 decoders: the unpacking vectorized into an Unpacked, then expand's AVX2 branch.

inline __m128i load64(const uint8_t* p) {
  return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
}

inline void store_index8(Unpacked* u, int at, __m256i index) {
  _mm256_store_si256(reinterpret_cast<__m256i*>(u->index + at), index);
}

inline void unpack_iq2_xxs(const uint8_t* super, Unpacked& u, CodeBlock* out) {
  const __m256i even_odd = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  const __m256i p = _mm256_permutevar8x32_epi32(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(super + 2)), even_odd);
  const __m256i q = _mm256_permutevar8x32_epi32(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(super + 34)), even_odd);
  const __m128i pi = _mm256_castsi256_si128(p), qi = _mm256_castsi256_si128(q);
  store_index8(&u, 0, _mm256_cvtepu8_epi32(pi));
  store_index8(&u, 8, _mm256_cvtepu8_epi32(_mm_srli_si128(pi, 8)));
  store_index8(&u, 16, _mm256_cvtepu8_epi32(qi));
  store_index8(&u, 24, _mm256_cvtepu8_epi32(_mm_srli_si128(qi, 8)));
  _mm256_store_si256(reinterpret_cast<__m256i*>(u.signs),
                     aux_signs(_mm256_permute2x128_si256(p, q, 0x31), out));
}

// 16 uint16 sign indices (7 bits) to their sign bytes, in 16-bit lanes.
inline __m256i with_parity16(__m256i x) {
  __m256i t = _mm256_xor_si256(x, _mm256_srli_epi16(x, 4));
  t = _mm256_xor_si256(t, _mm256_srli_epi16(t, 2));
  t = _mm256_xor_si256(t, _mm256_srli_epi16(t, 1));
  return _mm256_or_si256(x, _mm256_slli_epi16(_mm256_and_si256(t, _mm256_set1_epi16(1)), 7));
}

inline void unpack_iq2_xs(const uint8_t* super, Unpacked& u, CodeBlock* out) {
  const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(super + 2));
  const __m256i q1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(super + 34));
  const __m256i mask9 = _mm256_set1_epi16(511);
  const __m256i i0 = _mm256_and_si256(q0, mask9), i1 = _mm256_and_si256(q1, mask9);
  store_index8(&u, 0, _mm256_cvtepu16_epi32(_mm256_castsi256_si128(i0)));
  store_index8(&u, 8, _mm256_cvtepu16_epi32(_mm256_extracti128_si256(i0, 1)));
  store_index8(&u, 16, _mm256_cvtepu16_epi32(_mm256_castsi256_si128(i1)));
  store_index8(&u, 24, _mm256_cvtepu16_epi32(_mm256_extracti128_si256(i1, 1)));
  const __m256i s = _mm256_packus_epi16(with_parity16(_mm256_srli_epi16(q0, 9)),
                                        with_parity16(_mm256_srli_epi16(q1, 9)));
  _mm256_store_si256(reinterpret_cast<__m256i*>(u.signs), _mm256_permute4x64_epi64(s, 0xd8));
  nibble_scales16(super + 66, out);
}

inline void unpack_iq2_s(const uint8_t* super, Unpacked& u, CodeBlock* out) {
  const __m256i shift = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
  for (int k = 0; k < 4; ++k) {  // 8 groups, two bytes of high index bits
    const __m256i h = _mm256_srlv_epi32(_mm256_set1_epi32(load16(super + 66 + 2 * k)), shift);
    const __m256i high = _mm256_slli_epi32(_mm256_and_si256(h, _mm256_set1_epi32(3)), 8);
    const __m256i low = _mm256_cvtepu8_epi32(load64(super + 2 + 8 * k));
    store_index8(&u, 8 * k, _mm256_or_si256(low, high));
  }
  std::memcpy(u.signs, super + 34, 32);
  nibble_scales16(super + 74, out);
}

inline void unpack_iq3_xxs(const uint8_t* super, Unpacked& u, CodeBlock* out) {
  for (int k = 0; k < 8; ++k)
    store_index8(&u, 8 * k, _mm256_cvtepu8_epi32(load64(super + 2 + 8 * k)));
  const __m256i aux = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(super + 66));
  _mm256_store_si256(reinterpret_cast<__m256i*>(u.signs), aux_signs(aux, out));
}

inline void unpack_iq3_s(const uint8_t* super, Unpacked& u, CodeBlock* out) {
  const __m256i shift = _mm256_setr_epi32(8, 7, 6, 5, 4, 3, 2, 1);  // bit k to bit 8
  const __m256i bit8 = _mm256_set1_epi32(256);
  for (int k = 0; k < 8; ++k) {  // 8 entries, one byte of high bits
    const __m256i h = _mm256_sllv_epi32(_mm256_set1_epi32(super[66 + k]), shift);
    store_index8(&u, 8 * k, _mm256_or_si256(_mm256_cvtepu8_epi32(load64(super + 2 + 8 * k)),
                                            _mm256_and_si256(h, bit8)));
  }
  std::memcpy(u.signs, super + 74, 32);
  const __m128i x = _mm_cvtepu8_epi16(_mm_cvtsi32_si128(static_cast<int>(load32(super + 106))));
  scales32_to_16(_mm_unpacklo_epi16(_mm_and_si128(x, _mm_set1_epi16(15)), _mm_srli_epi16(x, 4)),
                 out);
}

// The grid types' decoders: their unpacking, then expand (the fused int8 kernel of
// gguf_q8_dot.h calls the unpacking alone).
template <int kWidth, class Entry>
inline void decode_grid(const Entry* grid, void (*unpack)(const uint8_t*, Unpacked&, CodeBlock*),
                        const uint8_t* super, CodeBlock* out) {
  Unpacked u;
  unpack(super, u, out);
  expand<kWidth, false>(grid, u, out->codes);
}
inline void decode_iq2_xxs(const uint8_t* super, CodeBlock* out) {
  decode_grid<8>(kIQ2XXSGrid, unpack_iq2_xxs, super, out);
}
inline void decode_iq2_xs(const uint8_t* super, CodeBlock* out) {
  decode_grid<8>(kIQ2XSGrid, unpack_iq2_xs, super, out);
}
inline void decode_iq2_s(const uint8_t* super, CodeBlock* out) {
  decode_grid<8>(kIQ2SGrid, unpack_iq2_s, super, out);
}
inline void decode_iq3_xxs(const uint8_t* super, CodeBlock* out) {
  decode_grid<4>(kIQ3XXSGrid, unpack_iq3_xxs, super, out);
}
inline void decode_iq3_s(const uint8_t* super, CodeBlock* out) {
  decode_grid<4>(kIQ3SGrid, unpack_iq3_s, super, out);
}

inline void decode_iq1_s(const uint8_t* super, CodeBlock* out) {
  Unpacked u;
  const __m256i shift = _mm256_setr_epi32(0, 3, 6, 9, 16, 19, 22, 25);
  for (int k = 0; k < 4; ++k) {  // 8 groups, two words of high index bits
    const __m256i words = _mm256_set1_epi32(static_cast<int>(load32(super + 34 + 4 * k)));
    const __m256i high = _mm256_slli_epi32(
        _mm256_and_si256(_mm256_srlv_epi32(words, shift), _mm256_set1_epi32(7)), 8);
    const __m256i low = _mm256_cvtepu8_epi32(load64(super + 2 + 8 * k));
    store_index8(&u, 8 * k, _mm256_or_si256(low, high));
  }
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(super + 34));
  const __m128i negative = _mm_packs_epi16(_mm_srai_epi16(h, 15), _mm_setzero_si128());
  const __m128i pairs = _mm_unpacklo_epi8(negative, negative);
  _mm_store_si128(reinterpret_cast<__m128i*>(u.signs), _mm_unpacklo_epi16(pairs, pairs));
  _mm_store_si128(reinterpret_cast<__m128i*>(u.signs + 16), _mm_unpackhi_epi16(pairs, pairs));
  scales32_to_16(_mm_and_si128(_mm_srli_epi16(h, 12), _mm_set1_epi16(7)), out);
  expand<8, true>(kIQ1Grid8, u, out->codes);
}

inline void decode_iq1_m(const uint8_t* super, CodeBlock* out) {
  Unpacked u;
  const __m256i shift = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  for (int k = 0; k < 4; ++k) {  // 8 groups, four bytes of nibbles
    const __m256i bytes = _mm256_set1_epi32(static_cast<int>(load32(super + 32 + 4 * k)));
    const __m256i high = _mm256_slli_epi32(
        _mm256_and_si256(_mm256_srlv_epi32(bytes, shift), _mm256_set1_epi32(7)), 8);
    const __m256i low = _mm256_cvtepu8_epi32(load64(super + 8 * k));
    store_index8(&u, 8 * k, _mm256_or_si256(low, high));
  }
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(super + 32));
  const __m128i lo8 = _mm_set1_epi8(8), hi8 = _mm_set1_epi8(static_cast<char>(0x80));
  const __m128i even = _mm_cmpeq_epi8(_mm_and_si128(x, lo8), lo8);
  const __m128i odd = _mm_cmpeq_epi8(_mm_and_si128(x, hi8), hi8);
  _mm_store_si128(reinterpret_cast<__m128i*>(u.signs), _mm_unpacklo_epi8(even, odd));
  _mm_store_si128(reinterpret_cast<__m128i*>(u.signs + 16), _mm_unpackhi_epi8(even, odd));
  for (int j = 0; j < 4; ++j) {
    const uint16_t w = load16(super + 48 + 2 * j);
    for (int i = 0; i < 4; ++i)
      out->scales[4 * j + i] = static_cast<int16_t>(2 * ((w >> (3 * i)) & 7) + 1);
  }
  expand<8, true>(kIQ1Grid8, u, out->codes);
}
#endif  // AVX2

}  // namespace iq

template <>
struct CodeBlockDecoder<kIQ2_XXS> {
  static constexpr bool kHasMins = false;
  static constexpr int kMaxCode = 43;  // |code|
#if HYBRIDLLM_IQ_AVX2_GRID
  static constexpr const uint64_t* kGrid = kIQ2XXSGrid;
  static uint32_t grid_index(const uint8_t* super, int g) {
    return super[2 + 8 * (g / 4) + g % 4];
  }
  // d, the scales and the signs (u.signs) unpacked: decode without its codes
  static void unpack(const uint8_t* super, iq::Unpacked& u, CodeBlock* out) {
    out->d = half_to_float(iq::load16(super)) * 0.125f;
    iq::unpack_iq2_xxs(super, u, out);
  }
#endif
  static void decode(const uint8_t* super, CodeBlock* out) {
    out->d = half_to_float(iq::load16(super)) * 0.125f;
    iq::clear_mins(out);
#if HYBRIDLLM_IQ_SIMD
    iq::decode_iq2_xxs(super, out);
#else
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
    iq::expand<8, false>(kIQ2XXSGrid, u, out->codes);
#endif
  }
};

template <>
struct CodeBlockDecoder<kIQ2_XS> {
  static constexpr bool kHasMins = false;
  static constexpr int kMaxCode = 43;  // |code|
#if HYBRIDLLM_IQ_AVX2_GRID
  static constexpr const uint64_t* kGrid = kIQ2XSGrid;
  static uint32_t grid_index(const uint8_t* super, int g) {
    return iq::load16(super + 2 + 2 * g) & 511;
  }
  // d, the scales and the signs (u.signs) unpacked: decode without its codes
  static void unpack(const uint8_t* super, iq::Unpacked& u, CodeBlock* out) {
    out->d = half_to_float(iq::load16(super)) * 0.125f;
    iq::unpack_iq2_xs(super, u, out);
  }
#endif
  static void decode(const uint8_t* super, CodeBlock* out) {
    out->d = half_to_float(iq::load16(super)) * 0.125f;
    iq::clear_mins(out);
#if HYBRIDLLM_IQ_SIMD
    iq::decode_iq2_xs(super, out);
#else
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
    iq::expand<8, false>(kIQ2XSGrid, u, out->codes);
#endif
  }
};

template <>
struct CodeBlockDecoder<kIQ2_S> {
  static constexpr bool kHasMins = false;
  static constexpr int kMaxCode = 43;  // |code|
#if HYBRIDLLM_IQ_AVX2_GRID
  static constexpr const uint64_t* kGrid = kIQ2SGrid;
  static uint32_t grid_index(const uint8_t* super, int g) {
    return super[2 + g] | ((super[66 + g / 4] >> (2 * (g % 4))) & 3) << 8;
  }
  // d, the scales and the signs (u.signs) unpacked: decode without its codes
  static void unpack(const uint8_t* super, iq::Unpacked& u, CodeBlock* out) {
    out->d = half_to_float(iq::load16(super)) * 0.125f;
    iq::unpack_iq2_s(super, u, out);
  }
#endif
  static void decode(const uint8_t* super, CodeBlock* out) {
    out->d = half_to_float(iq::load16(super)) * 0.125f;
    iq::clear_mins(out);
#if HYBRIDLLM_IQ_SIMD
    iq::decode_iq2_s(super, out);
#else
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
    iq::expand<8, false>(kIQ2SGrid, u, out->codes);
#endif
  }
};

template <>
struct CodeBlockDecoder<kIQ3_XXS> {
  static constexpr bool kHasMins = false;
  static constexpr int kMaxCode = 62;  // |code|
  static void decode(const uint8_t* super, CodeBlock* out) {
    out->d = half_to_float(iq::load16(super)) * 0.25f;
    iq::clear_mins(out);
#if HYBRIDLLM_IQ_SIMD
    iq::decode_iq3_xxs(super, out);
#else
    iq::Unpacked u;
    for (int e = 0; e < 64; ++e) u.index[e] = super[2 + e];
    for (int j = 0; j < 8; ++j) {  // 32 weights a step
      const uint32_t aux = iq::load32(super + 66 + 4 * j);
      for (int i = 0; i < 4; ++i) u.signs[4 * j + i] = kIQSigns[(aux >> (7 * i)) & 127];
      iq::set_scale32(out, j, static_cast<int>(aux >> 28));
    }
    iq::expand<4, false>(kIQ3XXSGrid, u, out->codes);
#endif
  }
};

template <>
struct CodeBlockDecoder<kIQ3_S> {
  static constexpr bool kHasMins = false;
  static constexpr int kMaxCode = 15;  // |code|
  static void decode(const uint8_t* super, CodeBlock* out) {
    out->d = half_to_float(iq::load16(super));
    iq::clear_mins(out);
#if HYBRIDLLM_IQ_SIMD
    iq::decode_iq3_s(super, out);
#else
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
    iq::expand<4, false>(kIQ3SGrid, u, out->codes);
#endif
  }
};

template <>
struct CodeBlockDecoder<kIQ1_S> {
  static constexpr bool kHasMins = false;
  static constexpr int kMaxCode = 9;  // |code|
  static void decode(const uint8_t* super, CodeBlock* out) {
    out->d = half_to_float(iq::load16(super)) * 0.125f;
    iq::clear_mins(out);
#if HYBRIDLLM_IQ_SIMD
    iq::decode_iq1_s(super, out);
#else
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
    iq::expand<8, true>(kIQ1Grid8, u, out->codes);
#endif
  }
};

template <>
struct CodeBlockDecoder<kIQ1_M> {
  static constexpr bool kHasMins = false;
  static constexpr int kMaxCode = 9;  // |code|
  static void decode(const uint8_t* super, CodeBlock* out) {
    uint16_t sc[4];  // the scale words; their top nibbles are d's
    for (int j = 0; j < 4; ++j) sc[j] = iq::load16(super + 48 + 2 * j);
    const uint16_t d = (sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) |
                       (sc[3] & 0xf000);
    out->d = half_to_float(d) * 0.125f;
    iq::clear_mins(out);
#if HYBRIDLLM_IQ_SIMD
    iq::decode_iq1_m(super, out);
#else
    iq::Unpacked u;
    const uint8_t* qh = super + 32;
    for (int g = 0; g < 32; ++g) {
      const int nibble = (qh[g / 2] >> (4 * (g % 2))) & 15;
      u.index[g] = super[g] | (nibble & 7) << 8;
      u.signs[g] = (nibble & 8) ? 0xff : 0;
    }
    for (int j = 0; j < 4; ++j)
      for (int i = 0; i < 4; ++i)
        out->scales[4 * j + i] = static_cast<int16_t>(2 * ((sc[j] >> (3 * i)) & 7) + 1);
    iq::expand<8, true>(kIQ1Grid8, u, out->codes);
#endif
  }
};

}  // namespace hybridllm_gguf
