// Q2_K and Q3_K rows repacked in groups of 8 (gguf_x8.h's Q2_KX8 and Q3_KX8): the layouts'
// repacking, their int8 kernels for few rows of x, and their unpacking for the int8 GEMM.
// As in the K-quants' x8 kernels (gguf_x8_cpu.cpp), one vpdpbusd multiplies 4 codes of each of the
// 8 rows; here two 16-weight units' int32 sums fit int16 and meet the units' scales in one
// vpdpwssd, and Q2_K's mins are a vpdpwssd of 8 rows' min pairs with x's unit sums. Against
// the code-block kernels (a row at a time, gguf_q8_dot.h), a super-block of 8 rows takes about
// half the instructions.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_blocks.h"
#include "gguf_prefetch.h"
#include "gguf_q8_quantize.h"
#include "gguf_q8_simd.h"
#include "gguf_x8.h"

namespace hybridllm_gguf {
namespace {

static_assert(kSourceBytes<kQ2_K> == 84 && kSourceBytes<kQ3_K> == 110);
static_assert(kGroupBytes<kQ2_K> == 8 * 84 && kGroupBytes<kQ3_K> == 8 * 110);

// Code byte i (0-63) of chunk pair p, bits 2 f, 2 f + 1 (f 0-3): row `row`'s code of `weight`.
// Lane L = i / 4 is row L % 8; field f is chunk 2 p + f / 2, its weights 8 (f % 2) + 4 (L / 8) +
// i % 4: the values gguf_x8.h's x_quads puts in lane L for that chunk's half f % 2.
struct CodePlace {
  int row, weight;
};
inline CodePlace code_place(int p, int i, int f) {
  const int lane = i / 4;
  return {lane % 8, 16 * (2 * p + f / 2) + 8 * (f % 2) + 4 * (lane / 8) + i % 4};
}

// The source layouts' fields (gguf_code_decoders.h): 2-bit q of weight w, Q3_K's 6-bit scale k.
inline int two_bit(const uint8_t* qs, int w) {
  return (qs[32 * (w / 128) + w % 32] >> (2 * (w / 32 % 4))) & 3;
}
inline void or_two_bit(uint8_t* qs, int w, int v) {
  qs[32 * (w / 128) + w % 32] |= static_cast<uint8_t>(v << (2 * (w / 32 % 4)));
}
inline int q3_scale(const uint8_t* s, int k) {
  return ((s[k % 8] >> (4 * (k / 8))) & 15) | ((s[8 + k % 4] >> (2 * (k / 4))) & 3) << 4;
}
inline void or_q3_scale(uint8_t* s, int k, int v) {
  s[k % 8] |= static_cast<uint8_t>((v & 15) << (4 * (k / 8)));
  s[8 + k % 4] |= static_cast<uint8_t>((v >> 4) << (2 * (k / 4)));
}

// Q3_K x8's 6-bit scale j (0-127, code_unit_index): low 4 bits in byte 16 + j % 64 (nibble
// j / 64), top 2 at bits 2 (j / 32) of byte 80 + j % 32.
inline int x8_q3_scale(const uint8_t* o, int j) {
  return ((o[16 + j % 64] >> (4 * (j / 64))) & 15) | ((o[80 + j % 32] >> (2 * (j / 32))) & 3) << 4;
}

template <int64_t kType>
void repack_group(const uint8_t* rows, int64_t nsb, uint8_t* out) {
  constexpr int64_t kSource = kSourceBytes<kType>, kGroup = kGroupBytes<kType>;
  constexpr int64_t kQs = kType == kQ2_K ? 16 : 32;
  std::memset(out, 0, nsb * kGroup);  // every field is or-ed in
  for (int64_t s = 0; s < nsb; ++s) {
    uint8_t* o = out + s * kGroup;
    const auto source = [&](int r) { return rows + (r * nsb + s) * kSource; };
    for (int r = 0; r < 8; ++r) {
      const uint8_t* q = source(r);
      if constexpr (kType == kQ2_K) {
        std::memcpy(o + 2 * r, q + 80, 2);       // d
        std::memcpy(o + 16 + 2 * r, q + 82, 2);  // dmin
        for (int u = 0; u < 16; ++u) o[32 + code_unit_index(u, r)] = q[u];
      } else {
        std::memcpy(o + 2 * r, q + 108, 2);
        for (int u = 0; u < 16; ++u) {
          const int j = code_unit_index(u, r), v = q3_scale(q + 96, u);
          o[16 + j % 64] |= static_cast<uint8_t>((v & 15) << (4 * (j / 64)));
          o[80 + j % 32] |= static_cast<uint8_t>((v >> 4) << (2 * (j / 32)));
        }
      }
    }
    for (int p = 0; p < 8; ++p)
      for (int i = 0; i < 64; ++i)
        for (int f = 0; f < 4; ++f) {
          const CodePlace c = code_place(p, i, f);
          const uint8_t* q = source(c.row);
          uint8_t* pair = o + code_pair_offset<kType>(p);
          pair[i] |= static_cast<uint8_t>(two_bit(q + kQs, c.weight) << 2 * f);
          if constexpr (kType == kQ3_K)
            if ((q[c.weight % 32] >> (c.weight / 32)) & 1) {
              const HighBitPlace h = q3_high_place(i, f);
              pair[h.byte] |= static_cast<uint8_t>(1 << h.bit);
            }
        }
  }
}

template <int64_t kType>
void unpack_group(const uint8_t* group, int64_t nsb, uint8_t* rows) {
  constexpr int64_t kSource = kSourceBytes<kType>, kGroup = kGroupBytes<kType>;
  constexpr int64_t kQs = kType == kQ2_K ? 16 : 32;
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* o = group + s * kGroup;
    const auto source = [&](int r) { return rows + (r * nsb + s) * kSource; };
    for (int r = 0; r < 8; ++r) {
      uint8_t* q = source(r);
      std::memset(q, 0, kSource);  // every field is or-ed in
      if constexpr (kType == kQ2_K) {
        std::memcpy(q + 80, o + 2 * r, 2);
        std::memcpy(q + 82, o + 16 + 2 * r, 2);
        for (int u = 0; u < 16; ++u) q[u] = o[32 + code_unit_index(u, r)];
      } else {
        std::memcpy(q + 108, o + 2 * r, 2);
        for (int u = 0; u < 16; ++u)
          or_q3_scale(q + 96, u, x8_q3_scale(o, code_unit_index(u, r)));
      }
    }
    for (int p = 0; p < 8; ++p)
      for (int i = 0; i < 64; ++i)
        for (int f = 0; f < 4; ++f) {
          const CodePlace c = code_place(p, i, f);
          uint8_t* q = source(c.row);
          or_two_bit(q + kQs, c.weight, (o[code_pair_offset<kType>(p) + i] >> 2 * f) & 3);
          if constexpr (kType == kQ3_K) {
            const HighBitPlace h = q3_high_place(i, f);
            if ((o[code_pair_offset<kType>(p) + h.byte] >> h.bit) & 1)
              q[c.weight % 32] |= static_cast<uint8_t>(1 << (c.weight / 32));
          }
        }
  }
}

#if defined(HYBRIDLLM_Q8_AVX512)
// Chunk pair p's codes as unsigned bytes in the kernel's lanes, field f in v[f] (chunk 2 p + f / 2,
// half f % 2): Q2_K's q, Q3_K's q + 4 where its high bit is set (its code + 4).
template <int64_t kType>
inline void pair_codes(const uint8_t* o, int p, __m512i v[4]) {
  const uint8_t* c = o + code_pair_offset<kType>(p);
  const __m512i bytes = _mm512_loadu_si512(c), three = _mm512_set1_epi8(3);
  v[0] = _mm512_and_si512(bytes, three);
  v[1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 2), three);
  v[2] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), three);
  v[3] = _mm512_and_si512(_mm512_srli_epi16(bytes, 6), three);
  if constexpr (kType == kQ3_K)
    for (int f = 0; f < 4; ++f) {
      uint64_t high;
      std::memcpy(&high, c + 64 + 8 * f, 8);
      v[f] = _mm512_mask_add_epi8(v[f], _cvtu64_mask64(high), v[f], _mm512_set1_epi8(4));
    }
}

// Q3_K's 128 scales of a group super-block, minus 32, as int8 at code_unit_index: j < 64 in lo, the
// rest in hi.
inline void q3_scales(const uint8_t* o, __m512i* lo, __m512i* hi) {
  const __m512i low = _mm512_loadu_si512(o + 16), nibble = _mm512_set1_epi8(15);
  const __m512i top =
      _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + 80)));
  const auto top_bits = [&](int f) {  // fields f (scales 0-31 of the half), f + 1 (32-63)
    const __m512i shifts = _mm512_inserti64x4(_mm512_set1_epi16(static_cast<short>(2 * f)),
                                              _mm256_set1_epi16(static_cast<short>(2 * f + 2)), 1);
    // at most 3 a byte: shifted by 4 it stays in its byte
    return _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(top, shifts), _mm512_set1_epi8(3)),
                             4);
  };
  const __m512i bias = _mm512_set1_epi8(32);
  *lo = _mm512_sub_epi8(_mm512_or_si512(_mm512_and_si512(low, nibble), top_bits(0)), bias);
  *hi = _mm512_sub_epi8(
      _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(low, 4), nibble), top_bits(2)), bias);
}

// Q2_K: unit pair p's scale bytes (scale in the low nibble, min in the high) as int16 pairs of
// rows 0-7, twice.
inline __m512i pair_scale_bytes(const uint8_t* o, int p) {
  return _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 32 + 16 * p))));
}

// Unit pair p's integer scales as int16 pairs (unit 2 p's, 2 p + 1's) of rows 0-7, twice (words
// 2 r and 2 r + 1 of each 256-bit half); Q3_K's from q3_scales' lo and hi.
template <int64_t kType>
inline __m512i pair_scales(const uint8_t* o, int p, __m512i scale_lo, __m512i scale_hi) {
  if constexpr (kType == kQ2_K) {
    (void)scale_lo, (void)scale_hi;
    return _mm512_and_si512(pair_scale_bytes(o, p), _mm512_set1_epi16(15));
  } else {
    (void)o;
    // the 16 bytes of unit pair p (128-bit lane p % 4 of its half), twice
    const __m512i lane = _mm512_permutexvar_epi32(
        _mm512_add_epi32(_mm512_set1_epi32(4 * (p % 4)),
                         _mm512_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3)),
        p < 4 ? scale_lo : scale_hi);
    return _mm512_cvtepi8_epi16(_mm512_castsi512_si256(lane));
  }
}

// Q2_K's 4-bit mins of unit pair p, laid out as pair_scales lays out the scales.
inline __m512i pair_mins(const uint8_t* o, int p) {
  return _mm512_srli_epi16(pair_scale_bytes(o, p), 4);
}

// Rows of x a tile: each group super-block's codes are unpacked once for all of them. On the 1B
// Q2_K file's gate (8192 x 2048), 4 rows took 2.8 times one row's time a row at a time.
constexpr int kTileRows = 4;

// y[r * ldy + i] = dot(x row r, weight row i of the group at wg) for the kRows rows of x; `first`:
// the tile that reads the group from memory, which prefetches ahead.
template <int64_t kType, int kRows>
void code_group_tile(const Q8Rows& x, int64_t K, const uint8_t* wg, float* y, int64_t ldy,
                     bool first, const PrefetchWindow& prefetch) {
  constexpr int64_t kBytes = kGroupBytes<kType>;
  __m512 acc[kRows];     // lanes i and 8 + i: row i's two halves
  __m256 minacc[kRows];  // Q2_K: row i's dmin * sum_u m_u B_u, in x's units
  for (int r = 0; r < kRows; ++r) {
    acc[r] = _mm512_setzero_ps();
    minacc[r] = _mm256_setzero_ps();
  }
  for (int64_t s = 0; s < K / 256; ++s) {
    const uint8_t* o = wg + s * kBytes;
    if (first) prefetch_ahead(prefetch, o, 1, 0, kBytes);
    __m512i scale_lo = _mm512_setzero_si512(), scale_hi = scale_lo;
    if constexpr (kType == kQ3_K) q3_scales(o, &scale_lo, &scale_hi);
    __m512i sums[kRows], min_sums[kRows];
    for (int r = 0; r < kRows; ++r) sums[r] = min_sums[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p) {  // units (chunks) 2 p, 2 p + 1
      __m512i v[4];
      pair_codes<kType>(o, p, v);
      const __m512i scales = pair_scales<kType>(o, p, scale_lo, scale_hi);
      __m512i mins = _mm512_setzero_si512();
      if constexpr (kType == kQ2_K) mins = pair_mins(o, p);
      for (int r = 0; r < kRows; ++r) {
        const Q8Rows xr = x.row(r);
        const int16_t* bsums = xr.bsums + 16 * s;  // x's sum over each 16-value unit
        // Q3_K's codes are code + 4: each unit starts at -4 times x's sum over it (lanes 0-7)
        __m512i t0 = _mm512_setzero_si512(), t1 = t0;
        if constexpr (kType == kQ3_K) {
          t0 = _mm512_maskz_set1_epi32(0xFF, -4 * bsums[2 * p]);
          t1 = _mm512_maskz_set1_epi32(0xFF, -4 * bsums[2 * p + 1]);
        }
        const int8_t* x0 = xr.q + 256 * s + 32 * p;
        const int8_t* x1 = x0 + 16;
        t0 = _mm512_dpbusd_epi32(t0, v[0], x_quads(x0, 0));
        t0 = _mm512_dpbusd_epi32(t0, v[1], x_quads(x0, 1));
        t1 = _mm512_dpbusd_epi32(t1, v[2], x_quads(x1, 0));
        t1 = _mm512_dpbusd_epi32(t1, v[3], x_quads(x1, 1));
        // |t| <= 8 * 7 * 127 + 4 * 16 * 127 < 2^15: the two units as one int16 pair a lane
        const __m512i pair = _mm512_mask_blend_epi16(0xAAAAAAAAu, t0, _mm512_slli_epi32(t1, 16));
        // |sums| <= 8 * 2 * 2^15 * 32: int32
        sums[r] = _mm512_dpwssd_epi32(sums[r], pair, scales);
        if constexpr (kType == kQ2_K) {
          int32_t x_pair;  // bsums 2 p, 2 p + 1 as one int16 pair
          std::memcpy(&x_pair, bsums + 2 * p, 4);
          min_sums[r] = _mm512_dpwssd_epi32(min_sums[r], mins, _mm512_set1_epi32(x_pair));
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o))));
    __m256 dmin;
    if constexpr (kType == kQ2_K)
      dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 16)));
    for (int r = 0; r < kRows; ++r) {
      const __m512 xd = _mm512_set1_ps(x.row(r).d[s]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), _mm512_mul_ps(d, xd), acc[r]);
      if constexpr (kType == kQ2_K)
        minacc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm512_castsi512_si256(min_sums[r])),
                                    _mm256_mul_ps(dmin, _mm512_castps512_ps256(xd)), minacc[r]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    const __m256 halves = _mm256_add_ps(
        _mm512_castps512_ps256(acc[r]),
        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1)));
    _mm256_storeu_ps(y + r * ldy, _mm256_sub_ps(halves, minacc[r]));
  }
}

// y[r * ldy + 8 g + i] = dot(x row r, weight row 8 g + i) for the groups [g0, g1) of `w` (the
// weight's first group) and every row of x (quantized in groups of 256, with bsums).
template <int64_t kType>
void code_groups(const Q8Rows& x, int64_t M, int64_t K, const uint8_t* w, float* y, int64_t ldy,
                 int64_t g0, int64_t g1, const PrefetchWindow& prefetch) {
  const int64_t group_bytes = K / 256 * kGroupBytes<kType>;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wg = w + g * group_bytes;
    for (int64_t r0 = 0; r0 < M; r0 += kTileRows) {
      const Q8Rows xt = x.row(r0);
      float* yt = y + r0 * ldy + 8 * g;
      const bool first = r0 == 0;  // the weights come from memory once, for the first tile
      switch (std::min<int64_t>(kTileRows, M - r0)) {
        case 1: code_group_tile<kType, 1>(xt, K, wg, yt, ldy, first, prefetch); break;
        case 2: code_group_tile<kType, 2>(xt, K, wg, yt, ldy, first, prefetch); break;
        case 3: code_group_tile<kType, 3>(xt, K, wg, yt, ldy, first, prefetch); break;
        default: code_group_tile<kType, 4>(xt, K, wg, yt, ldy, first, prefetch); break;
      }
    }
  }
}

template <int64_t kType>
void grouped_typed(const float* x, const int64_t* starts, int64_t groups, int64_t K,
                   const uint8_t* const* weights, int64_t N, float* y) {
  thread_local std::vector<uint8_t> quantized;
  const Q8Rows xq = quantize_rows<256>(x, starts[groups], K, quantized);
  for_x8_row_groups(starts, groups, K, weights, N, K / 256 * kGroupBytes<kType>,
                    [&](int64_t p, int64_t g0, int64_t g1, const PrefetchWindow& window) {
                      const int64_t r0 = starts[p];
                      code_groups<kType>(xq.row(r0), starts[p + 1] - r0, K, weights[p],
                                         y + r0 * N, N, g0, g1, window);
                    });
}

// Word k of rows 0-3's unit scales in row order (row k / 8, unit pair k % 8) is the group's word
// kRowWords.v[k]; rows 4-7's are 4 words on.
struct RowWords {
  alignas(64) uint16_t v[32];
};
constexpr RowWords row_words() {
  RowWords w{};
  for (int k = 0; k < 32; ++k) w.v[k] = static_cast<uint16_t>(8 * (k % 8) + k / 8);
  return w;
}
constexpr RowWords kRowWords = row_words();

// Word w of a 32-bit lane's unit scale, for unit j (0: 2 p, 1: 2 p + 1) of a pair: pair_scales'
// word 2 (lane % 8) + j.
struct UnitWords {
  alignas(64) int16_t v[2][32];
};
constexpr UnitWords unit_words() {
  UnitWords u{};
  for (int w = 0; w < 32; ++w)
    for (int j = 0; j < 2; ++j) u.v[j][w] = static_cast<int16_t>(2 * ((w / 2) % 8) + j);
  return u;
}
constexpr UnitWords kUnitWords = unit_words();

// The group's 8 rows as the int8 GEMM unpacks a Q2_K / Q3_K row (gguf_q8_gemm_cpu.cpp): the
// scaled codes (scaled_field), d or -d a super-block, Q2_K's 4-bit mins as they are and -dmin a
// super-block. The codes are scaled in the kernel's lanes, 8 rows at a time: row by row after
// they were stored, the unpacking took as long as a 16-row tile's products.
template <int64_t kType>
void unpack_for_gemm(const uint8_t* group, int64_t K, uint8_t* codes, int64_t code_stride,
                     float* scales, int16_t* min_codes, float* min_scales, int64_t unit_stride) {
  const __m512i first_unit = _mm512_load_si512(kUnitWords.v[0]);
  const __m512i second_unit = _mm512_load_si512(kUnitWords.v[1]);
  for (int64_t s = 0; s < K / 256; ++s) {
    const uint8_t* o = group + s * kGroupBytes<kType>;
    __m512i scale_lo = _mm512_setzero_si512(), scale_hi = scale_lo;
    if constexpr (kType == kQ3_K) q3_scales(o, &scale_lo, &scale_hi);
    for (int p = 0; p < 8; ++p) {
      __m512i v[4];
      pair_codes<kType>(o, p, v);
      const __m512i pair = pair_scales<kType>(o, p, scale_lo, scale_hi);
      const __m512i unit_scale[2] = {_mm512_permutexvar_epi16(first_unit, pair),
                                     _mm512_permutexvar_epi16(second_unit, pair)};
      for (int f = 0; f < 4; ++f) v[f] = scaled_field<kType>(v[f], unit_scale[f / 2]);
      for (int half = 0; half < 2; ++half)  // chunk 2 p + half: fields 2 half, 2 half + 1
        store_chunk_rows(v[2 * half], v[2 * half + 1], codes + s * 256 + 16 * (2 * p + half),
                         code_stride);
    }
    if constexpr (kType == kQ2_K) {
      // the 128 scale bytes as 16 a row (unit order), rows 0-3 then 4-7: byte pair (units 2 p,
      // 2 p + 1) of row r is the group's word 8 p + r; their high nibbles are the mins
      const __m512i lo = _mm512_loadu_si512(o + 32), hi = _mm512_loadu_si512(o + 96);
      alignas(64) uint8_t by_row[128];
      const __m512i words = _mm512_load_si512(kRowWords.v);
      _mm512_store_si512(by_row, _mm512_permutex2var_epi16(lo, words, hi));
      _mm512_store_si512(by_row + 64, _mm512_permutex2var_epi16(
                                          lo, _mm512_add_epi16(words, _mm512_set1_epi16(4)), hi));
      for (int r = 0; r < 8; ++r) {
        const __m128i bytes = _mm_load_si128(reinterpret_cast<const __m128i*>(by_row + 16 * r));
        const __m512i high = _mm512_srli_epi32(_mm512_cvtepu8_epi32(bytes), 4);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(min_codes + r * unit_stride + 16 * s),
                            _mm512_cvtepi32_epi16(high));
        min_scales[r * unit_stride + s] = -half_to_float(load_u16(o + 16 + 2 * r));
      }
    }
    for (int r = 0; r < 8; ++r) {
      const float d = half_to_float(load_u16(o + 2 * r));
      scales[r * unit_stride + s] = kType == kQ3_K ? -d : d;
    }
  }
}
#endif

}  // namespace

void code_x8_convert(int64_t source_type, const uint8_t* src, int64_t nsb, uint8_t* dst,
                     bool repack) {
  dispatch_code_x8(source_type, [&](auto type) {
    constexpr int64_t kType = decltype(type)::value;
    if (repack)
      repack_group<kType>(src, nsb, dst);
    else
      unpack_group<kType>(src, nsb, dst);
  });
}

#if defined(HYBRIDLLM_Q8_AVX512)
void code_x8_linear_grouped(int64_t source_type, const float* x, const int64_t* starts,
                            int64_t groups, int64_t K, const uint8_t* const* weights, int64_t N,
                            float* y) {
  dispatch_code_x8(source_type, [&](auto type) {
    grouped_typed<decltype(type)::value>(x, starts, groups, K, weights, N, y);
  });
}

void code_x8_unpack_group(int64_t source_type, const uint8_t* group, int64_t K, uint8_t* codes,
                          int64_t code_stride, float* scales, int16_t* min_codes,
                          float* min_scales, int64_t unit_stride) {
  dispatch_code_x8(source_type, [&](auto type) {
    unpack_for_gemm<decltype(type)::value>(group, K, codes, code_stride, scales, min_codes,
                                           min_scales, unit_stride);
  });
}
#endif

}  // namespace hybridllm_gguf
