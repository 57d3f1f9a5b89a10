// Integer dot products of GGUF weight rows with int8-quantized rows of x (gguf_q8_quantize.h),
// for few rows of x: each weight block's codes are unpacked once as unsigned bytes and meet
// every row of x in vpdpbusd / vpmaddubsw (gguf_q8_simd.h); the block and sub-block scales are
// applied to int32 sums. A portable scalar version of the same arithmetic serves every CPU.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "gguf_blocks.h"
#include "gguf_prefetch.h"
#include "gguf_q8_quantize.h"
#include "gguf_q8_simd.h"

namespace hybridllm_gguf {

// Rows of x in a group of values a scale: the K-quants' 256, so that their sub-block scales
// combine int32 sums; 32 (one weight block) for the rest.
constexpr int64_t q8_group(int64_t type) { return row_granule(type); }

// A K-quant super-block's eight 6-bit sub-block scales and mins (see block_scales), as bytes.
struct KScales {
  uint64_t scales, mins;
};
inline KScales k_scales_of(const uint8_t* super) {
  constexpr uint32_t kLow6 = 0x3f3f3f3f, kLow4 = 0x0f0f0f0f, kLow2 = 0x03030303;
  uint32_t w[3];
  std::memcpy(w, super + 4, sizeof(w));
  const uint64_t s0 = w[0] & kLow6, s1 = (w[2] & kLow4) | (((w[0] >> 6) & kLow2) << 4);
  const uint64_t m0 = w[1] & kLow6, m1 = ((w[2] >> 4) & kLow4) | (((w[1] >> 6) & kLow2) << 4);
  return {s0 | s1 << 32, m0 | m1 << 32};
}

#if defined(HYBRIDLLM_Q8_AVX2)
// k_scales_of in one register: scales in bytes 0-7, mins in bytes 8-15. The bytes holding each
// one's low bits (a) and top 2 bits (b, for j >= 4) are shuffled into place, then masked.
inline __m128i k_scales_vector(const uint8_t* super) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(super + 4));  // 12 + 4 bytes
  const __m128i a =
      _mm_shuffle_epi8(q, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i b =
      _mm_shuffle_epi8(q, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  // the mins of j >= 4 are the high nibbles of their bytes; 16-bit shifts, neighbours masked off
  const __m128i low =
      _mm_and_si128(_mm_blend_epi32(a, _mm_srli_epi16(a, 4), 0b1000),
                    _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15));
  return _mm_or_si128(low,
                      _mm_and_si128(_mm_srli_epi16(b, 2), _mm_set1_epi8(0x30)));  // b >> 6 << 4
}
// sum_j mins_j * (bsums[2j] + bsums[2j + 1]) as 8 int32 (Q4_K/Q5_K: sub-block j's min times the
// sum of its 32 values of x); the mins in bytes 8-15 of k_scales_vector's result
inline __m256i k_min_sums(__m128i scales_mins, const int16_t* bsums) {
  return _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_unpackhi_epi8(scales_mins, scales_mins)),
                           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bsums)));
}
// Q6_K: sum_k scale_k * bsums[k] over its 16 scales, as 8 int32
inline __m256i q6_offset_sums(const uint8_t* scales, const int16_t* bsums) {
  return _mm256_madd_epi16(
      _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bsums)));
}

// acc + sums * scale + offsets * offset_scale (8 int32 lanes each): a super-block's part summed
// apart, then one add on the accumulator's dependency chain.
inline __m256 add_super_block(__m256 acc, __m256i sums, float scale, __m256i offsets,
                              float offset_scale) {
  const __m256 part = _mm256_mul_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(scale));
  return _mm256_add_ps(
      acc, _mm256_fmadd_ps(_mm256_cvtepi32_ps(offsets), _mm256_set1_ps(offset_scale), part));
}

// y[r * ldy + c] = dot(x row r, weight row c) for kRows rows of x and kCols consecutive weight
// rows (w: the first, row_bytes apart) of a K-quant type.
template <class S, int64_t kType, int kRows, int kCols>
void q8_dot_super_blocks(const Q8Rows& x, const uint8_t* w, int64_t row_bytes, int64_t K, float* y,
                         int64_t ldy, const PrefetchWindow& prefetch) {
  using V = typename S::V;
  using F = typename S::F;
  constexpr int64_t kSuper = kType == kQ4_K   ? kSuperBytes
                             : kType == kQ5_K ? kQ5SuperBytes
                                              : kQ6SuperBytes;
  constexpr int64_t kNibbles = kType == kQ4_K ? 16 : 48;  // Q4_K/Q5_K: where the nibbles start
  // One scale a super-block (its sub-block scales are in the integer sums): the sums' two
  // halves are added before converting, and the float side works on 8 lanes.
  __m256 acc[kRows][kCols];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kCols; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < K / 256; ++sb) {
    prefetch_ahead(prefetch, w, kCols, sb * kSuper, kSuper);
    // One weight row's super-block after the other: advancing the rows side by side in 32-byte
    // steps instead streamed 11 GB/s from DRAM against 23-26 (2 threads, Q4_K 2048 -> 16384).
#pragma GCC unroll 4
    for (int c = 0; c < kCols; ++c) {
      const uint8_t* s = w + c * row_bytes + sb * kSuper;
      // two integer accumulators a row of x (even and odd steps): half the dependency chain
      V sums[kRows][2];
      for (int r = 0; r < kRows; ++r) sums[r][0] = sums[r][1] = S::zero();
      if constexpr (kType == kQ6_K) {
        const V scales = S::q6_scales(reinterpret_cast<const int8_t*>(s + 192));
#pragma GCC unroll 4
        for (int z = 0; z < 4; ++z) {  // weights 64 z .. 64 z + 63: half z / 2, part z % 2
          const V ql = S::load64(s + 64 * (z / 2)), hb = S::broadcast32(s + 128 + 32 * (z / 2));
          const V codes = S::q6_codes(ql, hb, z % 2), sc = S::q6_part_scales(scales, z);
          for (int r = 0; r < kRows; ++r)
            sums[r][z % 2] =
                S::dot_scaled(sums[r][z % 2], codes, S::load64(x.row(r).q + sb * 256 + 64 * z), sc);
        }
        const float d = half_to_float(load_u16(s + 208));
        for (int r = 0; r < kRows; ++r) {
          const Q8Rows xr = x.row(r);
          const float dx = d * xr.d[sb];
          // codes are q + 32: subtract 32 * sum_k scale_k * (sum of x over the 16 values)
          acc[r][c] = add_super_block(acc[r][c], S::fold(S::add32(sums[r][0], sums[r][1])), dx,
                                      q6_offset_sums(s + 192, xr.bsums + sb * 16), -32.f * dx);
        }
      } else {
        const __m128i scales_mins = k_scales_vector(s);
        const auto scales = S::k_scales(scales_mins);
        V high;
        if constexpr (kType == kQ5_K) high = S::broadcast32(s + 16);
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {  // sub-blocks 2i, 2i + 1: weights 64 i .. 64 i + 63
          V codes = S::nibbles32(s + kNibbles + 32 * i);
          if constexpr (kType == kQ5_K) codes = S::add_fifth_bit(codes, high, 2 * i);
          const V sc = S::k_pair_scales(scales, i);
          for (int r = 0; r < kRows; ++r)
            sums[r][i % 2] =
                S::dot_scaled(sums[r][i % 2], codes, S::load64(x.row(r).q + sb * 256 + 64 * i), sc);
        }
        // d and dmin in one conversion
        uint32_t both;
        std::memcpy(&both, s, sizeof(both));
        const __m128 scale = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(both)));
        const float d = _mm_cvtss_f32(scale), dmin = _mm_cvtss_f32(_mm_movehdup_ps(scale));
        for (int r = 0; r < kRows; ++r) {
          const Q8Rows xr = x.row(r);
          acc[r][c] =
              add_super_block(acc[r][c], S::fold(S::add32(sums[r][0], sums[r][1])), d * xr.d[sb],
                              k_min_sums(scales_mins, xr.bsums + sb * 16), -dmin * xr.d[sb]);
        }
      }
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kCols; ++c) y[r * ldy + c] = sum8(acc[r][c]);
}

// Code-block types (gguf_code_blocks.h): sum_j mins_j * bsums[j] over the 16 units, as 8 int32
inline __m256i code_min_sums(const int16_t* mins, const int16_t* bsums) {
  return _mm256_madd_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(mins)),
                           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bsums)));
}

// A CodeBlockDecoder's optional kCodeOffset (code + offset in [0, 128] for every code), or -1:
// with one, codes + offset meet x in vpmaddubsw as unsigned bytes, and offset * sum_j scale_j *
// bsum_j is taken off the integer sums, instead of the signs' three operations a chunk.
template <class D, class = void>
struct code_offset : std::integral_constant<int, -1> {};
template <class D>
struct code_offset<D, std::void_t<decltype(D::kCodeOffset)>>
    : std::integral_constant<int, D::kCodeOffset> {};

// A CodeBlockDecoder's bound on |code|: its kMaxCode, else 128.
template <class D, class = void>
struct code_bound : std::integral_constant<int, 128> {};
template <class D>
struct code_bound<D, std::void_t<decltype(D::kMaxCode)>>
    : std::integral_constant<int, D::kMaxCode> {};
// A code-block type's code_bound, else 128.
template <int64_t kType>
constexpr int code_block_max_code() {
  if constexpr (is_code_block_type(kType))
    return code_bound<CodeBlockDecoder<kType>>::value;
  else
    return 128;
}

// Whether a type computed as code blocks has mins; false for the others.
template <int64_t kType>
constexpr bool code_block_mins() {
  if constexpr (is_code_block_type(kType))
    return CodeBlockDecoder<kType>::kHasMins;
  else
    return false;
}
// A code-block type's kCodeOffset (code_offset), else -1.
template <int64_t kType>
constexpr int code_block_offset() {
  if constexpr (is_code_block_type(kType))
    return code_offset<CodeBlockDecoder<kType>>::value;
  else
    return -1;
}

// Whether a CodeBlockDecoder serves q8_dot_code_blocks's grid path (kGrid, grid_index, unpack:
// IQ2_XXS, IQ2_XS and IQ2_S on AVX2 builds).
template <class D, class = void>
struct has_grid_unpack : std::false_type {};
template <class D>
struct has_grid_unpack<D, std::void_t<decltype(D::kGrid)>> : std::true_type {};

// q8_dot_super_blocks for a type computed as code blocks: each weight row's super-block decoded
// once (its CodeBlockDecoder), its signed codes meeting every row of x as |code| times x with
// the code's sign, or as code + kCodeOffset (vpmaddubsw), times the int16 unit scales into int32
// (vpdpwssd); then one float multiply a super-block with d * dx, and the mins' dmin * dx *
// sum_j min_j * bsum_j. Grid decoders with an unpacking (has_grid_unpack) skip the codes: the
// grid's unsigned values meet x with the weights' signs applied to x (vpsignb), instead of signed
// codes being stored, read back and split again into magnitudes and signs for every row of x. On
// a Zen 3 core (IQ2_XXS, 1024 x 2048 from L3, one row of x): 69 against 86 cycles a row's
// super-block.
template <class S, int64_t kType, int kRows, int kCols>
void q8_dot_code_blocks(const Q8Rows& x, const uint8_t* w, int64_t row_bytes, int64_t K, float* y,
                        int64_t ldy, const PrefetchWindow& prefetch) {
  using V = typename S::V;
  using Decoder = CodeBlockDecoder<kType>;
  constexpr int64_t kSuper = gguf_type_info(kType).unit_bytes;
  constexpr int kOffset = code_offset<Decoder>::value;
  static_assert(kOffset <= 128, "codes + kCodeOffset must fit vpmaddubsw's unsigned bytes");
  constexpr bool kGrid = has_grid_unpack<Decoder>::value;
  __m256 acc[kRows][kCols];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kCols; ++c) acc[r][c] = _mm256_setzero_ps();
  CodeBlock cb[kCols];  // one a weight row: the next row's decoding need not wait for this one's
  for (int64_t sb = 0; sb < K / kCodeBlockWeights; ++sb) {
    prefetch_ahead(prefetch, w, kCols, sb * kSuper, kSuper);
#pragma GCC unroll 4
    for (int c = 0; c < kCols; ++c) {
      const uint8_t* super = w + c * row_bytes + sb * kSuper;
      V sums[kRows][2];
      for (int r = 0; r < kRows; ++r) sums[r][0] = sums[r][1] = S::zero();
      if constexpr (kGrid) {
        iq::Unpacked u;  // its signs; cb[c] takes d and the scales
        Decoder::unpack(super, u, &cb[c]);
        const __m256i one = _mm256_set1_epi8(1);
#pragma GCC unroll 4
        for (int z = 0; z < 4; ++z) {  // weights 64 z .. 64 z + 63: units 4 z .. 4 z + 3
          // groups g .. g + 3, their indices read from the super-block: from the unpacked
          // indices (vpextrd out of the vectors, or loads of their stores) IQ2_XXS took 1.1x
          // the time (a Zen 3 core, 1024 x 2048 from L3)
          const auto values4 = [&](int g) {
            return iq::table_entries4(
                Decoder::kGrid, Decoder::grid_index(super, g), Decoder::grid_index(super, g + 1),
                Decoder::grid_index(super, g + 2), Decoder::grid_index(super, g + 3));
          };
          const V values = {values4(8 * z), values4(8 * z + 4)};
          // -1 where the weight is negative, else 1
          const V signs = {_mm256_or_si256(iq::sign_mask(u.signs + 8 * z), one),
                           _mm256_or_si256(iq::sign_mask(u.signs + 8 * z + 4), one)};
          const V sc = S::code_scales(cb[c].scales, z);
          const int8_t* xq = x.q + sb * kCodeBlockWeights + 64 * z;
          for (int r = 0; r < kRows; ++r)
            sums[r][z % 2] = S::dot_scaled(
                sums[r][z % 2], values, S::signed_x(S::load64(xq + r * x.q_stride), signs), sc);
        }
      } else {
        Decoder::decode(super, &cb[c]);
#pragma GCC unroll 4
        for (int z = 0; z < 4; ++z) {  // codes 64 z .. 64 z + 63: units 4 z .. 4 z + 3
          const V codes = S::load64(cb[c].codes + 64 * z), sc = S::code_scales(cb[c].scales, z);
          const int8_t* xq = x.q + sb * kCodeBlockWeights + 64 * z;
          if constexpr (kOffset >= 0) {
            const V u = kOffset > 0 ? S::add8(codes, kOffset) : codes;
            for (int r = 0; r < kRows; ++r)
              sums[r][z % 2] =
                  S::dot_scaled(sums[r][z % 2], u, S::load64(xq + r * x.q_stride), sc);
          } else {
            const V magnitudes = S::abs8(codes);
            const typename S::Signs signs = S::code_signs(codes);
            for (int r = 0; r < kRows; ++r)
              sums[r][z % 2] =
                  S::dot_scaled(sums[r][z % 2], magnitudes,
                                S::signed_x(S::load64(xq + r * x.q_stride), signs), sc);
          }
        }
      }
      // the offset's share: offset * scale_j, times each row's bsums
      __m256i offset_scales;
      if constexpr (kOffset > 0)
        offset_scales =
            _mm256_mullo_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(cb[c].scales)),
                               _mm256_set1_epi16(static_cast<short>(kOffset)));
      for (int r = 0; r < kRows; ++r) {
        const Q8Rows xr = x.row(r);
        __m256i total = S::fold(S::add32(sums[r][0], sums[r][1]));
        if constexpr (kOffset > 0) {
          const __m256i bsums =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr.bsums + sb * 16));
          total = _mm256_sub_epi32(total, _mm256_madd_epi16(offset_scales, bsums));
        }
        if constexpr (Decoder::kHasMins)
          acc[r][c] =
              add_super_block(acc[r][c], total, cb[c].d * xr.d[sb],
                              code_min_sums(cb[c].mins, xr.bsums + sb * 16), cb[c].dmin * xr.d[sb]);
        else
          acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total),
                                      _mm256_set1_ps(cb[c].d * xr.d[sb]), acc[r][c]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kCols; ++c) y[r * ldy + c] = sum8(acc[r][c]);
}

// The 32-bit words at p0 .. p3 in one vector.
inline __m128i quad_words(const uint8_t* p0, const uint8_t* p1, const uint8_t* p2,
                          const uint8_t* p3) {
  const auto word = [](const uint8_t* p) {
    int v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  };
  return _mm_setr_epi32(word(p0), word(p1), word(p2), word(p3));
}

// The same for the 32-weight block types (one scale a block): the block scales (and mins) of 16
// blocks converted at once as the kernel reaches them, times x's in 16-block vectors.
template <class S, int64_t kType, int kRows, int kCols>
void q8_dot_blocks(const Q8Rows& x, const uint8_t* w, int64_t row_bytes, int64_t nb, float* y,
                   int64_t ldy, const PrefetchWindow& prefetch) {
  using V = typename S::V;
  using F = typename S::F;
  constexpr int64_t bb = block_bytes(kType);
  constexpr int64_t kCodes = nibble_offset(kType);  // where a block's nibbles / int8s start
  // what a weight block adds per unit of its x's sum: w = d (code - offset) (+ m for Q4_1,
  // Q5_1). Q8_0 and IQ4_NL codes are signed, S::kQ8Offset what S adds to make them unsigned.
  // MXFP4's offset (kIntOffset) comes off the integer sums instead, exactly: its codes
  // (|code| <= 12, some 0) are small beside an offset of 128, whose fp32 product with x's sum
  // would cancel most of the result's bits. x's share, offset times its sums, is found once a
  // chunk of 16 blocks for every weight row.
  constexpr float kOffset = kType == kQ4_0                       ? 8.f
                            : kType == kQ5_0                     ? 16.f
                            : kType == kQ8_0 || kType == kIQ4_NL ? S::kQ8Offset
                                                                 : 0.f;
  constexpr bool kSigned = is_table_nibble_type(kType);  // codes for S::dot_q8, as Q8_0's
  constexpr bool kIntOffset = kType == kMXFP4 && S::kQ8Offset != 0;
  F acc[kRows][kCols];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kCols; ++c) acc[r][c] = S::fzero();
  // 16 blocks of one weight row after the other (rows side by side in smaller steps stream
  // worse from DRAM, as the K-quants' did)
  for (int64_t b0 = 0; b0 < nb; b0 += 16) {
    const int64_t n = std::min<int64_t>(16, nb - b0);
    prefetch_ahead(prefetch, w, kCols, b0 * bb, 16 * bb);
    // kIntOffset: offset * x of each quad's blocks, summed as dot_q8 sums the codes' products
    V x_offset[kIntOffset ? kRows : 1][4];
    if constexpr (kIntOffset) {
      const V offset = S::add8(S::zero(), S::kQ8Offset);
      for (int q = 0; q < 4 && 4 * q < n; ++q)
        for (int r = 0; r < kRows; ++r) {
          const int8_t* xq = x.row(r).q + (b0 + 4 * q) * 32;
          x_offset[r][q] =
              S::dot_q8(S::dot_q8(S::zero(), offset, S::load64(xq)), offset, S::load64(xq + 64));
        }
    }
#pragma GCC unroll 4
    for (int c = 0; c < kCols; ++c) {
      const uint8_t* row = w + c * row_bytes;
      F dw, mw, scale[kRows];  // scale: d_b * dx_b of the 16 blocks
      if constexpr (has_e8m0_scale(kType))
        S::template e8m0_scales16<bb>(row + b0 * bb, n, &dw);
      else
        S::template block_scales16<bb, has_block_min(kType)>(row + b0 * bb, n, &dw, &mw);
      for (int r = 0; r < kRows; ++r) {
        const Q8Rows xr = x.row(r);
        scale[r] = S::mul(dw, S::load16(xr.d + b0));
        // the offsets: the sum of x times -offset * d (+ m)
        const F sx = S::load16(xr.s + b0);
        if constexpr (has_block_min(kType)) acc[r][c] = S::fma(mw, sx, acc[r][c]);
        if constexpr (kOffset != 0.f) acc[r][c] = S::fma(S::mul(dw, -kOffset), sx, acc[r][c]);
      }
      if constexpr (kType != kQ8_0) {
        // the 4-bit types: four blocks a step, their 16 nibble bytes in one vector (x in quads
        // to match: Q8Rows from quantize_rows<32, true>); past the last block, the quad's first
        // one again against x's zeros
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) {
          if (4 * q >= n) break;
          const int64_t b = b0 + 4 * q;
          V low, high;
          if constexpr (has_fifth_bit(kType) && S::kQuadPermute) {
            S::template quad5<bb, kCodes>(row + b * bb, nb - b, &low, &high);
          } else {
            const uint8_t* blk = row + b * bb + kCodes;
            const V bytes = b + 4 <= nb ? S::bytes16x4(blk, blk + bb, blk + 2 * bb, blk + 3 * bb)
                                        : S::bytes16x4(blk, blk + bb * (b + 1 < nb),
                                                       blk + 2 * bb * (b + 2 < nb),
                                                       blk + 3 * bb * (b + 3 < nb));
            low = S::low_nibbles(bytes);
            high = S::high_nibbles(bytes);
            if constexpr (has_fifth_bit(kType)) {  // past the last block: any bits (x is 0)
              const uint8_t* qh = blk - 4;  // the fifth bits' word
              const __m128i words =
                  b + 4 <= nb ? quad_words(qh, qh + bb, qh + 2 * bb, qh + 3 * bb)
                              : quad_words(qh, qh + bb * (b + 1 < nb), qh + 2 * bb * (b + 2 < nb),
                                           qh + 3 * bb * (b + 3 < nb));
              S::add_quad_fifth_bits(&low, &high, words);
            }
          }
          if constexpr (kSigned) {
            low = S::table_codes(low, nibble_values(kType));
            high = S::table_codes(high, nibble_values(kType));
          }
          for (int r = 0; r < kRows; ++r) {
            const int8_t* xq = x.row(r).q + b * 32;
            V sums;
            if constexpr (kSigned)
              sums = S::dot_q8(S::dot_q8(S::zero(), low, S::load64(xq)), high, S::load64(xq + 64));
            else
              sums = S::dot_u8(S::dot_u8(S::zero(), low, S::load64(xq)), high, S::load64(xq + 64));
            if constexpr (kIntOffset) sums = S::sub32(sums, x_offset[r][q]);
            acc[r][c] = S::fma_cvt(acc[r][c], sums, S::quad_scale(scale[r], q));
          }
        }
      } else {
#pragma GCC unroll 8
        for (int p = 0; p < 8; ++p) {
          if (2 * p >= n) break;
          const int64_t b = b0 + 2 * p, b1 = std::min(b + 1, nb - 1);  // an odd last block: twice
          const V codes = S::q8x2(row + b * bb + kCodes, row + b1 * bb + kCodes);
          for (int r = 0; r < kRows; ++r) {
            // past an odd last block x is zeros (Q8Rows' padding): the second copy adds nothing
            const V sums = S::dot_q8(S::zero(), codes, S::load64(x.row(r).q + b * 32));
            acc[r][c] = S::fma_cvt(acc[r][c], sums, S::pair_scale(scale[r], p));
          }
        }
      }
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kCols; ++c) y[r * ldy + c] = S::reduce(acc[r][c]);
}
#endif

// The portable version: one weight row and one row of x at a time, the same integer sums
// (Q8_0 signed, without the offset), each block's codes unpacked into bytes first.
template <int64_t kType>
float q8_dot_scalar(const Q8Rows& x, const uint8_t* row, int64_t K) {
  float y = 0.f;
  if constexpr (is_code_block_type(kType)) {
    // the code blocks' integer sums, a unit's codes times x scaled by the unit's scale
    constexpr int64_t kSuper = gguf_type_info(kType).unit_bytes;
    CodeBlock cb;
    for (int64_t sb = 0; sb < K / kCodeBlockWeights; ++sb) {
      CodeBlockDecoder<kType>::decode(row + sb * kSuper, &cb);
      const int8_t* q = x.q + sb * kCodeBlockWeights;
      const int16_t* bsums = x.bsums + sb * 16;
      int32_t sum = 0, mins = 0;
      for (int64_t u = 0; u < kCodeBlockWeights / kCodeUnit; ++u) {
        int32_t dot = 0;
        for (int64_t i = 0; i < kCodeUnit; ++i)
          dot += cb.codes[u * kCodeUnit + i] * q[u * kCodeUnit + i];
        sum += cb.scales[u] * dot;
        mins += cb.mins[u] * bsums[u];
      }
      y += x.d[sb] * (cb.d * static_cast<float>(sum) + cb.dmin * static_cast<float>(mins));
    }
    return y;
  }
  if constexpr (kType == kQ4_K || kType == kQ5_K || kType == kQ6_K) {
    constexpr int64_t kSuper = kType == kQ4_K   ? kSuperBytes
                               : kType == kQ5_K ? kQ5SuperBytes
                                                : kQ6SuperBytes;
    for (int64_t sb = 0; sb < K / 256; ++sb) {
      const uint8_t* s = row + sb * kSuper;
      const int8_t* q = x.q + sb * 256;
      const int16_t* bsums = x.bsums + sb * 16;
      int32_t sum = 0, offset = 0;
      if constexpr (kType == kQ6_K) {
        const int8_t* scales = reinterpret_cast<const int8_t*>(s + 192);
        for (int64_t j = 0; j < 16; ++j) {  // 16 weights a scale; block j / 2's bits
          const Q6Bits bits = q6_k_bits(row, sb * 8 + j / 2);
          int32_t dot = 0;
          for (int l = 0; l < 16; ++l)
            dot += (q6_k_value(bits, 16 * (j % 2) + l) + 32) * q[16 * j + l];
          sum += scales[j] * dot;
          offset += scales[j] * bsums[j];
        }
        y += half_to_float(load_u16(s + 208)) * x.d[sb] * static_cast<float>(sum - 32 * offset);
      } else {
        const KScales k = k_scales_of(s);
        for (int64_t j = 0; j < 8; ++j) {  // sub-block j: block sb * 8 + j of the row
          const uint8_t *lo, *hi;
          int lo_shift, hi_shift;
          nibble_runs<kType>(row, sb * 8 + j, &lo, &hi, &lo_shift, &hi_shift);
          const uint8_t* bits = kType == kQ5_K ? q5_k_high_bits(row, sb * 8 + j) : nullptr;
          int32_t dot = 0;
          for (int l = 0; l < 32; ++l) {
            int code = l < 16 ? (lo[l] >> lo_shift) & 15 : (hi[l - 16] >> hi_shift) & 15;
            if (kType == kQ5_K) code |= ((bits[l] >> j) & 1) << 4;
            dot += code * q[32 * j + l];
          }
          sum += static_cast<int32_t>((k.scales >> (8 * j)) & 255) * dot;
          offset +=
              static_cast<int32_t>((k.mins >> (8 * j)) & 255) * (bsums[2 * j] + bsums[2 * j + 1]);
        }
        y += x.d[sb] * (half_to_float(load_u16(s)) * static_cast<float>(sum) -
                        half_to_float(load_u16(s + 2)) * static_cast<float>(offset));
      }
    }
    return y;
  }
  constexpr int64_t bb = block_bytes(kType);
  for (int64_t b = 0; b < K / 32; ++b) {
    const int8_t* q = x.q + b * 32;
    int32_t dot = 0;
    if constexpr (kType == kQ8_0) {
      const int8_t* wq = reinterpret_cast<const int8_t*>(row + b * bb + 2);
      for (int l = 0; l < 32; ++l) dot += wq[l] * q[l];
    } else {
      const uint8_t* nibbles = row + b * bb + nibble_offset(kType);
      const uint32_t fifth = has_fifth_bit(kType) ? fifth_bits<kType>(row + b * bb) : 0;
      for (int l = 0; l < 32; ++l) {
        const int nibble = (nibbles[l % 16] >> (l / 16 * 4)) & 15;
        const int code = is_table_nibble_type(kType)
                             ? nibble_values(kType)[nibble]
                             : nibble | static_cast<int>((fifth >> l) & 1) << 4;
        dot += code * q[l];
      }
    }
    const float d = has_e8m0_scale(kType) ? e8m0_half_to_float(row[b * bb])
                                          : half_to_float(load_u16(row + b * bb));
    y += d * x.d[b] * static_cast<float>(dot);
    if constexpr (kType == kQ4_0 || kType == kQ5_0)
      y -= (kType == kQ4_0 ? 8.f : 16.f) * d * x.s[b];
    if constexpr (has_block_min(kType)) y += half_to_float(load_u16(row + b * bb + 2)) * x.s[b];
  }
  return y;
}

}  // namespace hybridllm_gguf
