// Linear layer y = x W^T computed straight from GGUF-quantized weight blocks (the types of
// gguf_types.h), with fp32 activations and fp32 arithmetic or, for few rows of x on request,
// int8 activations and integer dot products (gguf_q8_linear_cpu.cpp). Registered as the torch op
// hybridllm::gguf_linear; built on first use by hybridllm/layers/cpu_kernels.py with the other
// CPU kernels.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gguf_blocks.h"
#include "gguf_linear.h"
#include "gguf_panel_gemm.h"
#include "gguf_prefetch.h"
#include "gguf_x8.h"
#include "gguf_q8_linear.h"

namespace {

using namespace hybridllm_gguf;


// Up to this many rows of x the direct kernel runs (every weight block is decoded once and used
// for all rows); above it the panel GEMM (gguf_panel_gemm.h) or, for more rows than it serves or
// without AVX-512, chunks of decoded fp32 weights through the BLAS GEMM. The constants below were
// measured on a 2-core AVX-512 Xeon (the direct kernel was faster up to M = 24-32).
constexpr int64_t kDirectMaxRows = 24;
// Rows of x handled together by the direct kernel (accumulators live in registers).
constexpr int kRowTile = 8;
// Decoded fp32 weight rows a BLAS GEMM of the many-rows path takes at once: SmolLM2's largest
// linear (3072 x 576) in one GEMM, a 49152-row LM head in 14.
constexpr int64_t kChunkMaxBytes = 8 << 20;
// Whether the fp32 panel GEMM is built. Without it many rows of x took the decoded fp32 weights
// through torch's BLAS, which on a 2-core Zen 3 (AVX2, MKL) ran at 10-16 GMAC/s against 80 for
// the int8 few-rows kernels (Q4_K, 2048 x 2048, M = 32-512).
#if defined(__AVX512F__)
constexpr bool kFp32PanelBuilt = true;
#else
constexpr bool kFp32PanelBuilt = false;
#endif


#if defined(__AVX512F__)
// y[r * ldy + c] = dot(x row r, weight row c) for kRows rows of x and kCols consecutive weight
// rows (w: the first, row_bytes apart; nb blocks each; fp32 scales d[c * nb + b], mins m[...]).
// x is packed [nb, kRows, 32]: block b of row r at (b * kRows + r) * 32, so one pointer walks all
// rows. Each weight block is decoded once into two 16-lane vectors (elements 0-15, 16-31) that
// every row of x uses; each x load feeds kCols FMAs.
template <int64_t kType, int kRows, int kCols>
inline void dot_rows(const float* x, const uint8_t* w, int64_t row_bytes, int64_t nb,
                     const float* d, const float* m, float* y, int64_t ldy,
                     PrefetchWindow prefetch) {
  constexpr int64_t bb = block_bytes(kType);
  // bytes a row holds per block, to pace the prefetches (Q6_K: 210 / 8, rounded down)
  constexpr int64_t kStep = kType == kQ6_K ? kQ6SuperBytes / 8 : bb;
  // FMA latency is 4 cycles: with few accumulators, elements 0-15 and 16-31 get separate chains
  constexpr int kChains = kRows * kCols <= 4 ? 2 : 1;
  __m512 acc[kRows][kCols][kChains];
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kCols; ++c)
      for (int h = 0; h < kChains; ++h) acc[r][c][h] = _mm512_setzero_ps();
  __m512i pair[kCols][2];  // Q4_K, Q5_K: the widened nibble bytes of the current sub-block pair
  __m512i high[kCols][2];  // Q5_K: the widened high-bit bytes of the current super-block

  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * kRows * kBlock;
    __m512 lo[kCols], hi[kCols];  // block b's 32 weights of each weight row
    // The call reads kCols * row_bytes contiguous bytes, kCols * bb a step: fetch as many bytes
    // prefetch.distance ahead (not past the end of this thread's rows), so the next calls'
    // rows arrive from memory before they are needed.
    const char* ahead = reinterpret_cast<const char*>(w) + prefetch.distance + b * kCols * kStep;
    if (ahead < prefetch.stop)
      for (int64_t o = 0; o < kCols * kStep; o += 64) prefetch_line(ahead + o, prefetch.streaming);
#pragma GCC unroll 4
    for (int c = 0; c < kCols; ++c) {
      const uint8_t* blk = w + c * row_bytes + b * bb;
      if constexpr (kType == kF32) {
        lo[c] = _mm512_loadu_ps(reinterpret_cast<const float*>(blk));
        hi[c] = _mm512_loadu_ps(reinterpret_cast<const float*>(blk) + 16);
        continue;
      }
      if constexpr (kType == kF16 || kType == kBF16) {
        lo[c] = widen_halves(blk, kType == kBF16);
        hi[c] = widen_halves(blk + 32, kType == kBF16);
        continue;
      }
      const float scale = d[c * nb + b];
      if constexpr (kType == kQ6_K) {
        // two scales a block: d for weights 0-15, m for 16-31
        q6_k_values(q6_k_bits(w + c * row_bytes, b), &lo[c], &hi[c]);
        lo[c] = _mm512_mul_ps(lo[c], _mm512_set1_ps(scale));
        hi[c] = _mm512_mul_ps(hi[c], _mm512_set1_ps(m[c * nb + b]));
        continue;
      }
      if constexpr (kType == kQ8_0) {
        lo[c] = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2))));
        hi[c] = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18))));
        if constexpr (kRows == 1) {
          // one row: scale the block's partial dot (1 multiply) instead of its 32 weights (2)
          const __m512 part = _mm512_fmadd_ps(hi[c], _mm512_load_ps(xb + 16),
                                              _mm512_mul_ps(lo[c], _mm512_load_ps(xb)));
          acc[0][c][0] = _mm512_fmadd_ps(part, _mm512_set1_ps(scale), acc[0][c][0]);
          continue;
        }
        lo[c] = _mm512_mul_ps(lo[c], _mm512_set1_ps(scale));
        hi[c] = _mm512_mul_ps(hi[c], _mm512_set1_ps(scale));
      } else {
        // A 16-entry table of the block's possible weights, indexed by nibble with vpermps
        // (which reads only each lane's low 4 bits): decoding costs 2 permutes, no converts.
        const __m512 table =
            nibble_table<kType>(scale, scales_have_mins(kType) ? m[c * nb + b] : 0.f);
        if constexpr (kType == kQ4_K || kType == kQ5_K) {
          // sub-blocks 2i and 2i + 1 share 32 bytes (low and high nibbles): widen them once
          if (b % 2 == 0) {
            const uint8_t *qlo, *qhi;
            int lo_shift, hi_shift;
            nibble_runs<kType>(w + c * row_bytes, b, &qlo, &qhi, &lo_shift, &hi_shift);
            pair[c][0] = widen_bytes(qlo);
            pair[c][1] = widen_bytes(qhi);
          }
          if constexpr (kType == kQ5_K) {
            // each nibble's fifth bit chooses the upper 16 weights
            if (b % 8 == 0) {
              const uint8_t* bits = q5_k_high_bits(w + c * row_bytes, b);
              high[c][0] = widen_bytes(bits);
              high[c][1] = widen_bytes(bits + 16);
            }
            const int shift = static_cast<int>(b % 2) * 4, bit = static_cast<int>(b % 8);
            const __m512 upper = _mm512_add_ps(table, _mm512_set1_ps(16.f * scale));
            for (int h = 0; h < 2; ++h) {
              const __m512i nibble =
                  _mm512_and_si512(_mm512_srli_epi32(pair[c][h], shift), _mm512_set1_epi32(15));
              const __m512i fifth = _mm512_slli_epi32(
                  _mm512_and_si512(_mm512_srli_epi32(high[c][h], bit), _mm512_set1_epi32(1)), 4);
              (h == 0 ? lo : hi)[c] =
                  _mm512_permutex2var_ps(table, _mm512_or_si512(nibble, fifth), upper);
            }
          } else if (b % 2 == 0) {
            lo[c] = _mm512_permutexvar_ps(pair[c][0], table);  // vpermps reads the low 4 bits
            hi[c] = _mm512_permutexvar_ps(pair[c][1], table);
          } else {
            lo[c] = _mm512_permutexvar_ps(_mm512_srli_epi32(pair[c][0], 4), table);
            hi[c] = _mm512_permutexvar_ps(_mm512_srli_epi32(pair[c][1], 4), table);
          }
        } else if constexpr (has_fifth_bit(kType)) {
          // Q5_0, Q5_1: the nibble's weight, + 16 d where the fifth bit is set (for Q5_1 one
          // rounding more than dequantize_row's; a masked add is cheaper than vpermt2ps)
          const __m512i q = widen_bytes(blk + nibble_offset(kType));
          const uint32_t fifth = fifth_bits<kType>(blk);
          const __m512 step = _mm512_set1_ps(16.f * scale);
          lo[c] = _mm512_permutexvar_ps(q, table);
          hi[c] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
          lo[c] = _mm512_mask_add_ps(lo[c], static_cast<__mmask16>(fifth), lo[c], step);
          hi[c] = _mm512_mask_add_ps(hi[c], static_cast<__mmask16>(fifth >> 16), hi[c], step);
        } else {
          const __m512i q = widen_bytes(blk + nibble_offset(kType));
          lo[c] = _mm512_permutexvar_ps(q, table);
          hi[c] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
        }
      }
    }
    if constexpr (kType == kQ8_0 && kRows == 1) continue;
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const __m512 xlo = _mm512_load_ps(xb + r * kBlock);
      const __m512 xhi = _mm512_load_ps(xb + r * kBlock + 16);
#pragma GCC unroll 4
      for (int c = 0; c < kCols; ++c) {
        acc[r][c][0] = _mm512_fmadd_ps(lo[c], xlo, acc[r][c][0]);
        acc[r][c][kChains - 1] = _mm512_fmadd_ps(hi[c], xhi, acc[r][c][kChains - 1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) {
    __m512 s[kCols];
    for (int c = 0; c < kCols; ++c)
      s[c] = kChains == 2 ? _mm512_add_ps(acc[r][c][0], acc[r][c][kChains - 1]) : acc[r][c][0];
    if constexpr (kCols == 1) {
      y[r * ldy] = _mm512_reduce_add_ps(s[0]);
    } else {
      // All kCols sums at once, halving the vectors each step: t[c] 128-bit lanes hold the
      // partial sums of s[c] (kCols = 2: lanes 0-1 s0, 2-3 s1; kCols = 4: lane c is s[c]).
      __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(s[0], s[1], 0x44),
                               _mm512_shuffle_f32x4(s[0], s[1], 0xEE));
      if constexpr (kCols == 4) {
        const __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(s[2], s[3], 0x44),
                                       _mm512_shuffle_f32x4(s[2], s[3], 0xEE));
        t = _mm512_add_ps(_mm512_shuffle_f32x4(t, u, 0x88), _mm512_shuffle_f32x4(t, u, 0xDD));
      }
      t = _mm512_add_ps(t, _mm512_permute_ps(t, 0x4E));  // then within each 128-bit lane
      t = _mm512_add_ps(t, _mm512_permute_ps(t, 0xB1));
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, t);
      if constexpr (kCols == 4) {
        for (int c = 0; c < 4; ++c) y[r * ldy + c] = lanes[4 * c];
      } else {
        y[r * ldy] = lanes[0] + lanes[4];
        y[r * ldy + 1] = lanes[8] + lanes[12];
      }
    }
  }
}
#elif defined(HYBRIDLLM_FP32_AVX2)
// AVX2 version of the above, one weight row at a time: 16 vector registers hold neither 2-4
// rows' decoded blocks nor kRows x kCols accumulators. Each block is decoded once
// (decode_block8) into four 8-lane vectors that every row of x uses.
template <int64_t kType, int kRows, int kCols>
inline void dot_rows(const float* x, const uint8_t* w, int64_t row_bytes, int64_t nb,
                     const float* d, const float* m, float* y, int64_t ldy, PrefetchWindow) {
  // FMA latency is 4 cycles: one or two rows of x get 4 or 2 chains of the block's 4 FMAs
  constexpr int kChains = kRows == 1 ? 4 : kRows == 2 ? 2 : 1;
  constexpr bool kScaled = !is_float_type(kType);
  constexpr bool kSecondScale = scales_have_mins(kType) || kType == kQ6_K;
  for (int c = 0; c < kCols; ++c) {
    const uint8_t* row = w + c * row_bytes;
    __m256 acc[kRows][kChains];
    for (int r = 0; r < kRows; ++r)
      for (int h = 0; h < kChains; ++h) acc[r][h] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m256 wv[4];  // block b's 32 weights
      decode_block8<kType>(row, b, kScaled ? d[c * nb + b] : 0.f,
                           kSecondScale ? m[c * nb + b] : 0.f, wv);
      const float* xb = x + b * kRows * kBlock;
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r)
        for (int q = 0; q < 4; ++q)
          acc[r][q % kChains] = _mm256_fmadd_ps(wv[q], _mm256_load_ps(xb + r * kBlock + 8 * q),
                                                acc[r][q % kChains]);
    }
    for (int r = 0; r < kRows; ++r) {
      for (int h = 1; h < kChains; ++h) acc[r][0] = _mm256_add_ps(acc[r][0], acc[r][h]);
      y[r * ldy + c] = sum8(acc[r][0]);
    }
  }
}
#else
// Portable version of the above: decode each block to fp32, then plain dot products.
template <int64_t kType, int kRows, int kCols>
inline void dot_rows(const float* x, const uint8_t* w, int64_t row_bytes, int64_t nb,
                     const float* d, const float* m, float* y, int64_t ldy, PrefetchWindow) {
  constexpr int64_t bb = block_bytes(kType);
  float wf[kBlock];
  for (int c = 0; c < kCols; ++c) {
    float acc[kRows] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + c * row_bytes + b * bb;
      if constexpr (kType == kF32) {
        std::memcpy(wf, blk, sizeof(wf));
      } else if constexpr (kType == kF16 || kType == kBF16) {
        for (int j = 0; j < 32; ++j)
          wf[j] = half_bits_to_float(load_u16(blk + 2 * j), kType == kBF16);
      } else if constexpr (kType == kQ6_K) {
        const Q6Bits bits = q6_k_bits(w + c * row_bytes, b);
        for (int l = 0; l < 32; ++l)
          wf[l] = (l < 16 ? d : m)[c * nb + b] * static_cast<float>(q6_k_value(bits, l));
      } else if constexpr (kType == kQ8_0) {
        const float scale = d[c * nb + b];
        const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
        for (int j = 0; j < 32; ++j) wf[j] = scale * static_cast<float>(q[j]);
      } else {
        const float scale = d[c * nb + b];
        const uint8_t *lo, *hi;
        int lo_shift, hi_shift;
        nibble_runs<kType>(w + c * row_bytes, b, &lo, &hi, &lo_shift, &hi_shift);
        const float shift = kType == kQ4_0 ? 8.f : kType == kQ5_0 ? 16.f : 0.f;
        const float low = scales_have_mins(kType) ? m[c * nb + b] : 0.f;
        const uint8_t* bits = kType == kQ5_K ? q5_k_high_bits(w + c * row_bytes, b) : nullptr;
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
          if constexpr (is_table_nibble_type(kType)) {
            wf[j] = scale * static_cast<float>(nibble_values(kType)[q0]);
            wf[j + 16] = scale * static_cast<float>(nibble_values(kType)[q1]);
          } else {
            wf[j] = scale * (static_cast<float>(q0) - shift) + low;
            wf[j + 16] = scale * (static_cast<float>(q1) - shift) + low;
          }
        }
      }
      for (int r = 0; r < kRows; ++r) {
        const float* xb = x + (b * kRows + r) * kBlock;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int j = 0; j < 32; ++j) s += wf[j] * xb[j];
        acc[r] += s;
      }
    }
    for (int r = 0; r < kRows; ++r) y[r * ldy + c] = acc[r];
  }
}
#endif

template <int64_t kType, int kCols>
inline void dot_rows_dispatch(int rows, const float* x, const uint8_t* w, int64_t row_bytes,
                              int64_t nb, const float* d, const float* m, float* y, int64_t ldy,
                              PrefetchWindow prefetch) {
  if constexpr (kCols == 4) {  // only used with 1-2 rows of x
    if (rows == 1) return dot_rows<kType, 1, 4>(x, w, row_bytes, nb, d, m, y, ldy, prefetch);
    return dot_rows<kType, 2, 4>(x, w, row_bytes, nb, d, m, y, ldy, prefetch);
  }
  switch (rows) {
    case 1: return dot_rows<kType, 1, kCols>(x, w, row_bytes, nb, d, m, y, ldy, prefetch);
    case 2: return dot_rows<kType, 2, kCols>(x, w, row_bytes, nb, d, m, y, ldy, prefetch);
    case 3: return dot_rows<kType, 3, kCols>(x, w, row_bytes, nb, d, m, y, ldy, prefetch);
    case 4: return dot_rows<kType, 4, kCols>(x, w, row_bytes, nb, d, m, y, ldy, prefetch);
    case 5: return dot_rows<kType, 5, kCols>(x, w, row_bytes, nb, d, m, y, ldy, prefetch);
    case 6: return dot_rows<kType, 6, kCols>(x, w, row_bytes, nb, d, m, y, ldy, prefetch);
    case 7: return dot_rows<kType, 7, kCols>(x, w, row_bytes, nb, d, m, y, ldy, prefetch);
    default: return dot_rows<kType, 8, kCols>(x, w, row_bytes, nb, d, m, y, ldy, prefetch);
  }
}

// x [M, K]'s rows as the direct kernel reads them: in tiles of kRowTile rows, each packed
// [nb, rows, 32] (see dot_rows); tile t starts at packed + t * kRowTile * K.
inline void pack_row_tiles(const float* x, int64_t M, int64_t K, float* packed) {
  const int64_t nb = K / kBlock;
  for (int64_t r0 = 0; r0 < M; r0 += kRowTile) {
    const int64_t rows = std::min<int64_t>(kRowTile, M - r0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < nb; ++b)
        std::memcpy(packed + r0 * K + (b * rows + r) * kBlock, x + (r0 + r) * K + b * kBlock,
                    kBlock * sizeof(float));
  }
}

// The direct kernel's weight rows [begin, end) of y [M, N] = x [M, K] W^T, x packed by
// pack_row_tiles (64-byte aligned).
template <int64_t kType>
void direct_rows(const float* x, int64_t M, int64_t K, const uint8_t* qw, int64_t N, float* y,
                 int64_t begin, int64_t end, const PrefetchWindow& prefetch) {
  const int64_t nb = K / kBlock, row_bytes = row_bytes_of(kType, K);
  // scales of kScaleRows weight rows at a time: whole 16-wide gathers even for short rows
  constexpr int64_t kScaleRows = 16;
  std::vector<float> scales(2 * (kScaleRows * nb + 16));
  float* d = scales.data();
  float* m = d + kScaleRows * nb + 16;
  for (int64_t n0 = begin; n0 < end; n0 += kScaleRows) {
    const int64_t count = std::min(kScaleRows, end - n0);
    block_scales<kType>(qw + n0 * row_bytes, count * nb, d, m);
    // x tile outside, weight rows (in pairs) inside: the x tile (kRowTile * K * 4 bytes) and
    // the group's weight bytes stay in cache while every pair of rows meets every tile
    for (int64_t r0 = 0; r0 < M; r0 += kRowTile) {
      const int rows = static_cast<int>(std::min<int64_t>(kRowTile, M - r0));
      // 4 weight rows a call for 1-2 rows of x (their accumulators fit in registers), else 2
      const int64_t cols = rows <= 2 ? 4 : 2;
      for (int64_t i = 0; i < count;) {
        const uint8_t* w = qw + (n0 + i) * row_bytes;
        const float* xr = x + r0 * K;
        float* yr = y + r0 * N + n0 + i;
        const int64_t left = count - i;
        if (cols == 4 && left >= 4) {
          dot_rows_dispatch<kType, 4>(rows, xr, w, row_bytes, nb, d + i * nb, m + i * nb, yr, N,
                                      prefetch);
          i += 4;
        } else if (left >= 2) {
          dot_rows_dispatch<kType, 2>(rows, xr, w, row_bytes, nb, d + i * nb, m + i * nb, yr, N,
                                      prefetch);
          i += 2;
        } else {
          dot_rows_dispatch<kType, 1>(rows, xr, w, row_bytes, nb, d + i * nb, m + i * nb, yr, N,
                                      prefetch);
          i += 1;
        }
      }
    }
  }
}

// Direct kernel for few rows of x: y [M, N] = x [M, K] W^T, parallel over weight rows.
template <int64_t kType>
void direct_linear(const float* x, int64_t M, int64_t K, const uint8_t* qw, int64_t N, float* y) {
  const int64_t nb = K / kBlock, row_bytes = row_bytes_of(kType, K);
  // x packed, 64-byte aligned; one aligned row is already in that layout
  std::vector<float> buffer;
  if (M > 1 || reinterpret_cast<uintptr_t>(x) % 64 != 0) {
    buffer.resize(M * K + 16);
    float* packed = align64(buffer.data());
    pack_row_tiles(x, M, K, packed);
    x = packed;
  }
  // one contiguous run of weight rows per thread; tiny problems stay on this thread
  for_weight_rows(qw, row_bytes, N, nb * M * N, M == 1,
                  [&](int64_t begin, int64_t end, const PrefetchWindow& prefetch) {
                    direct_rows<kType>(x, M, K, qw, N, y, begin, end, prefetch);
                  });
}

// dot(w, x row r) for kRows rows of x (ldx apart) into y[r * ldy], K a multiple of 64; with few
// rows, several accumulators a row (FMA latency).
template <int kRows>
inline void fp32_dots(const float* w, const float* x, int64_t ldx, int64_t K, float* y,
                      int64_t ldy) {
#if defined(__AVX512F__)
  constexpr int kChains = kRows == 1 ? 4 : kRows == 2 ? 2 : 1;
  __m512 acc[kRows][kChains];
  for (int r = 0; r < kRows; ++r)
    for (int h = 0; h < kChains; ++h) acc[r][h] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16 * kChains)
#pragma GCC unroll 4
    for (int h = 0; h < kChains; ++h) {
      const __m512 wv = _mm512_load_ps(w + k + 16 * h);
      for (int r = 0; r < kRows; ++r)
        acc[r][h] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + r * ldx + k + 16 * h), acc[r][h]);
    }
  for (int r = 0; r < kRows; ++r) {
    for (int h = 1; h < kChains; ++h) acc[r][0] = _mm512_add_ps(acc[r][0], acc[r][h]);
    y[r * ldy] = _mm512_reduce_add_ps(acc[r][0]);
  }
#else
  for (int r = 0; r < kRows; ++r) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t k = 0; k < K; ++k) s += w[k] * x[r * ldx + k];
    y[r * ldy] = s;
  }
#endif
}

// Few rows of x for a type computed as code blocks (gguf_code_blocks.h), whatever the type: the
// weight rows [begin, end) decoded one at a time (dequantize_row) into the thread's scratch,
// where each stays in L1 / L2 while it meets every row of x, 4 at a time.
template <int64_t kType>
void code_block_rows(const float* x, int64_t M, int64_t K, const uint8_t* qw, int64_t N, float* y,
                     int64_t begin, int64_t end, const PrefetchWindow& prefetch) {
  const int64_t nb = K / kBlock, row_bytes = row_bytes_of(kType, K);
  float* w = thread_scratch<kDecodedWeightSlot>(K);
  for (int64_t n = begin; n < end; ++n) {
    prefetch_ahead(prefetch, qw + begin * row_bytes, 1, (n - begin) * row_bytes, row_bytes);
    dequantize_row<kType>(qw + n * row_bytes, nb, w, nullptr, nullptr);
    int64_t r = 0;
    for (; r + 4 <= M; r += 4) fp32_dots<4>(w, x + r * K, K, K, y + r * N + n, N);
    switch (M - r) {
      case 3: fp32_dots<3>(w, x + r * K, K, K, y + r * N + n, N); break;
      case 2: fp32_dots<2>(w, x + r * K, K, K, y + r * N + n, N); break;
      case 1: fp32_dots<1>(w, x + r * K, K, K, y + r * N + n, N); break;
      default: break;
    }
  }
}

template <int64_t kType>
void code_block_linear(const float* x, int64_t M, int64_t K, const uint8_t* qw, int64_t N,
                       float* y) {
  const int64_t nb = K / kBlock, row_bytes = row_bytes_of(kType, K);
  for_weight_rows(qw, row_bytes, N, nb * M * N, M == 1,
                  [&](int64_t begin, int64_t end, const PrefetchWindow& prefetch) {
                    code_block_rows<kType>(x, M, K, qw, N, y, begin, end, prefetch);
                  });
}

// fp32_linear_grouped for one type: each group's rows of x packed for the direct kernel (as
// direct_linear packs them), then every group's weight rows split among the threads together.
template <int64_t kType>
void fp32_linear_grouped_typed(const float* x, const int64_t* starts, int64_t groups, int64_t K,
                               const uint8_t* const* weights, int64_t N, float* y) {
  const int64_t M = starts[groups], nb = K / kBlock;
  std::vector<float> buffer;
  if constexpr (!is_code_block_type(kType)) {
    // the groups' packed rows at the same offsets as x's (K * 4 bytes is a multiple of 64):
    // one row a group, 64-byte aligned, is already in that layout
    bool pack = reinterpret_cast<uintptr_t>(x) % 64 != 0;
    for (int64_t g = 0; g < groups && !pack; ++g) pack = starts[g + 1] - starts[g] > 1;
    if (pack) {
      buffer.resize(M * K + 16);
      float* packed = align64(buffer.data());
      for (int64_t g = 0; g < groups; ++g)
        pack_row_tiles(x + starts[g] * K, starts[g + 1] - starts[g], K, packed + starts[g] * K);
      x = packed;
    }
  }
  for_grouped_weight_rows(
      weights, row_bytes_of(kType, K), groups, N, nb * M * N,
      [&](int64_t g) { return starts[g + 1] - starts[g] == 1; },
      [&](int64_t g, int64_t n0, int64_t n1, const PrefetchWindow& window) {
        const int64_t r0 = starts[g], m = starts[g + 1] - r0;
        if (m == 0) return;
        if constexpr (is_code_block_type(kType))
          code_block_rows<kType>(x + r0 * K, m, K, weights[g], N, y + r0 * N, n0, n1, window);
        else
          direct_rows<kType>(x + r0 * K, m, K, weights[g], N, y + r0 * N, n0, n1, window);
      });
}

// Many rows of x: the weight decoded into fp32 a chunk of rows at a time (all threads), each
// chunk multiplied by one BLAS GEMM over all threads. At M = 2048 this ran 2-8% faster than
// per-thread L2-sized tiles through single-threaded GEMMs (interleaved A/B, SmolLM2's shapes);
// the decoding costs a few % of the GEMM there.
template <int64_t kType>
void dequantized_linear(const at::Tensor& x, const uint8_t* qw, int64_t N, at::Tensor& y) {
  constexpr int64_t bb = block_bytes(kType);
  const int64_t K = x.size(1), nb = K / kBlock, row_bytes = row_bytes_of(kType, K);
  const int64_t chunk = std::max<int64_t>(1, std::min(N, kChunkMaxBytes / (4 * K)));
  float* w = thread_scratch<kDecodedWeightSlot>(chunk * K);
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    const int64_t count = std::min(chunk, N - n0);
    at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> scales(2 * (nb + 16));
      for (int64_t i = begin; i < end; ++i)
        dequantize_row<kType>(qw + (n0 + i) * row_bytes, nb, w + i * K, scales.data(),
                              scales.data() + nb + 16);
    });
    at::Tensor out = y.narrow(1, n0, count);
    at::mm_out(out, x, at::from_blob(w, {count, K}, x.options()).t());
  }
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& qweight, int64_t ggml_type,
                       int64_t out_features, int64_t activations) {
  TORCH_CHECK(x.device().is_cpu() && qweight.device().is_cpu(),
              "gguf_linear: x and qweight must be CPU tensors, got ", x.device(), " and ",
              qweight.device());
  TORCH_CHECK(x.scalar_type() == at::kFloat, "gguf_linear: x must be float32, got ",
              x.scalar_type());
  TORCH_CHECK(x.dim() == 2, "gguf_linear: x must be 2-D [M, K], got ", x.dim(), " dims");
  TORCH_CHECK(qweight.scalar_type() == at::kByte, "gguf_linear: qweight must be uint8, got ",
              qweight.scalar_type());
  TORCH_CHECK(supported_type(ggml_type), "gguf_linear: unsupported ggml_type ", ggml_type,
              " (supported: ", kGgufTypeNames, ")");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(K % row_granule(ggml_type) == 0, "gguf_linear: in_features K=", K,
              " is not a multiple of the block size ", row_granule(ggml_type));
  TORCH_CHECK(N >= 0, "gguf_linear: out_features must be >= 0, got ", N);
  const int64_t row_bytes = row_bytes_of(ggml_type, K);
  TORCH_CHECK(qweight.dim() == 2 && qweight.size(0) == N && qweight.size(1) == row_bytes,
              "gguf_linear: qweight shape ", qweight.sizes(), " does not match out_features=", N,
              " and K=", K, ": expected [", N, ", ", row_bytes, "] (", row_bytes,
              " bytes of blocks a row)");
  TORCH_CHECK(qweight.is_contiguous(), "gguf_linear: qweight must be contiguous");

  TORCH_CHECK(activations >= kFp32Activations && activations <= kQ8Scalar,
              "gguf_linear: activations must be 0 (fp32) to ", int64_t{kQ8Scalar}, ", got ",
              activations);

  if (is_x8_type(ggml_type)) check_x8_weight("gguf_linear", ggml_type, N, activations);

  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return y;
  const uint8_t* qw = qweight.data_ptr<uint8_t>();
  if (is_x8_type(ggml_type)) {
    const float* xp = xc.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const bool done = M < int8_gemm_min_rows(ggml_type) ? x8_linear(ggml_type, xp, M, K, qw, N, yp)
                                         : q8_gemm(ggml_type, xp, M, K, qw, N, yp);
    TORCH_CHECK(done, "gguf_linear: this build has no kernels for x8 weights of ggml_type ",
                ggml_type, " (see x8_source_types())");
    return y;
  }
  // int8 activations where asked for (fp32 weights stay fp32): the few-rows kernels below
  // kQ8GemmMinRows rows, the int8 GEMM from there where the build has it, else the few-rows
  // kernels up to kDirectMaxRows and fp32 above (AVX-512's panel GEMM); a build without
  // AVX-512 keeps the few-rows kernels at every M. A path forced past the GEMM's (3-5) runs the
  // few-rows kernels at every M, as a reference for tests.
  if (activations != kFp32Activations && !is_float_type(ggml_type)) {
    const bool few_rows = M < kQ8GemmMinRows || activations > kQ8Avx512Vnni;
    if (!few_rows && q8_gemm(ggml_type, xc.data_ptr<float>(), M, K, qw, N, y.data_ptr<float>()))
      return y;
    if (few_rows || M <= kDirectMaxRows || !kFp32PanelBuilt) {
      q8_linear(ggml_type, activations, xc.data_ptr<float>(), M, K, qw, N, y.data_ptr<float>());
      return y;
    }
  }
  auto run = [&](auto type_constant) {
    constexpr int64_t kType = decltype(type_constant)::value;
    if (M <= kDirectMaxRows) {
      if constexpr (is_code_block_type(kType))
        code_block_linear<kType>(xc.data_ptr<float>(), M, K, qw, N, y.data_ptr<float>());
      else
        direct_linear<kType>(xc.data_ptr<float>(), M, K, qw, N, y.data_ptr<float>());
    } else {
#if defined(__AVX512F__)
      if (M <= panel_max_rows())
        panel_linear<kType>(xc.data_ptr<float>(), M, K, qw, N, y.data_ptr<float>());
      else
#endif
        dequantized_linear<kType>(xc, qw, N, y);
    }
  };
  dispatch_gguf_type<kFp32Kernels>(ggml_type, run, [&] {
    TORCH_CHECK(false, "gguf_linear: no fp32 kernels for ggml_type ", ggml_type);
  });
  return y;
}

}  // namespace

namespace hybridllm_gguf {

void fp32_linear_grouped(int64_t type, const float* x, const int64_t* starts, int64_t groups,
                         int64_t K, const uint8_t* const* weights, int64_t N, float* y) {
  dispatch_gguf_type<kFp32Kernels>(
      type,
      [&](auto t) {
        fp32_linear_grouped_typed<decltype(t)::value>(x, starts, groups, K, weights, N, y);
      },
      [&] { TORCH_CHECK(false, "gguf_linear: no fp32 kernels for ggml_type ", type); });
}

}  // namespace hybridllm_gguf

TORCH_LIBRARY_IMPL(hybridllm, CPU, m) {
  m.impl("gguf_linear", &gguf_linear);
}

// The ops without a tensor argument (schemas in torch_bindings.cpp), for every dispatch key.
TORCH_LIBRARY_IMPL(hybridllm, CompositeImplicitAutograd, m) {
  m.impl("gguf_int8_paths", [] { return q8_paths(); });
  m.impl("blas_has_avx512_kernels", [] {
#if defined(__AVX512F__)
    return blas_has_avx512_kernels();
#else
    return true;  // no AVX-512 kernels of our own to prefer
#endif
  });
}
