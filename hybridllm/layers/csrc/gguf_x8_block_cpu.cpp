// Q4_0, Q4_1, Q8_0 and IQ4_NL rows repacked in groups of 8 (gguf_x8.h's Q4_0X8 ... IQ4_NLX8): the
// layouts' repacking, and their int8 kernels for few rows of x. As in the K-quants' x8 kernels,
// one vpdpbusd (AVX2: vpmaddubsw) multiplies 4 codes of each of the 8 rows, so a block's scale
// is one vector multiply for 8 rows, and a tile of rows of x meets each block's codes once they
// are loaded: the row kernels (gguf_q8_dot.h) convert and scale every block once a row of x,
// which made a speculative verify step's 5 rows cost 2.6x one row on SmolLM2's Q8_0 LM head.
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

// a block's bytes, and a group block's (gguf_x8.h): the same 8 rows' bytes, rearranged
static_assert(kSourceBytes<kQ4_0> == 18 && kSourceBytes<kQ4_1> == 20 && kSourceBytes<kQ8_0> == 34 &&
              kSourceBytes<kIQ4_NL> == 18);
static_assert(kGroupBytes<kQ4_0> == 8 * 18 && kGroupBytes<kQ8_0> == 8 * 34);
// Where a group block's codes start: after the 8 rows' d (and Q4_1's m), fp16 each.
template <int64_t kType>
constexpr int64_t kGroupCodes = kType == kQ4_1 ? 32 : 16;
// Where a source block's codes start: after d (and Q4_1's m).
template <int64_t kType>
constexpr int64_t kSourceCodes = kType == kQ4_1 ? 4 : 2;

// Row r's code of weight w (0-31) in a group block: its byte and (4-bit codes) the nibble's
// shift. Chunk c = w / 16; within it, weight 8 half + 4 h + b sits in lane L = 8 h + r, byte
// 4 L + b, of the chunk's `half` code vector (gguf_x8.h's x_quads puts x's value there): Q8_0
// keeps each half's 64 bytes apart, the 4-bit types half 0 in the low nibbles and half 1 in the
// high nibbles of one 64-byte run.
struct CodePlace {
  int byte, shift;
};
template <int64_t kType>
constexpr CodePlace code_place(int r, int w) {
  const int c = w / 16, half = w % 16 / 8, h = w % 8 / 4, b = w % 4;
  const int lane_byte = static_cast<int>(kGroupCodes<kType>) + 4 * (8 * h + r) + b;
  if constexpr (kType == kQ8_0) return {lane_byte + 128 * c + 64 * half, 0};
  return {lane_byte + 64 * c, 4 * half};
}

// A source block's code of weight w: Q8_0's int8 as an unsigned byte (code + 128, what the
// group keeps), the 4-bit types' nibble (weights 0-15 low, 16-31 high).
template <int64_t kType>
inline int source_code(const uint8_t* block, int w) {
  if constexpr (kType == kQ8_0) return block[kSourceCodes<kType> + w] ^ 0x80;
  return (block[kSourceCodes<kType> + w % 16] >> (4 * (w / 16))) & 15;
}
template <int64_t kType>
inline void put_source_code(uint8_t* block, int w, int code) {
  if constexpr (kType == kQ8_0)
    block[kSourceCodes<kType> + w] = static_cast<uint8_t>(code ^ 0x80);
  else
    block[kSourceCodes<kType> + w % 16] |= static_cast<uint8_t>(code << (4 * (w / 16)));
}

// `nb` blocks of 8 source rows (rows nb blocks apart) into one group.
template <int64_t kType>
void repack_group(const uint8_t* rows, int64_t nb, uint8_t* group) {
  std::memset(group, 0, nb * kGroupBytes<kType>);  // nibbles are or-ed in
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* o = group + b * kGroupBytes<kType>;
    for (int r = 0; r < 8; ++r) {
      const uint8_t* s = rows + (r * nb + b) * kSourceBytes<kType>;
      std::memcpy(o + 2 * r, s, 2);                                     // d
      if constexpr (kType == kQ4_1) std::memcpy(o + 16 + 2 * r, s + 2, 2);  // m
      for (int w = 0; w < 32; ++w) {
        const CodePlace p = code_place<kType>(r, w);
        o[p.byte] |= static_cast<uint8_t>(source_code<kType>(s, w) << p.shift);
      }
    }
  }
}

// The inverse: one group into `nb` blocks of its 8 source rows.
template <int64_t kType>
void unpack_group(const uint8_t* group, int64_t nb, uint8_t* rows) {
  std::memset(rows, 0, 8 * nb * kSourceBytes<kType>);  // nibbles are or-ed in
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* o = group + b * kGroupBytes<kType>;
    for (int r = 0; r < 8; ++r) {
      uint8_t* s = rows + (r * nb + b) * kSourceBytes<kType>;
      std::memcpy(s, o + 2 * r, 2);
      if constexpr (kType == kQ4_1) std::memcpy(s + 2, o + 16 + 2 * r, 2);
      for (int w = 0; w < 32; ++w) {
        const CodePlace p = code_place<kType>(r, w);
        put_source_code<kType>(s, w, (o[p.byte] >> p.shift) & (kType == kQ8_0 ? 255 : 15));
      }
    }
  }
}

#if defined(HYBRIDLLM_Q8_AVX512) || defined(HYBRIDLLM_X8_AVX2)
// Rows of x as the kernels read them: quantize_rows<32>'s, plus each block's sum of q as an
// int32 (sums[r * nb + b]); Q8Rows' s (d times that sum, a float) is what Q4_1's mins take.
struct BlockRows {
  Q8Rows q8;
  const int32_t* sums;
  int64_t nb;
  BlockRows from(int64_t r) const { return {q8.row(r), sums + r * nb, nb}; }
};

BlockRows prepare_rows(const float* x, int64_t M, int64_t K) {
  thread_local std::vector<uint8_t> quantized;
  thread_local std::vector<int32_t> sums;
  const Q8Rows q8 = quantize_rows<32>(x, M, K, quantized);
  const int64_t nb = K / 32;
  sums.resize(M * nb);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const int8_t* q = q8.row(r).q + 32 * b;
      int32_t sum = 0;
      for (int i = 0; i < 32; ++i) sum += q[i];
      sums[r * nb + b] = sum;
    }
  return {q8, sums.data(), nb};
}

// A group block's d (and Q4_1's m) of rows 0-7 as the int8 GEMM takes them, row r's at
// scales[r * unit_stride] (mins[...]).
template <int64_t kType>
void block_scales_for_gemm(const uint8_t* o, float* scales, float* mins, int64_t unit_stride) {
  for (int r = 0; r < 8; ++r) {
    scales[r * unit_stride] = half_to_float(load_u16(o + 2 * r));
    if constexpr (kType == kQ4_1) mins[r * unit_stride] = half_to_float(load_u16(o + 16 + 2 * r));
  }
}
#endif

#if defined(HYBRIDLLM_Q8_AVX512)
// What a code stands for beside its scale: Q8_0's are code + 128, IQ4_NL's looked up as table
// value + 128, Q4_0's code + 8 (Q4_1's have a min instead). The offset times x's block sum
// starts each block's integer sums (lanes 0-7).
template <int64_t kType>
constexpr int kCodeOffset = kType == kQ8_0 || kType == kIQ4_NL ? 128 : kType == kQ4_0 ? 8 : 0;

// Chunk c's `half` code vector of the group block at o, as unsigned bytes (IQ4_NL: its table's
// values + 128).
template <int64_t kType>
inline __m512i block_codes(const uint8_t* o, int c, int half) {
  if constexpr (kType == kQ8_0)
    return _mm512_loadu_si512(o + kGroupCodes<kType> + 128 * c + 64 * half);
  const __m512i v = _mm512_loadu_si512(o + kGroupCodes<kType> + 64 * c);
  const __m512i nibbles =
      _mm512_and_si512(half ? _mm512_srli_epi16(v, 4) : v, _mm512_set1_epi8(15));
  if constexpr (kType == kIQ4_NL) return Avx512Vnni::table_codes(nibbles, kIq4NlValues);
  return nibbles;
}

// Up to this many rows of x meet a group's codes once loaded: a speculative verify step of 4
// drafts is 5 rows, one tile.
constexpr int kTileRows = 5;

// y[r * ldy + i] = dot(x row r, weight row i of the group at wg) for the kRows rows of x; `first`:
// the tile that reads the group from memory, which prefetches ahead.
template <int64_t kType, int kRows>
void block_group_tile(const BlockRows& x, const uint8_t* wg, float* y, int64_t ldy, bool first,
                      const PrefetchWindow& prefetch) {
  constexpr int64_t kBytes = kGroupBytes<kType>;
  __m512 acc[kRows];     // lanes i and 8 + i: weight row i's two halves
  __m256 minacc[kRows];  // Q4_1: row i's sum over blocks of m * (x's sum)
  for (int r = 0; r < kRows; ++r) {
    acc[r] = _mm512_setzero_ps();
    minacc[r] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < x.nb; ++b) {
    const uint8_t* o = wg + b * kBytes;
    if (first) prefetch_ahead(prefetch, o, 1, 0, kBytes);
    const __m512i v[4] = {block_codes<kType>(o, 0, 0), block_codes<kType>(o, 0, 1),
                          block_codes<kType>(o, 1, 0), block_codes<kType>(o, 1, 1)};
    const __m512 d = _mm512_cvtph_ps(
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o))));
    __m256 m;
    if constexpr (kType == kQ4_1)
      m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 16)));
    for (int r = 0; r < kRows; ++r) {
      const Q8Rows xr = x.q8.row(r);
      const int8_t* xs = xr.q + 32 * b;
      // |t| <= 32 * 255 * 127 + 128 * 32 * 127: int32
      __m512i t = kCodeOffset<kType> ? _mm512_maskz_set1_epi32(
                                           0xFF, -kCodeOffset<kType> * x.sums[r * x.nb + b])
                                     : _mm512_setzero_si512();
      t = _mm512_dpbusd_epi32(t, v[0], x_quads(xs, 0));
      t = _mm512_dpbusd_epi32(t, v[1], x_quads(xs, 1));
      t = _mm512_dpbusd_epi32(t, v[2], x_quads(xs + 16, 0));
      t = _mm512_dpbusd_epi32(t, v[3], x_quads(xs + 16, 1));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(d, _mm512_set1_ps(xr.d[b])),
                               acc[r]);
      if constexpr (kType == kQ4_1)
        minacc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xr.s[b]), minacc[r]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    const __m256 halves = _mm256_add_ps(
        _mm512_castps512_ps256(acc[r]),
        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1)));
    _mm256_storeu_ps(y + r * ldy, _mm256_add_ps(halves, minacc[r]));
  }
}

// y[r * ldy + 8 g + i] = dot(x row r, weight row 8 g + i) for the groups [g0, g1) of `w` (the
// weight's first group) and every row of x.
template <int64_t kType>
void block_groups(const BlockRows& x, int64_t M, const uint8_t* w, float* y, int64_t ldy,
                  int64_t g0, int64_t g1, const PrefetchWindow& prefetch) {
  const int64_t group_bytes = x.nb * kGroupBytes<kType>;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wg = w + g * group_bytes;
    for (int64_t r0 = 0; r0 < M; r0 += kTileRows) {
      const BlockRows xt = x.from(r0);
      float* yt = y + r0 * ldy + 8 * g;
      const bool first = r0 == 0;  // the weights come from memory once, for the first tile
      switch (std::min<int64_t>(kTileRows, M - r0)) {
        case 1: block_group_tile<kType, 1>(xt, wg, yt, ldy, first, prefetch); break;
        case 2: block_group_tile<kType, 2>(xt, wg, yt, ldy, first, prefetch); break;
        case 3: block_group_tile<kType, 3>(xt, wg, yt, ldy, first, prefetch); break;
        case 4: block_group_tile<kType, 4>(xt, wg, yt, ldy, first, prefetch); break;
        default: block_group_tile<kType, 5>(xt, wg, yt, ldy, first, prefetch); break;
      }
    }
  }
}

// The group's 8 rows for the int8 GEMM, as its unpack_row gives a source row: codes in weight
// order (Q8_0's and IQ4_NL's table values plus 128, Q4_0's and Q4_1's nibbles as they are), d
// (and Q4_1's m) a block.
template <int64_t kType>
void unpack_for_gemm(const uint8_t* group, int64_t K, uint8_t* codes, int64_t code_stride,
                     float* scales, float* mins, int64_t unit_stride) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const uint8_t* o = group + b * kGroupBytes<kType>;
    for (int c = 0; c < 2; ++c)
      store_chunk_rows(block_codes<kType>(o, c, 0), block_codes<kType>(o, c, 1),
                       codes + 32 * b + 16 * c, code_stride);
    block_scales_for_gemm<kType>(o, scales + b, mins + b, unit_stride);
  }
}

template <int64_t kType>
void grouped_typed(const float* x, const int64_t* starts, int64_t groups, int64_t K,
                   const uint8_t* const* weights, int64_t N, float* y) {
  const BlockRows xr = prepare_rows(x, starts[groups], K);
  for_x8_row_groups(starts, groups, K, weights, N, K / 32 * kGroupBytes<kType>,
                    [&](int64_t p, int64_t g0, int64_t g1, const PrefetchWindow& window) {
                      const int64_t r0 = starts[p];
                      block_groups<kType>(xr.from(r0), starts[p + 1] - r0, weights[p],
                                          y + r0 * N, N, g0, g1, window);
                    });
}
#elif defined(HYBRIDLLM_X8_AVX2)
// Chunk c's four code vectors (vector k, lane r: row r's codes of the chunk's weights 4 k ..
// 4 k + 3): Q4_0's and Q4_1's nibbles, IQ4_NL's table values and Q8_0's codes signed.
template <int64_t kType>
inline void block_chunk_codes(const uint8_t* o, int c, __m256i v[4]) {
  const auto load = [&](int64_t at) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + kGroupCodes<kType> + at));
  };
  if constexpr (kType == kQ8_0) {  // halves 0, 1 of 64 bytes; stored as code + 128
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int k = 0; k < 4; ++k) v[k] = _mm256_xor_si256(load(128 * c + 32 * k), flip);
  } else {  // one 64-byte run: half 0 in the low nibbles, half 1 in the high ones
    const __m256i a = load(64 * c), b = load(64 * c + 32), m4 = _mm256_set1_epi8(15);
    v[0] = _mm256_and_si256(a, m4);
    v[1] = _mm256_and_si256(b, m4);
    v[2] = _mm256_and_si256(_mm256_srli_epi16(a, 4), m4);
    v[3] = _mm256_and_si256(_mm256_srli_epi16(b, 4), m4);
    if constexpr (kType == kIQ4_NL) {
      const __m256i values = _mm256_broadcastsi128_si256(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4NlValues)));
      for (int k = 0; k < 4; ++k) v[k] = _mm256_shuffle_epi8(values, v[k]);
    }
  }
}

// y[r * ldy + i] = dot(x row r, weight row i of the group at wg) for the kRows rows of x, as the
// AVX-512 tile does it with 8 rows in the 32-bit lanes of 256-bit vectors: the 4-bit codes'
// products of a block (<= 8 * 2 * 15 * 127) add up in int16, the signed ones' (|code| times x
// with the code's sign) meet vpmaddwd one vector at a time.
template <int64_t kType, int kRows>
void avx2_block_tile(const BlockRows& x, const uint8_t* wg, float* y, int64_t ldy, bool first,
                     const PrefetchWindow& prefetch) {
  constexpr int64_t kBytes = kGroupBytes<kType>;
  constexpr bool kSigned = kType == kQ8_0 || kType == kIQ4_NL;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.nb; ++b) {
    const uint8_t* o = wg + b * kBytes;
    if (first) prefetch_ahead(prefetch, o, 1, 0, kBytes);
    __m256i sums[kRows];
    for (int r = 0; r < kRows; ++r)
      sums[r] = kType == kQ4_0 ? _mm256_set1_epi32(-8 * x.sums[r * x.nb + b])
                               : _mm256_setzero_si256();
    __m256i t16[kRows];
    for (int c = 0; c < 2; ++c) {
      __m256i v[4], products[4];
      block_chunk_codes<kType>(o, c, v);
      if constexpr (kSigned) {
        __m256i magnitudes[4];
        for (int k = 0; k < 4; ++k) magnitudes[k] = _mm256_abs_epi8(v[k]);
        for (int r = 0; r < kRows; ++r) {
          const int8_t* xs = x.q8.row(r).q + 32 * b + 16 * c;
          for (int k = 0; k < 4; ++k) {
            const __m256i p = _mm256_maddubs_epi16(
                magnitudes[k], _mm256_sign_epi8(avx2_x_quad(xs + 4 * k), v[k]));
            sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(p, ones));
          }
        }
      } else {
        for (int r = 0; r < kRows; ++r) {
          avx2_chunk_products(v, x.q8.row(r).q + 32 * b + 16 * c, products);
          const __m256i t = _mm256_add_epi16(_mm256_add_epi16(products[0], products[1]),
                                             _mm256_add_epi16(products[2], products[3]));
          t16[r] = c == 0 ? t : _mm256_add_epi16(t16[r], t);
        }
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o)));
    for (int r = 0; r < kRows; ++r) {
      const Q8Rows xr = x.q8.row(r);
      if constexpr (!kSigned) sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(t16[r], ones));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]),
                               _mm256_mul_ps(d, _mm256_set1_ps(xr.d[b])), acc[r]);
      if constexpr (kType == kQ4_1)  // m times x's sum (d times its integer sum)
        acc[r] = _mm256_fmadd_ps(
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 16))),
            _mm256_set1_ps(xr.s[b]), acc[r]);
    }
  }
  for (int r = 0; r < kRows; ++r) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

// The group's 8 rows for the AVX2 int8 GEMM, as its unpack_row gives a source row: codes in
// weight order (Q4_0's and Q4_1's nibbles, IQ4_NL's table values and Q8_0's codes signed), d
// (and Q4_1's m) a block.
template <int64_t kType>
void unpack_for_gemm(const uint8_t* group, int64_t K, uint8_t* codes, int64_t code_stride,
                     float* scales, float* mins, int64_t unit_stride) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const uint8_t* o = group + b * kGroupBytes<kType>;
    for (int c = 0; c < 2; ++c) {
      __m256i v[4];
      block_chunk_codes<kType>(o, c, v);
      avx2_store_chunk_rows(v, codes + 32 * b + 16 * c, code_stride);
    }
    block_scales_for_gemm<kType>(o, scales + b, mins + b, unit_stride);
  }
}

template <int64_t kType>
void grouped_typed(const float* x, const int64_t* starts, int64_t groups, int64_t K,
                   const uint8_t* const* weights, int64_t N, float* y) {
  const BlockRows xr = prepare_rows(x, starts[groups], K);
  const int64_t group_bytes = K / 32 * kGroupBytes<kType>;
  for_x8_row_groups(starts, groups, K, weights, N, group_bytes,
                    [&](int64_t p, int64_t g0, int64_t g1, const PrefetchWindow& window) {
                      const int64_t r0 = starts[p];
                      avx2_x8_tiles(starts[p + 1] - r0, g0, g1,
                                    [&](int64_t g, int64_t t, auto rows, bool first) {
                                      avx2_block_tile<kType, decltype(rows)::value>(
                                          xr.from(r0 + t), weights[p] + g * group_bytes,
                                          y + (r0 + t) * N + 8 * g, N, first, window);
                                    });
                    });
}
#endif

template <class Body>
void dispatch_block(int64_t source_type, Body body) {
  if (source_type == kQ4_0)
    body(std::integral_constant<int64_t, kQ4_0>{});
  else if (source_type == kQ4_1)
    body(std::integral_constant<int64_t, kQ4_1>{});
  else if (source_type == kIQ4_NL)
    body(std::integral_constant<int64_t, kIQ4_NL>{});
  else
    body(std::integral_constant<int64_t, kQ8_0>{});
}

}  // namespace

void block_x8_convert(int64_t source_type, const uint8_t* src, int64_t nb, uint8_t* dst,
                      bool repack) {
  dispatch_block(source_type, [&](auto type) {
    constexpr int64_t kType = decltype(type)::value;
    if (repack)
      repack_group<kType>(src, nb, dst);
    else
      unpack_group<kType>(src, nb, dst);
  });
}

#if defined(HYBRIDLLM_Q8_AVX512) || defined(HYBRIDLLM_X8_AVX2)
void block_x8_linear_grouped(int64_t source_type, const float* x, const int64_t* starts,
                             int64_t groups, int64_t K, const uint8_t* const* weights, int64_t N,
                             float* y) {
  dispatch_block(source_type, [&](auto type) {
    grouped_typed<decltype(type)::value>(x, starts, groups, K, weights, N, y);
  });
}

void block_x8_unpack_group(int64_t source_type, const uint8_t* group, int64_t K, uint8_t* codes,
                           int64_t code_stride, float* scales, float* mins, int64_t unit_stride) {
  dispatch_block(source_type, [&](auto type) {
    unpack_for_gemm<decltype(type)::value>(group, K, codes, code_stride, scales, mins,
                                           unit_stride);
  });
}
#endif

}  // namespace hybridllm_gguf
