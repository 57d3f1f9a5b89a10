// IQ2_XXS and IQ3_XXS weights in x8 groups (gguf_x8.h's IQ2_XXSX8, IQ3_XXSX8): the repacking
// (every build), and on AVX2 builds without AVX-512 the kernels at few rows of x and the
// unpacking for the int8 GEMM.
//
// Both types pack a group of 8 weights' signs as a 7-bit index whose parity is the eighth sign,
// beside 4-bit scales in the same word: the IQ2_XXS row kernel spent about 30 of its 69 cycles a
// row's super-block (a Zen 3 core, L3) unpacking and spreading signs. The x8 layouts store each
// row's 256 signs as bit planes, bit z of byte i the sign of weight 32 z + i, so that a 16-bit
// shift puts the signs of weights 32 z .. 32 z + 31 in their bytes' top bits, where vpsignb reads
// them; the grid indices stay bytes and the scales become nibbles. IQ2_XXS: 70 bytes a row's
// super-block against 66, and 38 cycles against 69 (a standalone harness, one core, bit-exact
// sums).
#include <cstring>

#include "gguf_blocks.h"
#include "gguf_iq_blocks.h"
#include "gguf_q8_quantize.h"
#include "gguf_x8.h"

namespace hybridllm_gguf {
namespace {

// A grid type's source layout and its x8 group layout (gguf_x8.h): row r's 4 scale bytes at
// kScales + 4 r, its kIndices grid indices at kIndex + kIndices r, its 32 sign-plane bytes at
// kSigns + 32 r.
template <int64_t kType>
struct GridX8 {
  static_assert(kType == kIQ2_XXS || kType == kIQ3_XXS);
  static constexpr bool kIq2 = kType == kIQ2_XXS;
  static constexpr int kIndices = kIq2 ? 32 : 64;  // grid entries a super-block: 8 or 4 weights
  static constexpr int64_t kScales = 16, kIndex = 48, kSigns = kIndex + 8 * kIndices;
  // IQ2_XXS's d * (0.5 + s) / 4 = d / 8 * (2 s + 1); IQ3_XXS's d * (0.5 + s) / 2 = d / 4 * (...)
  static constexpr float kUnitD = kIq2 ? 0.125f : 0.25f;
  // Where a source super-block holds grid index e (0 .. kIndices - 1), and the aux word of its
  // 32 weights j: four 7-bit sign indices (groups of 8 weights), the 4-bit scale in bits 28-31.
  static int64_t index_offset(int e) { return kIq2 ? 2 + 8 * (e / 4) + e % 4 : 2 + e; }
  static int64_t aux_offset(int j) { return kIq2 ? 2 + 8 * j + 4 : 66 + 4 * j; }
};
static_assert(kGroupBytes<kIQ2_XXS> == 8 * 70 && GridX8<kIQ2_XXS>::kSigns + 8 * 32 == 8 * 70);
static_assert(kGroupBytes<kIQ3_XXS> == 8 * 102 && GridX8<kIQ3_XXS>::kSigns + 8 * 32 == 8 * 102);

template <int64_t kType>
void repack_group(const uint8_t* rows, int64_t nsb, uint8_t* out) {
  using L = GridX8<kType>;
  for (int64_t s = 0; s < nsb; ++s) {
    uint8_t* o = out + s * kGroupBytes<kType>;
    std::memset(o, 0, kGroupBytes<kType>);  // scales and signs are or-ed in
    for (int r = 0; r < 8; ++r) {
      const uint8_t* q = rows + (r * nsb + s) * kSourceBytes<kType>;
      std::memcpy(o + 2 * r, q, 2);  // d
      for (int e = 0; e < L::kIndices; ++e)
        o[L::kIndex + L::kIndices * r + e] = q[L::index_offset(e)];
      for (int j = 0; j < 8; ++j) {
        uint32_t aux;
        std::memcpy(&aux, q + L::aux_offset(j), sizeof(aux));
        o[L::kScales + 4 * r + j / 2] |= static_cast<uint8_t>((aux >> 28) << (4 * (j % 2)));
        for (int i = 0; i < 4; ++i) {
          const uint8_t signs = kIQSigns[(aux >> (7 * i)) & 127];  // weight k's at bit k
          for (int k = 0; k < 8; ++k)
            if ((signs >> k) & 1) o[L::kSigns + 32 * r + 8 * i + k] |= static_cast<uint8_t>(1 << j);
        }
      }
    }
  }
}

template <int64_t kType>
void unpack_group(const uint8_t* group, int64_t nsb, uint8_t* rows) {
  using L = GridX8<kType>;
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* o = group + s * kGroupBytes<kType>;
    for (int r = 0; r < 8; ++r) {
      uint8_t* q = rows + (r * nsb + s) * kSourceBytes<kType>;
      std::memcpy(q, o + 2 * r, 2);
      for (int e = 0; e < L::kIndices; ++e)
        q[L::index_offset(e)] = o[L::kIndex + L::kIndices * r + e];
      for (int j = 0; j < 8; ++j) {
        uint32_t aux = static_cast<uint32_t>((o[L::kScales + 4 * r + j / 2] >> (4 * (j % 2))) & 15)
                       << 28;
        for (int i = 0; i < 4; ++i) {
          uint32_t index = 0;  // the sign byte's low 7 bits; the eighth is their parity
          for (int k = 0; k < 7; ++k)
            index |= static_cast<uint32_t>((o[L::kSigns + 32 * r + 8 * i + k] >> j) & 1) << k;
          aux |= index << (7 * i);
        }
        std::memcpy(q + L::aux_offset(j), &aux, sizeof(aux));
      }
    }
  }
}

}  // namespace

void grid_x8_convert(int64_t source_type, const uint8_t* src, int64_t nsb, uint8_t* dst,
                     bool repack) {
  dispatch_grid_x8(source_type, [&](auto type) {
    constexpr int64_t kType = decltype(type)::value;
    if (repack)
      repack_group<kType>(src, nsb, dst);
    else
      unpack_group<kType>(src, nsb, dst);
  });
}

#if defined(HYBRIDLLM_X8_AVX2)
namespace {

// Row r's 8 scales 2 s + 1 (one a 32 weights) as int16 words 0-7 of both 128-bit lanes.
template <int64_t kType>
inline __m256i row_scales(const uint8_t* o, int r) {
  uint32_t nibbles;
  std::memcpy(&nibbles, o + GridX8<kType>::kScales + 4 * r, sizeof(nibbles));
  const __m128i bytes = _mm_cvtepu8_epi16(_mm_cvtsi32_si128(static_cast<int>(nibbles)));
  // words [s0 s2 s4 s6] and [s1 s3 s5 s7], interleaved
  const __m128i s = _mm_unpacklo_epi16(_mm_and_si128(bytes, _mm_set1_epi16(15)),
                                       _mm_srli_epi16(bytes, 4));
  return _mm256_broadcastsi128_si256(_mm_add_epi16(_mm_add_epi16(s, s), _mm_set1_epi16(1)));
}

// Row r's grid values of weights 32 j .. 32 j + 31 (unsigned bytes): 4 IQ2_XXS entries of 8, or
// 8 IQ3_XXS entries of 4.
template <int64_t kType>
inline __m256i grid_values(const uint8_t* o, int r, int j) {
  using L = GridX8<kType>;
  const uint8_t* index = o + L::kIndex + L::kIndices * r + (L::kIndices / 8) * j;
  if constexpr (L::kIq2) {
    return iq::table_entries4(kIQ2XXSGrid, index[0], index[1], index[2], index[3]);
  } else {
    const auto quad = [&](int k) {
      return _mm_setr_epi32(static_cast<int>(kIQ3XXSGrid[index[k]]),
                            static_cast<int>(kIQ3XXSGrid[index[k + 1]]),
                            static_cast<int>(kIQ3XXSGrid[index[k + 2]]),
                            static_cast<int>(kIQ3XXSGrid[index[k + 3]]));
    };
    return _mm256_inserti128_si256(_mm256_castsi128_si256(quad(0)), quad(4), 1);
  }
}

// The 8 rows' int32 sums (v[r]: 8 partial sums of row r) as one vector, lane r row r's total.
inline __m256i row_totals(const __m256i v[8]) {
  const __m256i a0 = _mm256_hadd_epi32(v[0], v[1]), a1 = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i a2 = _mm256_hadd_epi32(v[4], v[5]), a3 = _mm256_hadd_epi32(v[6], v[7]);
  const __m256i b0 = _mm256_hadd_epi32(a0, a1), b1 = _mm256_hadd_epi32(a2, a3);
  // b0: rows 0-3's sums over lanes 0-3 in its low half, over lanes 4-7 in its high half
  return _mm256_add_epi32(_mm256_permute2x128_si256(b0, b1, 0x20),
                          _mm256_permute2x128_si256(b0, b1, 0x31));
}

// y[r * ldy + i] = dot(x row r, weight row i of the group at wg) for the kRows rows of x;
// `first`: the tile that reads the group from memory, which prefetches ahead.
template <int64_t kType, int kRows>
void group_tile(const Q8Rows& xq, int64_t nsb, const uint8_t* wg, float* y, int64_t ldy,
                bool first, const PrefetchWindow& prefetch) {
  using L = GridX8<kType>;
  constexpr int64_t kBytes = kGroupBytes<kType>;
  const __m256i one = _mm256_set1_epi8(1);
  __m256 acc[kRows];
  for (int x = 0; x < kRows; ++x) acc[x] = _mm256_setzero_ps();
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* o = wg + s * kBytes;
    if (first) prefetch_ahead(prefetch, o, 1, 0, kBytes);
    __m256i sums[kRows][8];  // [row of x][weight row]: 8 partial sums
    for (int r = 0; r < 8; ++r) {
      const __m256i planes =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + L::kSigns + 32 * r));
      const __m256i scales = row_scales<kType>(o, r);
      __m256i sum[kRows];
      for (int x = 0; x < kRows; ++x) sum[x] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {  // weights 32 j .. 32 j + 31
        const __m256i values = grid_values<kType>(o, r, j);
        // plane j's bits to the bytes' top bits: -1 where the weight is negative, else 1
        const __m256i signs = _mm256_or_si256(_mm256_slli_epi16(planes, 7 - j), one);
        // scale j in every word
        const __m256i scale = _mm256_shuffle_epi8(
            scales, _mm256_set1_epi16(static_cast<int16_t>(0x0100 + 0x0202 * j)));
        for (int x = 0; x < kRows; ++x) {
          const __m256i xv = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(xq.q + x * xq.q_stride + 256 * s + 32 * j));
          // values <= 62: a pair sum <= 2 * 62 * 127
          const __m256i pairs = _mm256_maddubs_epi16(values, _mm256_sign_epi8(xv, signs));
          sum[x] = _mm256_add_epi32(sum[x], _mm256_madd_epi16(pairs, scale));
        }
      }
      for (int x = 0; x < kRows; ++x) sums[x][r] = sum[x];
    }
    // d times the type's power of two, as the row kernels take it
    const __m256 d =
        _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o))),
                      _mm256_set1_ps(L::kUnitD));
    for (int x = 0; x < kRows; ++x)
      acc[x] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(row_totals(sums[x])),
                               _mm256_mul_ps(d, _mm256_set1_ps(xq.d[x * xq.g_stride + s])),
                               acc[x]);
  }
  for (int x = 0; x < kRows; ++x) _mm256_storeu_ps(y + x * ldy, acc[x]);
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

// The group's 8 rows as the AVX2 int8 GEMM unpacks the source type's rows
// (gguf_q8_gemm_avx2_cpu.cpp's unpack_row): the signed grid values as codes, d times the type's
// power of two times 2 s + 1 a unit of 16 weights.
template <int64_t kType>
void unpack_group_typed(const uint8_t* group, int64_t K, uint8_t* codes, int64_t code_stride,
                        float* scales, int64_t unit_stride) {
  using L = GridX8<kType>;
  for (int64_t s = 0; s < K / 256; ++s) {
    const uint8_t* o = group + s * kGroupBytes<kType>;
    for (int r = 0; r < 8; ++r) {
      const __m256i planes =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + L::kSigns + 32 * r));
      for (int j = 0; j < 8; ++j) {
        const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << j));
        const __m256i negative = _mm256_cmpeq_epi8(_mm256_and_si256(planes, bit), bit);
        const __m256i v = grid_values<kType>(o, r, j);
        _mm256_storeu_si256(
            reinterpret_cast<__m256i*>(codes + r * code_stride + 256 * s + 32 * j),
            _mm256_sub_epi8(_mm256_xor_si256(v, negative), negative));
      }
      const float d = half_to_float(load_u16(o + 2 * r)) * L::kUnitD;
      float* row_scales = scales + r * unit_stride + 16 * s;
      for (int j = 0; j < 8; ++j) {
        const int sc = (o[L::kScales + 4 * r + j / 2] >> (4 * (j % 2))) & 15;
        row_scales[2 * j] = row_scales[2 * j + 1] = d * static_cast<float>(2 * sc + 1);
      }
    }
  }
}

}  // namespace

void grid_x8_linear_grouped(int64_t source_type, const float* x, const int64_t* starts,
                            int64_t groups, int64_t K, const uint8_t* const* weights, int64_t N,
                            float* y) {
  dispatch_grid_x8(source_type, [&](auto type) {
    linear_grouped_typed<decltype(type)::value>(x, starts, groups, K, weights, N, y);
  });
}

void grid_x8_unpack_group(int64_t source_type, const uint8_t* group, int64_t K, uint8_t* codes,
                          int64_t code_stride, float* scales, int64_t unit_stride) {
  dispatch_grid_x8(source_type, [&](auto type) {
    unpack_group_typed<decltype(type)::value>(group, K, codes, code_stride, scales, unit_stride);
  });
}
#endif

}  // namespace hybridllm_gguf
