// Q4_K, Q5_K, Q6_K and IQ4_XS weights in x8 groups (gguf_x8.h) at few rows of x, and their
// unpacking for the int8 GEMM, on AVX2 builds without AVX-512. A 64-byte chunk of a group's
// codes is two 32-byte vectors whose 32-bit lanes are the group's 8 rows (lanes 0-7 and 8-15 of
// the AVX-512 layout), so vpmaddubsw multiplies 4 codes of each row by 4 values of x broadcast
// to every lane; the products add up in int16 as far as the codes' size allows (a Q4_K
// sub-block's, a Q5_K chunk's, half a Q6_K chunk's) and meet the 8 rows' scales in one
// vpmaddwd, and a super-block's float arithmetic is done for 8 rows at once. The row kernels
// (gguf_q8_dot.h) do that arithmetic, and a horizontal sum, a row at a time: on the AVX2-only
// Zen 3 of docs/benchmarks.md (machine C), an 8192 x 2048 matrix at one row of x from DRAM, 2
// threads, read 49 against their 35 G multiply-adds a second for Q4_K, 33 against 28 for Q6_K;
// from L2 a core computed a row's super-block in 16 against 29 cycles (Q4_K), 29 against 35
// (Q6_K). IQ4_XS's signed values (up to 127) allow no int16 sums beyond a pair: each of its
// vectors meets the scales in its own vpmaddwd; still 24 against the code-block kernel's 38-44
// cycles from L3, and 40.7 against 29.6 G multiply-adds a second from DRAM.
#include "gguf_x8.h"

#if defined(HYBRIDLLM_X8_AVX2)
#include <immintrin.h>

#include <cstring>
#include <type_traits>
#include <vector>

#include "gguf_blocks.h"
#include "gguf_code_decoders.h"
#include "gguf_q8_quantize.h"

namespace hybridllm_gguf {
namespace {

// 8 bytes of the rows' scales as the 16-bit pairs vpmaddwd takes: lane r's two words row r's
// scale (unsigned: Q4_K's sub-block scales; signed: Q6_K's chunk scales).
template <bool kSigned>
inline __m256i row_scales(const uint8_t* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m256i v = kSigned ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
  return _mm256_blend_epi16(v, _mm256_slli_epi32(v, 16), 0xAA);
}

// Whether the type has mins (Q4_K, Q5_K: dmin times 6-bit min codes a sub-block).
template <int64_t kType>
constexpr bool kHasMins = kType == kQ4_K || kType == kQ5_K;

// Chunk q's four code vectors: [0] the first 32 bytes' low nibbles (lane r: row r's weights
// 16 q + 0..3), [1] the last 32 bytes' (16 q + 4..7), [2], [3] their high nibbles (16 q + 8..11,
// 16 q + 12..15); Q5_K's fifth bit added as 16, Q6_K's top 2 bits as bits 4-5, IQ4_XS's nibbles
// looked up as its signed values.
template <int64_t kType>
inline void chunk_codes(const uint8_t* o, int q, __m256i codes[4]) {
  const uint8_t* c = o + chunk_code_offset<kType>(q);
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32));
  const __m256i m4 = _mm256_set1_epi8(15);
  codes[0] = _mm256_and_si256(a, m4);
  codes[1] = _mm256_and_si256(b, m4);
  codes[2] = _mm256_and_si256(_mm256_srli_epi16(a, 4), m4);
  codes[3] = _mm256_and_si256(_mm256_srli_epi16(b, 4), m4);
  if constexpr (kType == kIQ4_XS) {
    const __m256i values =
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Values)));
    for (int k = 0; k < 4; ++k) codes[k] = _mm256_shuffle_epi8(values, codes[k]);
  }
  if constexpr (kType == kQ5_K) {
    // bit i of the 8 bytes after the codes is code byte i's fifth bit for its low nibble, of the
    // next 8 for its high nibble: 32 bits at p spread to 16 in byte i where bit i is set
    const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
    const __m256i which = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2,
                                           2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const uint8_t* bits = o + q5_high_offset(q);
    for (int v = 0; v < 4; ++v) {  // the vectors' bits at bits + 4 (v % 2) + 8 (v / 2)
      int32_t word;
      std::memcpy(&word, bits + 4 * (v % 2) + 8 * (v / 2), sizeof(word));
      const __m256i spread = _mm256_and_si256(
          _mm256_shuffle_epi8(_mm256_set1_epi32(word), which), select);
      codes[v] = _mm256_add_epi8(codes[v], _mm256_and_si256(_mm256_cmpeq_epi8(spread, select),
                                                            _mm256_set1_epi8(16)));
    }
  }
  if constexpr (kType == kQ6_K) {
    // 128-bit lane G of the chunk's 64 bytes (a: G = 0, 1; b: 2, 3) has its top bits at bits
    // 2 G, 2 G + 1 of the 16 top bytes (the low nibbles' first, then the high nibbles'): moved
    // to bits 4, 5 within each byte
    const auto tops = [&](int half) {
      return _mm256_broadcastsi128_si256(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(o + q6_top_offset(q) + 16 * half)));
    };
    const __m256i m2 = _mm256_set1_epi8(0x30), up = _mm256_setr_epi64x(4, 4, 2, 2),
                  down = _mm256_setr_epi64x(0, 0, 2, 2);
    for (int half = 0; half < 2; ++half) {
      const __m256i t = tops(half);
      codes[2 * half] =
          _mm256_or_si256(codes[2 * half], _mm256_and_si256(_mm256_sllv_epi64(t, up), m2));
      codes[2 * half + 1] =
          _mm256_or_si256(codes[2 * half + 1], _mm256_and_si256(_mm256_srlv_epi64(t, down), m2));
    }
  }
}

// y[r * ldy + i] = dot(x row r, weight row i of the group at wg) for the kRows rows of x, x
// quantized in groups of 256 (xq), and for Q4_K / Q5_K their k_min_pair sums (min_pairs, 4 nsb
// a row; null for the others); `first`: the tile that reads the group from memory, which
// prefetches ahead.
template <int64_t kType, int kRows>
void group_tile(const Q8Rows& xq, const int32_t* min_pairs, int64_t nsb, const uint8_t* wg,
                float* y, int64_t ldy, bool first, const PrefetchWindow& prefetch) {
  constexpr int64_t kBytes = kGroupBytes<kType>;
  __m256 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* o = wg + s * kBytes;
    if (first) prefetch_ahead(prefetch, o, 1, 0, kBytes);
    __m256i sums[kRows];
    for (int r = 0; r < kRows; ++r) sums[r] = _mm256_setzero_si256();
    __m256i codes[4], products[4];
    if constexpr (kType == kQ6_K) {
#pragma GCC unroll 16
      for (int q = 0; q < 16; ++q) {
        chunk_codes<kType>(o, q, codes);
        const __m256i scale = row_scales<true>(o + 16 + 8 * q);
        for (int r = 0; r < kRows; ++r) {
          avx2_chunk_products(codes, xq.q + r * xq.q_stride + 256 * s + 16 * q, products);
          // codes <= 63: two pair sums fit int16, four need not
          sums[r] = _mm256_add_epi32(
              sums[r], _mm256_add_epi32(
                           _mm256_madd_epi16(_mm256_add_epi16(products[0], products[1]), scale),
                           _mm256_madd_epi16(_mm256_add_epi16(products[2], products[3]), scale)));
        }
      }
      // codes are q + 32: take off 32 * sum_q scale_q * (x's sum over chunk q), the chunks'
      // scales in pairs (chunks 2 p, 2 p + 1 of row r in lane r) against x's 16-value sums
      for (int p = 0; p < 8; ++p) {  // chunks 2 p, 2 p + 1
        const __m128i two = _mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 16 + 16 * p));
        const __m256i pairs =
            _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(two, _mm_srli_si128(two, 8)));
        for (int r = 0; r < kRows; ++r) {
          int32_t bsums;
          std::memcpy(&bsums, xq.bsums + r * xq.bsum_stride + 16 * s + 2 * p, sizeof(bsums));
          sums[r] = _mm256_sub_epi32(
              sums[r],
              _mm256_slli_epi32(_mm256_madd_epi16(pairs, _mm256_set1_epi32(bsums)), 5));
        }
      }
    } else if constexpr (kType == kIQ4_XS) {
      for (int j = 0; j < 8; ++j) {  // chunks 2 j, 2 j + 1: sub-block j
        const __m256i scale = row_scales<true>(o + 16 + 8 * j);
#pragma GCC unroll 2
        for (int q = 2 * j; q < 2 * j + 2; ++q) {
          chunk_codes<kType>(o, q, codes);
          __m256i magnitudes[4];
          for (int k = 0; k < 4; ++k) magnitudes[k] = _mm256_abs_epi8(codes[k]);
          for (int r = 0; r < kRows; ++r) {
            const int8_t* x = xq.q + r * xq.q_stride + 256 * s + 16 * q;
            // signed values: |value| times x with the value's sign, whose pair sums alone
            // fill int16 (|value| <= 127), so each meets the scales at once
            for (int k = 0; k < 4; ++k) {
              const __m256i p = _mm256_maddubs_epi16(
                  magnitudes[k], _mm256_sign_epi8(avx2_x_quad(x + 4 * k), codes[k]));
              sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(p, scale));
            }
          }
        }
      }
    } else {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {  // chunks 2 j, 2 j + 1: sub-block j
        __m256i next[4];
        chunk_codes<kType>(o, 2 * j, codes);
        chunk_codes<kType>(o, 2 * j + 1, next);
        const __m256i scale = row_scales<false>(o + 32 + 8 * j);
        for (int r = 0; r < kRows; ++r) {
          const int8_t* x = xq.q + r * xq.q_stride + 256 * s + 32 * j;
          // a chunk's 4 pair sums fit int16 (<= 4 * 2 * 31 * 128), and for Q4_K's codes
          // (<= 15) a sub-block's 8
          avx2_chunk_products(codes, x, products);
          const __m256i t0 = _mm256_add_epi16(_mm256_add_epi16(products[0], products[1]),
                                              _mm256_add_epi16(products[2], products[3]));
          avx2_chunk_products(next, x + 16, products);
          const __m256i t1 = _mm256_add_epi16(_mm256_add_epi16(products[0], products[1]),
                                              _mm256_add_epi16(products[2], products[3]));
          sums[r] = _mm256_add_epi32(
              sums[r], kType == kQ4_K ? _mm256_madd_epi16(_mm256_add_epi16(t0, t1), scale)
                                      : _mm256_add_epi32(_mm256_madd_epi16(t0, scale),
                                                         _mm256_madd_epi16(t1, scale)));
        }
      }
      // the mins, dmin * sum_j m_j * (x's sum over sub-block j): the 8 rows' min codes of
      // sub-blocks 2 p, 2 p + 1 as int16 pairs against x's sums over the two
      const __m256 dmin =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 16)));
      for (int r = 0; r < kRows; ++r) {
        const int32_t* pairs = min_pairs + (r * nsb + s) * 4;
        __m256i mins = _mm256_setzero_si256();
        for (int p = 0; p < 4; ++p) {
          const __m256i m = _mm256_cvtepu8_epi16(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 96 + 16 * p)));
          mins = _mm256_add_epi32(mins, _mm256_madd_epi16(m, _mm256_set1_epi32(pairs[p])));
        }
        acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins),
                                  _mm256_mul_ps(dmin, _mm256_set1_ps(xq.d[r * xq.g_stride + s])),
                                  acc[r]);
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o)));
    for (int r = 0; r < kRows; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]),
                               _mm256_mul_ps(d, _mm256_set1_ps(xq.d[r * xq.g_stride + s])), acc[r]);
  }
  for (int r = 0; r < kRows; ++r) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

template <int64_t kType>
void groups_typed(const Q8Rows& x, const int32_t* min_pairs, int64_t M, int64_t K,
                  const uint8_t* w, float* y, int64_t ldy, int64_t g0, int64_t g1,
                  const PrefetchWindow& prefetch) {
  const int64_t nsb = K / 256, group_bytes = nsb * kGroupBytes<kType>;
  avx2_x8_tiles(M, g0, g1, [&](int64_t g, int64_t r0, auto rows, bool first) {
    const int32_t* pairs = kHasMins<kType> ? min_pairs + r0 * 4 * nsb : nullptr;
    group_tile<kType, decltype(rows)::value>(x.row(r0), pairs, nsb, w + g * group_bytes,
                                             y + r0 * ldy + 8 * g, ldy, first, prefetch);
  });
}

template <int64_t kType>
void linear_grouped_typed(const float* x, const int64_t* starts, int64_t groups, int64_t K,
                          const uint8_t* const* weights, int64_t N, float* y) {
  thread_local std::vector<uint8_t> quantized;  // kept from call to call
  thread_local std::vector<int32_t> min_pairs;
  const int64_t M = starts[groups];
  const Q8Rows xq = quantize_rows<256>(x, M, K, quantized);
  // once a call, not once a weight group: x's sums over each two sub-blocks
  if constexpr (kHasMins<kType>) {
    min_pairs.resize(M * K / 64);
    for (int64_t r = 0; r < M; ++r)
      for (int64_t p = 0; p < K / 64; ++p)
        min_pairs[r * K / 64 + p] = k_min_pair(xq.row(r).bsums + 4 * p);
  }
  // the calling thread's buffer (a thread_local named in the loop's body is each thread's own)
  const int32_t* all_pairs = kHasMins<kType> ? min_pairs.data() : nullptr;
  for_x8_row_groups(starts, groups, K, weights, N, K / 256 * kGroupBytes<kType>,
                    [&](int64_t p, int64_t g0, int64_t g1, const PrefetchWindow& window) {
                      const int64_t r0 = starts[p];
                      const int32_t* pairs = all_pairs ? all_pairs + r0 * K / 64 : nullptr;
                      groups_typed<kType>(xq.row(r0), pairs, starts[p + 1] - r0, K, weights[p],
                                          y + r0 * N, N, g0, g1, window);
                    });
}

// The int8 GEMM's unpacking of a group (x8_unpack_group): chunk_codes' 4 vectors transposed
// into each row's 16 codes.
template <int64_t kType>
void unpack_group_typed(const uint8_t* group, int64_t K, uint8_t* codes, int64_t code_stride,
                        float* scales, int16_t* min_codes, float* min_scales,
                        int64_t unit_stride) {
  for (int64_t s = 0; s < K / 256; ++s) {
    const uint8_t* o = group + s * kGroupBytes<kType>;
    for (int q = 0; q < 16; ++q) {
      __m256i c[4];
      chunk_codes<kType>(o, q, c);
      avx2_store_chunk_rows(c, codes + 256 * s + 16 * q, code_stride);
    }
    for (int r = 0; r < 8; ++r) {
      const float d = half_to_float(load_u16(o + 2 * r));
      if constexpr (kType == kQ6_K || kType == kIQ4_XS) {  // a scale a unit of 16
        for (int q = 0; q < 16; ++q) {
          const int j = kType == kQ6_K ? q : q / 2;  // IQ4_XS: a sub-block's twice
          scales[r * unit_stride + 16 * s + q] =
              d * static_cast<float>(static_cast<int8_t>(o[16 + 8 * j + r]));
        }
      } else {
        min_scales[r * unit_stride + s] = -half_to_float(load_u16(o + 16 + 2 * r));
        for (int j = 0; j < 8; ++j) {
          scales[r * unit_stride + 8 * s + j] = d * static_cast<float>(o[32 + 8 * j + r]);
          min_codes[r * unit_stride + 8 * s + j] = o[96 + 16 * (j / 2) + 2 * r + j % 2];
        }
      }
    }
  }
}

// body(std::integral_constant<int64_t, T>) for source type T (Q4_K, Q5_K, Q6_K or IQ4_XS)
template <class Body>
void dispatch_source(int64_t source_type, Body body) {
  if (source_type == kQ4_K) body(std::integral_constant<int64_t, kQ4_K>{});
  else if (source_type == kQ5_K) body(std::integral_constant<int64_t, kQ5_K>{});
  else if (source_type == kQ6_K) body(std::integral_constant<int64_t, kQ6_K>{});
  else body(std::integral_constant<int64_t, kIQ4_XS>{});
}

}  // namespace

void avx2_x8_unpack_group(int64_t source_type, const uint8_t* group, int64_t K, uint8_t* codes,
                          int64_t code_stride, float* scales, int16_t* min_codes,
                          float* min_scales, int64_t unit_stride) {
  dispatch_source(source_type, [&](auto type) {
    unpack_group_typed<decltype(type)::value>(group, K, codes, code_stride, scales, min_codes,
                                              min_scales, unit_stride);
  });
}

void avx2_x8_linear_grouped(int64_t source_type, const float* x, const int64_t* starts,
                            int64_t groups, int64_t K, const uint8_t* const* weights, int64_t N,
                            float* y) {
  dispatch_source(source_type, [&](auto type) {
    linear_grouped_typed<decltype(type)::value>(x, starts, groups, K, weights, N, y);
  });
}

}  // namespace hybridllm_gguf
#endif
