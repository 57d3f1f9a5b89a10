// The vector operations the int8 dot products of gguf_q8_dot.h are written in, one struct per
// instruction set: AVX-512 VNNI (64-byte vectors), and 256-bit AVX2 with VNNI's vpdpbusd /
// vpdpwssd (AVX-VNNI, or AVX512-VNNI's 256-bit forms) or, without them, vpmaddubsw + vpmaddwd.
// Both work on "64 weights at a time" (a V): two 32-weight units, unit 0 in bytes 0-31, unit 1
// in bytes 32-63; the AVX2 one holds a V in two registers.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gguf_types.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace hybridllm_gguf {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HYBRIDLLM_Q8_AVX512 1
#if defined(__AVX512VBMI__)
// Q5_0 / Q5_1 quads unpacked by byte permutes (Avx512Vnni::quad5): where each output byte comes
// from in the quad's 4 * kBytes bytes. Lane k (block k), byte j: `nibbles` the block's nibble
// byte j; `low` / `high` the byte of its fifth bits that holds bit j of its low (high) half.
struct QuadIndex {
  alignas(64) uint8_t nibbles[64];
  alignas(64) uint8_t low[64];
  alignas(64) uint8_t high[64];
};
template <int64_t kBytes, int64_t kCodes>
constexpr QuadIndex quad_index() {
  QuadIndex t{};
  for (int i = 0; i < 64; ++i) {
    const int k = i / 16, j = i % 16, block = static_cast<int>(kBytes) * k;
    t.nibbles[i] = static_cast<uint8_t>(block + kCodes + j);
    t.low[i] = static_cast<uint8_t>(block + kCodes - 4 + j / 8);
    t.high[i] = static_cast<uint8_t>(block + kCodes - 2 + j / 8);
  }
  return t;
}
template <int64_t kBytes, int64_t kCodes>
inline constexpr QuadIndex kQuadIndex = quad_index<kBytes, kCodes>();
#endif
struct Avx512Vnni {
  using V = __m512i;  // 64 bytes, or 16 int32 sums
  using F = __m512;   // 16 fp32 partial sums (or block scales)
  // Q8_0 weights are made unsigned (w + 128) for vpdpbusd; kernels subtract 128 * sum(x) * d
  static constexpr int kQ8Offset = 128;

  static V zero() { return _mm512_setzero_si512(); }
  static V load64(const void* p) { return _mm512_loadu_si512(p); }
  static V broadcast32(const uint8_t* p) {
    return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // 32 bytes of nibbles: unit 0 the low nibbles, unit 1 the high ones (a K-quant sub-block pair)
  static V nibbles32(const uint8_t* p) {
    const V v = broadcast32(p);
    return _mm512_and_si512(_mm512_mask_srli_epi16(v, 0xFFFF0000u, v, 4), _mm512_set1_epi8(15));
  }
  // Four Q4_0/Q4_1 blocks' 16 nibble bytes (low nibbles weights 0-15, high 16-31), a 128-bit
  // lane each
  static V bytes16x4(const uint8_t* p0, const uint8_t* p1, const uint8_t* p2, const uint8_t* p3) {
    const __m256i lo = _mm256_inserti128_si256(_mm256_castsi128_si256(load16(p0)), load16(p1), 1);
    const __m256i hi = _mm256_inserti128_si256(_mm256_castsi128_si256(load16(p2)), load16(p3), 1);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
  static V low_nibbles(V v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
  static V high_nibbles(V v) {
    return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15));
  }
  // Two Q8_0 blocks' 32 int8 weights as w + 128
  static V q8x2(const uint8_t* p0, const uint8_t* p1) {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p0));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p1));
    return _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1),
                            _mm512_set1_epi8(static_cast<char>(0x80)));
  }
  // Q5_K: + 16 where bit `bit` (unit 0) or bit + 1 (unit 1) of hb's byte is set
  static V add_fifth_bit(V w, V hb, int bit) {
    const V select = _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << bit)),
                                        _mm256_set1_epi8(static_cast<char>(2 << bit)), 1);
    return _mm512_mask_add_epi8(w, _mm512_test_epi8_mask(hb, select), w, _mm512_set1_epi8(16));
  }
  // Q5_0, Q5_1: + 16 to byte i where bit i of `bits` is set
  static V add_fifth_bits(V w, uint64_t bits) {
    return _mm512_mask_add_epi8(w, bits, w, _mm512_set1_epi8(16));
  }
  // IQ4_NL, MXFP4: nibbles (bytes 0-15) as their table values + 128, unsigned like Q8_0's codes
  static V table_codes(V nibbles, const int8_t* table) {
    const __m128i values = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table)),
                                         _mm_set1_epi8(-128));
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(values), nibbles);
  }
  // Q6_K: 64 weights' 6-bit codes from a half's 64 ql bytes and its 32 qh bytes (broadcast):
  // part 0 the low nibbles with qh bits 0-1 (unit 0) and 2-3 (unit 1), part 1 the high nibbles
  // with bits 4-5 and 6-7. 16-bit shifts: what crosses from the neighbour byte is masked off.
  static V q6_codes(V ql, V hb, int part) {
    const V low = part == 0 ? ql : _mm512_srli_epi16(ql, 4);
    const V high =
        part == 0 ? _mm512_sllv_epi16(hb, shifts(4, 2)) : _mm512_srlv_epi16(hb, shifts(0, 2));
    return _mm512_ternarylogic_epi32(_mm512_and_si512(low, _mm512_set1_epi8(15)), high,
                                     _mm512_set1_epi8(0x30), 0xF8);  // a | (b & c)
  }
  // acc += 4-byte dot products of unsigned u and signed x
  static V dot_u8(V acc, V u, V x) { return _mm512_dpbusd_epi32(acc, u, x); }
  static V dot_q8(V acc, V w, V x) { return _mm512_dpbusd_epi32(acc, w, x); }
  // acc += sc * (u x pair sums), sc int16 per pair: no saturation while u * |x| <= 127 * 63
  static V dot_scaled(V acc, V u, V x, V sc) {
    return _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(u, x), sc);
  }
  // Code blocks (gguf_code_blocks.h): signed codes w meet x as |w| times x with w's sign. The
  // signs are found once a chunk of 64 codes, applied to each row of x (no vpsignb in AVX-512:
  // x negated where w < 0; where w = 0, |w| = 0 makes the product 0 anyway).
  using Signs = __mmask64;
  static Signs code_signs(V w) { return _mm512_movepi8_mask(w); }
  static V abs8(V w) { return _mm512_abs_epi8(w); }
  static V add8(V w, int c) { return _mm512_add_epi8(w, _mm512_set1_epi8(static_cast<char>(c))); }
  static V signed_x(V x, Signs s) { return _mm512_mask_sub_epi8(x, s, _mm512_setzero_si512(), x); }
  // The int16 unit scales of codes 64 z .. 64 z + 63 (units 4 z .. 4 z + 3, one a 128-bit lane)
  // spread over the int16 pair sums of vpmaddubsw
  static V code_scales(const int16_t* scales, int z) {
    const __m512i all = _mm512_castsi256_si512(
        _mm256_load_si256(reinterpret_cast<const __m256i*>(scales)));  // loaded once a block
    return _mm512_permutexvar_epi16(
        _mm512_add_epi16(_mm512_set1_epi16(static_cast<short>(4 * z)),
                         _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_setr_m128i(
                                                _mm_set1_epi16(0), _mm_set1_epi16(1))),
                                            _mm256_setr_m128i(_mm_set1_epi16(2), _mm_set1_epi16(3)),
                                            1)),
        all);
  }
  // K-quant sub-block scales (bytes 0-7) as int16 in every 128-bit lane; pair i's: units 2i, 2i+1
  static V k_scales(__m128i scales) { return _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(scales)); }
  static V k_pair_scales(V s, int i) {
    return _mm512_shuffle_epi8(s, _mm512_inserti64x4(_mm512_set1_epi16(word_index(2 * i)),
                                                     _mm256_set1_epi16(word_index(2 * i + 1)), 1));
  }
  // Q6_K's 16 int8 scales, one per 16 weights: 128-bit lane L holds scales L, 4 + L, 8 + L,
  // 12 + L as int32, so part z (weights 64 z ..) takes int32 z of each lane
  static V q6_scales(const int8_t* sc) {
    const __m128i t =
        _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)),
                         _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
    return _mm512_cvtepi8_epi32(t);
  }
  static V q6_part_scales(V s, int z) {
    return _mm512_shuffle_epi8(s, _mm512_set1_epi16(word_index(2 * z)));
  }

  // The fp16 word at byte 0 (and, with kMins, at byte 2) of n <= 16 blocks kBytes apart, as
  // floats; lanes past n are 0. One gather of the blocks' first 32-bit words.
  template <int64_t kBytes, bool kMins>
  static void block_scales16(const uint8_t* p, int64_t n, F* d, F* m) {
    const __m512i index =
        _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                           _mm512_set1_epi32(kBytes));
    const __mmask16 live = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
    const __m512i words = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, index, p, 1);
    *d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words));
    if constexpr (kMins) *m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(words, 16)));
  }
  // MXFP4: the E8M0 byte at byte 0 of n <= 16 blocks kBytes apart as e8m0_half_to_float gives
  // it, 2^(e - 128): (e - 1) << 23, or the subnormal 0x200000 << e for e < 2; lanes past n 0.
  template <int64_t kBytes>
  static void e8m0_scales16(const uint8_t* p, int64_t n, F* d) {
    const __m512i index =
        _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                           _mm512_set1_epi32(kBytes));
    const __mmask16 live = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
    const __m512i e = _mm512_and_si512(
        _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, index, p, 1),
        _mm512_set1_epi32(255));
    const __mmask16 small = _mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(2));
    const __m512i bits = _mm512_mask_sllv_epi32(
        _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23), small,
        _mm512_set1_epi32(0x00200000), e);
    *d = _mm512_castsi512_ps(_mm512_maskz_mov_epi32(live, bits));
  }
#if defined(__AVX512VBMI__)
  static constexpr bool kQuadPermute = true;
  // Q5_0, Q5_1: the codes (5-bit values) of the quad of blocks kBytes apart from blk, `left`
  // blocks left in the row, as bytes16x4 + low_nibbles / high_nibbles + add_quad_fifth_bits give
  // them (zeros past the row's end): the quad read as 64 + 32 bytes, the nibble bytes and the
  // bytes of the fifth bits put in place by vpermt2b. Masked loads (nothing read past the row)
  // only near the row's end: on a Zen 5 EPYC they cost the kernel 25% more than plain ones.
  template <int64_t kBytes, int64_t kCodes>
  static void quad5(const uint8_t* blk, int64_t left, V* low, V* high) {
    static_assert(4 * kBytes <= 96, "a quad in 96 bytes");
    constexpr const QuadIndex& index = kQuadIndex<kBytes, kCodes>;
    V a, b;  // b: bytes 64-95 (the upper half unused)
    if (left * kBytes >= 96) {
      a = load64(blk);
      b = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64)));
    } else {
      const int64_t bytes = std::min<int64_t>(left, 4) * kBytes;
      const __mmask64 first = bytes >= 64 ? ~0ull : (1ull << bytes) - 1;
      const __mmask64 second = bytes > 64 ? (1ull << (bytes - 64)) - 1 : 0;
      a = _mm512_maskz_loadu_epi8(first, blk);
      b = _mm512_maskz_loadu_epi8(second, blk + 64);
    }
    const V nibbles = _mm512_permutex2var_epi8(a, load64(index.nibbles), b);
    const V select = _mm512_set1_epi64(static_cast<int64_t>(0x8040201008040201ull));
    const V sixteen = _mm512_set1_epi8(16);
    const V lo = low_nibbles(nibbles), hi = high_nibbles(nibbles);
    const __mmask64 lo_bits =
        _mm512_test_epi8_mask(_mm512_permutex2var_epi8(a, load64(index.low), b), select);
    const __mmask64 hi_bits =
        _mm512_test_epi8_mask(_mm512_permutex2var_epi8(a, load64(index.high), b), select);
    *low = _mm512_mask_add_epi8(lo, lo_bits, lo, sixteen);
    *high = _mm512_mask_add_epi8(hi, hi_bits, hi, sixteen);
  }
#else
  static constexpr bool kQuadPermute = false;
  template <int64_t kBytes, int64_t kCodes>
  static void quad5(const uint8_t*, int64_t, V*, V*) {}
#endif
  // Q5_0, Q5_1: + 16 to each byte of a quad's low and high nibble vectors (bytes16x4) whose
  // weight's fifth bit is set; `words` the four blocks' fifth bits (quad_words). Every lane gets
  // the four words, lane k spreads byte j / 8 of block k's low (high) half over its byte j, and
  // each byte's own bit is tested. (A gather of 16 blocks' words cost 1.8x the whole quad loop
  // on a Zen 5 EPYC.)
  static void add_quad_fifth_bits(V* low, V* high, __m128i words) {
    const V all = _mm512_broadcast_i32x4(words);
    const V select = _mm512_set1_epi64(static_cast<int64_t>(0x8040201008040201ull));
    const V lo = _mm512_shuffle_epi8(all, spread_index(0));
    const V hi = _mm512_shuffle_epi8(all, spread_index(2));
    const V sixteen = _mm512_set1_epi8(16);
    *low = _mm512_mask_add_epi8(*low, _mm512_test_epi8_mask(lo, select), *low, sixteen);
    *high = _mm512_mask_add_epi8(*high, _mm512_test_epi8_mask(hi, select), *high, sixteen);
  }
  static F fzero() { return _mm512_setzero_ps(); }
  static F load16(const float* p) { return _mm512_loadu_ps(p); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F mul(F a, float b) { return _mm512_mul_ps(a, _mm512_set1_ps(b)); }
  static F fma(F a, F b, F acc) { return _mm512_fmadd_ps(a, b, acc); }
  // 16 block scales s16 -> pair p's: unit 0 lanes s16[2p], unit 1 lanes s16[2p + 1]
  static F pair_scale(F s16, int p) {
    return _mm512_permutexvar_ps(
        _mm512_inserti64x4(_mm512_set1_epi32(2 * p), _mm256_set1_epi32(2 * p + 1), 1), s16);
  }
  // 16 block scales s16 -> quad q's: 128-bit lane k holds s16[4q + k]
  static F quad_scale(F s16, int q) {
    return _mm512_permutexvar_ps(
        _mm512_add_epi32(_mm512_set1_epi32(4 * q),
                         _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)),
        s16);
  }
  static V add32(V a, V b) { return _mm512_add_epi32(a, b); }
  static V sub32(V a, V b) { return _mm512_sub_epi32(a, b); }
  // the two units' int32 sums added lane by lane
  static __m256i fold(V v) {
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
  }
  static F fma_cvt(F acc, V sums, F scale) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, acc);
  }
  static float reduce(F a) { return _mm512_reduce_add_ps(a); }

 private:
  static __m128i load16(const uint8_t* p) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  }
  // lane k: byte 4 k + half, 8 times, then byte 4 k + half + 1, 8 times
  static V spread_index(char half) {
    const V k4 = _mm512_setr_epi32(0, 0, 0, 0, 0x04040404, 0x04040404, 0x04040404, 0x04040404,
                                   0x08080808, 0x08080808, 0x08080808, 0x08080808, 0x0C0C0C0C,
                                   0x0C0C0C0C, 0x0C0C0C0C, 0x0C0C0C0C);
    return _mm512_add_epi8(k4, _mm512_broadcast_i32x4(_mm_setr_epi8(
                                   half, half, half, half, half, half, half, half, half + 1,
                                   half + 1, half + 1, half + 1, half + 1, half + 1, half + 1,
                                   half + 1)));
  }
  static V shifts(short unit0, short unit1) {
    return _mm512_inserti64x4(_mm512_set1_epi16(unit0), _mm256_set1_epi16(unit1), 1);
  }
  // the vpshufb index that spreads 16-bit word j of each 128-bit lane over the lane
  static short word_index(int j) { return static_cast<short>((2 * j) | (2 * j + 1) << 8); }
};
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HYBRIDLLM_Q8_AVX2 1
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define HYBRIDLLM_Q8_AVX2_VNNI 1
#endif
// kVnni: vpdpbusd / vpdpwssd (needs HYBRIDLLM_Q8_AVX2_VNNI), else vpmaddubsw + vpmaddwd + add.
template <bool kVnni>
struct Avx2Q8 {
  struct V {
    __m256i lo, hi;
  };
  struct F {
    __m256 lo, hi;
  };
  // Q8_0 weights stay signed: |w| times x with w's sign (vpsignb), no offset
  static constexpr int kQ8Offset = 0;

  static V zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
  static V load64(const void* p) {
    const __m256i* v = reinterpret_cast<const __m256i*>(p);
    return {_mm256_loadu_si256(v), _mm256_loadu_si256(v + 1)};
  }
  static V broadcast32(const uint8_t* p) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {v, v};
  }
  static V nibbles32(const uint8_t* p) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                  m = _mm256_set1_epi8(15);
    return {_mm256_and_si256(v, m), _mm256_and_si256(_mm256_srli_epi16(v, 4), m)};
  }
  static V bytes16x4(const uint8_t* p0, const uint8_t* p1, const uint8_t* p2, const uint8_t* p3) {
    const auto load2 = [](const uint8_t* a, const uint8_t* b) {
      return _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(b),
                                 reinterpret_cast<const __m128i*>(a));
    };
    return {load2(p0, p1), load2(p2, p3)};
  }
  static V low_nibbles(V v) {
    const __m256i m = _mm256_set1_epi8(15);
    return {_mm256_and_si256(v.lo, m), _mm256_and_si256(v.hi, m)};
  }
  static V high_nibbles(V v) {
    const __m256i m = _mm256_set1_epi8(15);
    return {_mm256_and_si256(_mm256_srli_epi16(v.lo, 4), m),
            _mm256_and_si256(_mm256_srli_epi16(v.hi, 4), m)};
  }
  static V q8x2(const uint8_t* p0, const uint8_t* p1) {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p0)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p1))};
  }
  static constexpr bool kQuadPermute = false;
  template <int64_t kBytes, int64_t kCodes>
  static void quad5(const uint8_t*, int64_t, V*, V*) {}
  // Q5_0, Q5_1: as Avx512Vnni's (V.lo's 128-bit lanes blocks 0 and 1, V.hi's 2 and 3)
  static void add_quad_fifth_bits(V* low, V* high, __m128i words) {
    const __m256i all = _mm256_broadcastsi128_si256(words);
    const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
    const __m256i sixteen = _mm256_set1_epi8(16);
    // 16 where the bit is set: `first` the byte of `words` that the first block's half starts
    // at (blocks 0-1: 0, 2-3: 8; the low halves + 0, the high ones + 2)
    const auto bits = [&](char first) {
      const __m256i index = _mm256_add_epi8(
          _mm256_set1_epi8(first),
          _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 4, 4, 4, 4, 4, 4, 4,
                           4, 5, 5, 5, 5, 5, 5, 5, 5));
      const __m256i spread = _mm256_and_si256(_mm256_shuffle_epi8(all, index), select);
      return _mm256_and_si256(_mm256_cmpeq_epi8(spread, select), sixteen);
    };
    low->lo = _mm256_add_epi8(low->lo, bits(0));
    low->hi = _mm256_add_epi8(low->hi, bits(8));
    high->lo = _mm256_add_epi8(high->lo, bits(2));
    high->hi = _mm256_add_epi8(high->hi, bits(10));
  }
  // IQ4_NL, MXFP4: nibbles (bytes 0-15) as their signed table values, for dot_q8 (kQ8Offset 0)
  static V table_codes(V nibbles, const int8_t* table) {
    const __m256i values =
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table)));
    return {_mm256_shuffle_epi8(values, nibbles.lo), _mm256_shuffle_epi8(values, nibbles.hi)};
  }
  static V add_fifth_bit(V w, V hb, int bit) {
    const __m256i b0 = _mm256_set1_epi8(static_cast<char>(1 << bit));
    const __m256i b1 = _mm256_set1_epi8(static_cast<char>(2 << bit)),
                  sixteen = _mm256_set1_epi8(16);
    return {
        _mm256_add_epi8(
            w.lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hb.lo, b0), b0), sixteen)),
        _mm256_add_epi8(
            w.hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hb.hi, b1), b1), sixteen))};
  }
  static V q6_codes(V ql, V hb, int part) {
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(0x30);
    if (part == 0)
      return {_mm256_or_si256(_mm256_and_si256(ql.lo, m4),
                              _mm256_and_si256(_mm256_slli_epi16(hb.lo, 4), m2)),
              _mm256_or_si256(_mm256_and_si256(ql.hi, m4),
                              _mm256_and_si256(_mm256_slli_epi16(hb.hi, 2), m2))};
    return {_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql.lo, 4), m4),
                            _mm256_and_si256(hb.lo, m2)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql.hi, 4), m4),
                            _mm256_and_si256(_mm256_srli_epi16(hb.hi, 2), m2))};
  }
  static V dot_u8(V acc, V u, V x) {
    return {dpbusd(acc.lo, u.lo, x.lo), dpbusd(acc.hi, u.hi, x.hi)};
  }
  static V dot_q8(V acc, V w, V x) {
    // |w| * (x with w's sign): |w| <= 128 and |x| <= 127 keep vpmaddubsw's pair sums in int16
    return {dpbusd(acc.lo, _mm256_sign_epi8(w.lo, w.lo), _mm256_sign_epi8(x.lo, w.lo)),
            dpbusd(acc.hi, _mm256_sign_epi8(w.hi, w.hi), _mm256_sign_epi8(x.hi, w.hi))};
  }
  static V dot_scaled(V acc, V u, V x, V sc) {
    return {dpwssd(acc.lo, _mm256_maddubs_epi16(u.lo, x.lo), sc.lo),
            dpwssd(acc.hi, _mm256_maddubs_epi16(u.hi, x.hi), sc.hi)};
  }
  // Code blocks: as Avx512Vnni's, vpsignb applying w's sign to x (and zeroing x where w = 0)
  using Signs = V;
  static Signs code_signs(V w) { return w; }
  static V abs8(V w) { return {_mm256_abs_epi8(w.lo), _mm256_abs_epi8(w.hi)}; }
  static V add8(V w, int c) {
    const __m256i v = _mm256_set1_epi8(static_cast<char>(c));
    return {_mm256_add_epi8(w.lo, v), _mm256_add_epi8(w.hi, v)};
  }
  static V signed_x(V x, Signs s) {
    return {_mm256_sign_epi8(x.lo, s.lo), _mm256_sign_epi8(x.hi, s.hi)};
  }
  static V code_scales(const int16_t* scales, int z) {
    int64_t four;
    std::memcpy(&four, scales + 4 * z, sizeof(four));
    const __m256i v = _mm256_set1_epi64x(four);
    return {_mm256_shuffle_epi8(v, _mm256_setr_epi64x(0x0100010001000100, 0x0100010001000100,
                                                      0x0302030203020302, 0x0302030203020302)),
            _mm256_shuffle_epi8(v, _mm256_setr_epi64x(0x0504050405040504, 0x0504050405040504,
                                                      0x0706070607060706, 0x0706070607060706))};
  }
  static V k_scales(__m128i scales) {
    const __m256i v = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(scales));
    return {v, v};
  }
  static V k_pair_scales(V s, int i) {
    return {_mm256_shuffle_epi8(s.lo, _mm256_set1_epi16(word_index(2 * i))),
            _mm256_shuffle_epi8(s.hi, _mm256_set1_epi16(word_index(2 * i + 1)))};
  }
  static V q6_scales(const int8_t* sc) {
    const __m128i t =
        _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)),
                         _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
    return {_mm256_cvtepi8_epi32(t), _mm256_cvtepi8_epi32(_mm_srli_si128(t, 8))};
  }
  static V q6_part_scales(V s, int z) {
    const __m256i index = _mm256_set1_epi16(word_index(2 * z));
    return {_mm256_shuffle_epi8(s.lo, index), _mm256_shuffle_epi8(s.hi, index)};
  }

  template <int64_t kBytes, bool kMins>
  static void block_scales16(const uint8_t* p, int64_t n, F* d, F* m) {
    const __m256i index =
        _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(kBytes));
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    // the low 16 bits of each 32-bit word, packed into 8 halves
    const __m256i low_halves =
        _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1, 0, 1, 4, 5, 8, 9,
                         12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
    const auto halves = [&](__m256i words) {
      const __m256i packed =
          _mm256_permute4x64_epi64(_mm256_shuffle_epi8(words, low_halves), 0b1000);
      return _mm256_cvtph_ps(_mm256_castsi256_si128(packed));
    };
    for (int h = 0; h < 2; ++h) {
      const __m256i live =
          _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - 8 * h)), lanes);
      const __m256i words = _mm256_mask_i32gather_epi32(
          _mm256_setzero_si256(), reinterpret_cast<const int*>(p + 8 * h * kBytes), index, live, 1);
      (h == 0 ? d->lo : d->hi) = halves(words);
      if constexpr (kMins) (h == 0 ? m->lo : m->hi) = halves(_mm256_srli_epi32(words, 16));
    }
  }
  // MXFP4: as Avx512Vnni's e8m0_scales16
  template <int64_t kBytes>
  static void e8m0_scales16(const uint8_t* p, int64_t n, F* d) {
    const __m256i index =
        _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(kBytes));
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int h = 0; h < 2; ++h) {
      const __m256i live =
          _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - 8 * h)), lanes);
      const __m256i e = _mm256_and_si256(
          _mm256_mask_i32gather_epi32(_mm256_setzero_si256(),
                                      reinterpret_cast<const int*>(p + 8 * h * kBytes), index,
                                      live, 1),
          _mm256_set1_epi32(255));
      const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
      const __m256i bits =
          _mm256_blendv_epi8(_mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23),
                             _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e), small);
      (h == 0 ? d->lo : d->hi) = _mm256_castsi256_ps(_mm256_and_si256(bits, live));
    }
  }
  static F fzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static F load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static F mul(F a, F b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
  static F mul(F a, float b) { return mul(a, F{_mm256_set1_ps(b), _mm256_set1_ps(b)}); }
  static F fma(F a, F b, F acc) {
    return {_mm256_fmadd_ps(a.lo, b.lo, acc.lo), _mm256_fmadd_ps(a.hi, b.hi, acc.hi)};
  }
  static F pair_scale(F s16, int p) {
    const __m256 half = p < 4 ? s16.lo : s16.hi;
    return {_mm256_permutevar8x32_ps(half, _mm256_set1_epi32(2 * p % 8)),
            _mm256_permutevar8x32_ps(half, _mm256_set1_epi32((2 * p + 1) % 8))};
  }
  static F quad_scale(F s16, int q) {
    const __m256 half = q < 2 ? s16.lo : s16.hi;
    const __m256i pairs = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    return {
        _mm256_permutevar8x32_ps(half, _mm256_add_epi32(pairs, _mm256_set1_epi32(4 * q % 8))),
        _mm256_permutevar8x32_ps(half, _mm256_add_epi32(pairs, _mm256_set1_epi32(4 * q % 8 + 2)))};
  }
  static V add32(V a, V b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
  static V sub32(V a, V b) { return {_mm256_sub_epi32(a.lo, b.lo), _mm256_sub_epi32(a.hi, b.hi)}; }
  static __m256i fold(V v) { return _mm256_add_epi32(v.lo, v.hi); }
  static F fma_cvt(F acc, V sums, F scale) {
    return {_mm256_fmadd_ps(_mm256_cvtepi32_ps(sums.lo), scale.lo, acc.lo),
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums.hi), scale.hi, acc.hi)};
  }
  static float reduce(F a) {
    const __m256 s = _mm256_add_ps(a.lo, a.hi);
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
  }

 private:
  static __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
#if defined(HYBRIDLLM_Q8_AVX2_VNNI)
    if constexpr (kVnni) {
#if defined(__AVXVNNI__)
      return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
      return _mm256_dpbusd_epi32(acc, u, s);
#endif
    }
#endif
    return _mm256_add_epi32(acc,
                            _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
  }
  static __m256i dpwssd(__m256i acc, __m256i a, __m256i b) {
#if defined(HYBRIDLLM_Q8_AVX2_VNNI)
    if constexpr (kVnni) {
#if defined(__AVXVNNI__)
      return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
      return _mm256_dpwssd_epi32(acc, a, b);
#endif
    }
#endif
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
  }
  static short word_index(int j) { return static_cast<short>((2 * j) | (2 * j + 1) << 8); }
};
#endif

}  // namespace hybridllm_gguf
