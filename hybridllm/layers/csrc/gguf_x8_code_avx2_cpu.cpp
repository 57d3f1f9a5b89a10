// Q2_K and Q3_K weights in x8 groups (gguf_x8.h's Q2_KX8, Q3_KX8) at few rows of x, and their
// unpacking for the int8 GEMM, on AVX2 builds without AVX-512. As for the K-quants'
// (gguf_x8_avx2_cpu.cpp), the first and last 32 bytes of a chunk pair's codes hold the group's 8
// rows in their 32-bit lanes: a field of 2 bits (Q3_K: plus its high bit as 4) is 4 codes of each
// row, vpmaddubsw multiplies them by 4 values of x broadcast to every lane, a unit's (16 weights')
// products add up in int16 and meet the 8 rows' unit scales in one vpmaddwd. Q2_K's mins and
// Q3_K's offset of 4 are the rows' min (scale) pairs against x's unit sums, one vpmaddwd a pair of
// units; a super-block's float arithmetic is done for 8 rows at once.
#include "gguf_x8.h"

#if defined(HYBRIDLLM_X8_AVX2)
#include <immintrin.h>

#include <cstring>
#include <type_traits>

#include "gguf_blocks.h"
#include "gguf_q8_quantize.h"

namespace hybridllm_gguf {
namespace {

static_assert(kGroupBytes<kQ2_K> == 8 * 84 && kGroupBytes<kQ3_K> == 8 * 110);

// Unit q's (chunk q's) four code vectors as unsigned bytes, vector k (lane r) row r's codes of
// weights 16 q + 4 k .. + 3: field f = 2 (q % 2) + k / 2 of the pair's first (k even) or last
// (k odd) 32 code bytes; Q3_K's high bit added as 4 (its codes are then code + 4).
template <int64_t kType>
inline void unit_codes(const uint8_t* o, int q, __m256i codes[4]) {
  const uint8_t* c = o + code_pair_offset<kType>(q / 2);
  const __m256i three = _mm256_set1_epi8(3);
  for (int k = 0; k < 4; ++k) {
    const int f = 2 * (q % 2) + k / 2;
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * (k % 2)));
    codes[k] = _mm256_and_si256(_mm256_srli_epi16(bytes, 2 * f), three);
    if constexpr (kType == kQ3_K) {
      // byte j of the 32 after the codes holds code byte j's high bits (bit f: field f) and
      // code byte 32 + j's (bit 4 + f): moved to bit 2 (a 16-bit shift of at most 5 keeps bit 2
      // of each byte within its byte) and added as 4. Spread from 8 bits a byte (the AVX-512
      // layout: vpshufb, an and and a compare) this took 40 of the kernel's ~80 operations a
      // row's super-block.
      const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64));
      const int from = 4 * (k % 2) + f;
      const __m256i moved =
          from >= 2 ? _mm256_srli_epi16(high, from - 2) : _mm256_slli_epi16(high, 2 - from);
      codes[k] = _mm256_or_si256(codes[k], _mm256_and_si256(moved, _mm256_set1_epi8(4)));
    }
  }
}

// Q3_K's 128 scales of a group super-block, minus 32, as int8 at code_unit_index: v[i] the
// 32 of unit pairs 2 i, 2 i + 1 (the low 4 bits of pairs 0-3 in the low nibbles of bytes 16-79,
// of pairs 4-7 in the high nibbles; the top 2 bits of pairs 2 i, 2 i + 1 at bits 2 i of bytes
// 80-111).
inline void q3_scales(const uint8_t* o, __m256i v[4]) {
  const __m256i lo0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + 16));
  const __m256i lo1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + 48));
  const __m256i top = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + 80));
  const __m256i nibble = _mm256_set1_epi8(15), high = _mm256_set1_epi8(0x30);
  const __m256i bias = _mm256_set1_epi8(32);
  const __m256i low[4] = {lo0, lo1, _mm256_srli_epi16(lo0, 4), _mm256_srli_epi16(lo1, 4)};
  const __m256i tops[4] = {_mm256_slli_epi16(top, 4), _mm256_slli_epi16(top, 2), top,
                           _mm256_srli_epi16(top, 2)};
  for (int i = 0; i < 4; ++i)
    v[i] = _mm256_sub_epi8(
        _mm256_or_si256(_mm256_and_si256(low[i], nibble), _mm256_and_si256(tops[i], high)), bias);
}

// Unit pair p's scale bytes as int16 pairs, lane r row r's (unit 2 p, unit 2 p + 1): Q2_K's bytes
// (the scale in the low nibble, the min in the high one); Q3_K's scales from q3_scales.
template <int64_t kType>
inline __m256i pair_bytes(const uint8_t* o, int p, const __m256i q3[4]) {
  if constexpr (kType == kQ2_K) {
    (void)q3;
    return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 32 + 16 * p)));
  } else {
    (void)o;
    const __m256i v = q3[p / 2];
    return _mm256_cvtepi8_epi16(p % 2 ? _mm256_extracti128_si256(v, 1) : _mm256_castsi256_si128(v));
  }
}

// y[r * ldy + i] = dot(x row r, weight row i of the group at wg) for the kRows rows of x, x
// quantized in groups of 256 with its 16-value sums; `first`: the tile that reads the group from
// memory, which prefetches ahead.
template <int64_t kType, int kRows>
void group_tile(const Q8Rows& xq, int64_t nsb, const uint8_t* wg, float* y, int64_t ldy,
                bool first, const PrefetchWindow& prefetch) {
  constexpr int64_t kBytes = kGroupBytes<kType>;
  __m256 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* o = wg + s * kBytes;
    if (first) prefetch_ahead(prefetch, o, 1, 0, kBytes);
    __m256i q3[4];
    if constexpr (kType == kQ3_K) q3_scales(o, q3);
    // sums: sum_u scale_u * (codes . x) over unit u; mins (Q2_K): sum_u min_u * (x's sum over u)
    __m256i sums[kRows], mins[kRows];
    for (int r = 0; r < kRows; ++r) sums[r] = mins[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p) {  // units 2 p, 2 p + 1
      const __m256i bytes = pair_bytes<kType>(o, p, q3);
      // Q2_K: the scales are the low nibbles, the mins the high ones; Q3_K: the scales as they
      // are, and their pairs times 4 take the codes' offset off against x's unit sums
      const __m256i pair = kType == kQ2_K ? _mm256_and_si256(bytes, _mm256_set1_epi16(15)) : bytes;
      const __m256i against_sums =
          kType == kQ2_K ? _mm256_srli_epi16(bytes, 4) : _mm256_slli_epi16(bytes, 2);
      // each unit's scale in both words of a row's lane
      const __m256i scale[2] = {_mm256_blend_epi16(pair, _mm256_slli_epi32(pair, 16), 0xAA),
                                _mm256_blend_epi16(_mm256_srli_epi32(pair, 16), pair, 0xAA)};
      for (int u = 0; u < 2; ++u) {
        __m256i codes[4], products[4];
        unit_codes<kType>(o, 2 * p + u, codes);
        for (int r = 0; r < kRows; ++r) {
          avx2_chunk_products(codes, xq.q + r * xq.q_stride + 256 * s + 32 * p + 16 * u,
                              products);
          // codes <= 7: a unit's 4 pair sums fit int16 (<= 4 * 2 * 7 * 127)
          const __m256i t = _mm256_add_epi16(_mm256_add_epi16(products[0], products[1]),
                                             _mm256_add_epi16(products[2], products[3]));
          sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(t, scale[u]));
        }
      }
      for (int r = 0; r < kRows; ++r) {
        int32_t x_pair;  // x's sums over units 2 p, 2 p + 1 as one int16 pair
        std::memcpy(&x_pair, xq.bsums + r * xq.bsum_stride + 16 * s + 2 * p, sizeof(x_pair));
        const __m256i m = _mm256_madd_epi16(against_sums, _mm256_set1_epi32(x_pair));
        if constexpr (kType == kQ2_K)
          mins[r] = _mm256_add_epi32(mins[r], m);
        else
          sums[r] = _mm256_sub_epi32(sums[r], m);
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o)));
    for (int r = 0; r < kRows; ++r) {
      const __m256 xd = _mm256_set1_ps(xq.d[r * xq.g_stride + s]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_mul_ps(d, xd), acc[r]);
      if constexpr (kType == kQ2_K) {
        const __m256 dmin =
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 16)));
        acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins[r]), _mm256_mul_ps(dmin, xd), acc[r]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

template <int64_t kType>
void linear_grouped_typed(const float* x, const int64_t* starts, int64_t groups, int64_t K,
                          const uint8_t* const* weights, int64_t N, float* y) {
  const int64_t nsb = K / 256;
  avx2_x8_linear_rows256(x, starts, groups, K, weights, N, y, nsb * kGroupBytes<kType>,
                         [&](auto rows, const Q8Rows& xt, const uint8_t* wg, float* yt,
                             bool first, const PrefetchWindow& window) {
                           group_tile<kType, decltype(rows)::value>(xt, nsb, wg, yt, N, first,
                                                                    window);
                         });
}

// An 8 x 8 matrix of 16-bit words transposed: out[r]'s word p is in[p]'s word r.
inline void transpose_words(const __m128i in[8], __m128i out[8]) {
  __m128i a[8], b[8];
  for (int i = 0; i < 4; ++i) {
    a[2 * i] = _mm_unpacklo_epi16(in[2 * i], in[2 * i + 1]);      // words 0-3 of both
    a[2 * i + 1] = _mm_unpackhi_epi16(in[2 * i], in[2 * i + 1]);  // words 4-7
  }
  for (int h = 0; h < 2; ++h)  // in[0-3], in[4-7]
    for (int k = 0; k < 2; ++k) {  // words 0-3, 4-7
      b[4 * h + 2 * k] = _mm_unpacklo_epi32(a[4 * h + k], a[4 * h + 2 + k]);
      b[4 * h + 2 * k + 1] = _mm_unpackhi_epi32(a[4 * h + k], a[4 * h + 2 + k]);
    }
  for (int j = 0; j < 4; ++j) {  // words 2 j, 2 j + 1
    out[2 * j] = _mm_unpacklo_epi64(b[j], b[4 + j]);
    out[2 * j + 1] = _mm_unpackhi_epi64(b[j], b[4 + j]);
  }
}

// 16 int32 unit scales times d, as floats at out.
inline void store_unit_scales(__m256i lo, __m256i hi, float d, float* out) {
  const __m256 dv = _mm256_set1_ps(d);
  _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_cvtepi32_ps(lo), dv));
  _mm256_storeu_ps(out + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(hi), dv));
}

// The group's 8 rows as the AVX2 int8 GEMM unpacks a Q2_K / Q3_K row (gguf_q8_gemm_avx2_cpu.cpp's
// unpack_row): the codes (Q3_K's plus 4), d * scale a unit, Q2_K's 4-bit mins and -dmin. A row's
// 16 scale bytes are word r of each unit pair's 16 bytes: an 8 x 8 transpose of words.
template <int64_t kType>
void unpack_group_typed(const uint8_t* group, int64_t K, uint8_t* codes, int64_t code_stride,
                        float* scales, int16_t* min_codes, float* min_scales,
                        int64_t unit_stride) {
  for (int64_t s = 0; s < K / 256; ++s) {
    const uint8_t* o = group + s * kGroupBytes<kType>;
    for (int q = 0; q < 16; ++q) {
      __m256i c[4];
      unit_codes<kType>(o, q, c);
      avx2_store_chunk_rows(c, codes + 256 * s + 16 * q, code_stride);
    }
    __m128i pairs[8], rows[8];  // unit pair p's scale bytes; row r's 16, in unit order
    if constexpr (kType == kQ2_K) {
      for (int p = 0; p < 8; ++p)
        pairs[p] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 32 + 16 * p));
    } else {
      __m256i q3[4];
      q3_scales(o, q3);
      for (int i = 0; i < 4; ++i) {
        pairs[2 * i] = _mm256_castsi256_si128(q3[i]);
        pairs[2 * i + 1] = _mm256_extracti128_si256(q3[i], 1);
      }
    }
    transpose_words(pairs, rows);
    for (int r = 0; r < 8; ++r) {
      const float d = half_to_float(load_u16(o + 2 * r));
      float* row_scales = scales + r * unit_stride + 16 * s;
      if constexpr (kType == kQ2_K) {
        const __m128i low = _mm_and_si128(rows[r], _mm_set1_epi8(15));
        store_unit_scales(_mm256_cvtepu8_epi32(low), _mm256_cvtepu8_epi32(_mm_srli_si128(low, 8)),
                          d, row_scales);
        const __m256i mins = _mm256_srli_epi16(_mm256_cvtepu8_epi16(rows[r]), 4);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(min_codes + r * unit_stride + 16 * s), mins);
        min_scales[r * unit_stride + s] = -half_to_float(load_u16(o + 16 + 2 * r));
      } else {
        store_unit_scales(_mm256_cvtepi8_epi32(rows[r]),
                          _mm256_cvtepi8_epi32(_mm_srli_si128(rows[r], 8)), d, row_scales);
      }
    }
  }
}

}  // namespace

void code_x8_linear_grouped(int64_t source_type, const float* x, const int64_t* starts,
                            int64_t groups, int64_t K, const uint8_t* const* weights, int64_t N,
                            float* y) {
  dispatch_code_x8(source_type, [&](auto type) {
    linear_grouped_typed<decltype(type)::value>(x, starts, groups, K, weights, N, y);
  });
}

void code_x8_unpack_group(int64_t source_type, const uint8_t* group, int64_t K, uint8_t* codes,
                          int64_t code_stride, float* scales, int16_t* min_codes,
                          float* min_scales, int64_t unit_stride) {
  dispatch_code_x8(source_type, [&](auto type) {
    unpack_group_typed<decltype(type)::value>(group, K, codes, code_stride, scales, min_codes,
                                              min_scales, unit_stride);
  });
}

}  // namespace hybridllm_gguf
#endif
