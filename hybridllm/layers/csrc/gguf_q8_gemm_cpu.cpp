// hybridllm::gguf_linear's int8-activation path for many rows of x (prefill, large batches,
// big expert groups), AVX512-VNNI: a GEMM with the rows of x quantized as the few-rows path
// does (gguf_q8_quantize.h) and packed in tiles of 16 or 32 rows, the weight rows unpacked a
// panel at a time into unsigned codes and fp32 scales, and a micro-kernel whose vpdpbusd
// multiplies 4 codes of one weight row (broadcast) with 4 values of each of 16 rows of x (a
// vector).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <vector>

#include "gguf_blocks.h"
#include "gguf_x8.h"
#include "gguf_q8_dot.h"
#include "gguf_q8_linear.h"
#include "gguf_q8_quantize.h"
#include "gguf_q8_simd.h"
#include "vec_avx512.h"

namespace hybridllm_gguf {

#if defined(HYBRIDLLM_Q8_AVX512)
namespace {

using hybridllm_avx512::in_register;
using hybridllm_avx512::transpose16;

// Rows of x a tile: kH 16-lane vectors (2, or 1 for up to 16 rows, which would waste half of a
// 32-row tile).
template <int kH>
constexpr int64_t kTileRows = 16 * kH;
// Bytes of unpacked codes a panel holds: with a tile of x (32 * K bytes) it stays in L2 while
// every tile of x passes over it.
constexpr int64_t kPanelCodeBytes = 128 << 10;

// A weight type as the GEMM sees it: weight = scale * (code - kOffset) + min, with codes
// unsigned bytes, one scale (and min) per kUnit weights, and x quantized in groups of kGroup.
// Q4_1's and Q5_1's mins are floats (kFloatMins); a K-quant's (kCodeMins) are 6-bit codes times
// its super-block's -dmin, so their products with x's unit sums add up in integers, a
// super-block at a time: 4 vpdpwssd where float mins took 8 FMAs. Code-block types: their signed
// codes + 128, d * scale a unit, and their integer mins (if any) times dmin as the K-quants' are.
// Q2_K and Q3_K (kScaledCodes): each code already times its 16-weight unit's integer scale
// (store_scaled_codes below), so the float scale is one a super-block (kUnit 256) and Q2_K's
// integer mins keep units of their own (kMinUnit 16); Q3_K's products are 128 - scale * q.
template <int64_t kType>
struct GemmType {
  static constexpr bool kCodeBlocks = is_code_block_type(kType);
  static constexpr bool kScaledCodes = kType == kQ2_K || kType == kQ3_K;
  static constexpr int64_t kUnit = kScaledCodes                       ? 256
                                   : kType == kQ6_K || kCodeBlocks ? 16
                                                                   : 32;
  static constexpr int64_t kGroup = q8_group(kType);
  static constexpr bool kCodeMins = kType == kQ4_K || kType == kQ5_K || code_block_mins<kType>();
  static constexpr int64_t kMinUnit = kScaledCodes ? 16 : kUnit;  // weights an integer min
  static constexpr bool kFloatMins = has_block_min(kType);
  // Q8_0's, IQ4_NL's, MXFP4's and the code blocks' signed weights as unsigned codes w + 128
  // (Q2_K's scaled codes are unsigned as they are)
  static constexpr int32_t kOffset =
      kType == kQ4_0                                                  ? 8
      : kType == kQ5_0                                                ? 16
      : kType == kQ2_K                                                ? 0
      : kType == kQ8_0 || is_table_nibble_type(kType) || kCodeBlocks ? 128
      : kType == kQ6_K                                                ? 32
                                                                      : 0;
};

// Weight rows a micro-kernel call, so that its accumulators stay in registers: with groups of
// many units (K-quants) 12 / kH, each with its integer sums and its group's sums (the totals
// live in the output tile); else 8 / kH, with integer sums, the totals and the temporaries of
// the unit's scale, min and x scale.
template <int64_t kType, int kH>
constexpr int kCols =
    (GemmType<kType>::kGroup > GemmType<kType>::kUnit || GemmType<kType>::kScaledCodes ? 12 : 8) /
    kH;

// Rows of x in tiles of R = kTileRows rows: tile t's int8 values [K / 4][R][4] (4 consecutive
// values of each row a 32-bit lane, rows past M zero), its scales [K / kGroup][R] and, per unit
// of weights, what the weights' offset or min multiplies: in `unit`, [K / kUnit][R] of int32
// -kOffset * sum(q) (kOffset) or float sum(q) (Q4_1, Q5_1) (tile t's at t * K / kUnit * R
// 32-bit words), and (kCodeMins) in `pairs`, [K / kMinUnit / 2][R] of the int16 pairs (sum(q) of
// min unit 2i, of min unit 2i + 1) (tile t's at t * K / kMinUnit / 2 * R).
struct PackedX {
  const int8_t* q;
  const float* d;
  const void* unit;
  const int32_t* pairs;
  int64_t tiles;
};

// Sum of the 32 int8 values at q (|sum| <= 32 * 127).
inline int32_t sum32(const int8_t* q) {
  const __m256i u = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)),
                                     _mm256_set1_epi8(static_cast<char>(0x80)));
  const __m256i sad = _mm256_sad_epu8(u, _mm256_setzero_si256());  // 4 sums of 8 values + 128
  const __m128i two = _mm_add_epi64(_mm256_castsi256_si128(sad), _mm256_extracti128_si256(sad, 1));
  return static_cast<int32_t>(_mm_cvtsi128_si64(two) + _mm_extract_epi64(two, 1)) - 32 * 128;
}

// Sum of q over unit u of kUnit values: from the 16-value sums a 256-value group's quantization
// keeps (bsums: K-quants, the only types with units other than 32), else added up.
template <int64_t kUnit>
inline int32_t unit_sum(const Q8Rows& row, int64_t u) {
  static_assert(kUnit % 16 == 0 && kUnit <= 256);
  if (kUnit == 32 && row.bsums == nullptr) return sum32(row.q + 32 * u);
  int32_t sum = 0;
  for (int64_t j = 0; j < kUnit / 16; ++j) sum += row.bsums[kUnit / 16 * u + j];
  return sum;
}

template <int64_t kType, int kH>
PackedX pack_x(const Q8Rows& rows, int64_t M, int64_t K, std::vector<uint8_t>& buffer) {
  using T = GemmType<kType>;
  constexpr int64_t kTileRows = hybridllm_gguf::kTileRows<kH>;
  const int64_t tiles = (M + kTileRows - 1) / kTileRows;
  const int64_t groups = K / T::kGroup, units = K / T::kUnit;
  const int64_t pairs_a_row = T::kCodeMins ? K / T::kMinUnit / 2 : 0;
  const int64_t q_bytes = tiles * K * kTileRows, d_bytes = tiles * groups * kTileRows * 4;
  const int64_t unit_bytes = tiles * units * kTileRows * 4;
  buffer.resize(q_bytes + d_bytes + unit_bytes + tiles * pairs_a_row * kTileRows * 4 + 64);
  uint8_t* base = buffer.data() + (64 - reinterpret_cast<uintptr_t>(buffer.data()) % 64) % 64;
  int8_t* q = reinterpret_cast<int8_t*>(base);
  float* d = reinterpret_cast<float*>(base + q_bytes);
  uint8_t* unit = base + q_bytes + d_bytes;
  uint8_t* pair_base = unit + unit_bytes;
  // one task a half tile: 16 rows of x, whose 4-value dwords a 16 x 16 transpose interleaves
  at::parallel_for(0, tiles * kH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / kH, i0 = 16 * (task % kH), r0 = t * kTileRows + i0;
      const int64_t live = std::clamp<int64_t>(M - r0, 0, 16);  // rows of x in this half
      int8_t* qt = q + t * K * kTileRows + 4 * i0;
      float* dt = d + t * groups * kTileRows + i0;
      int32_t* ut = reinterpret_cast<int32_t*>(unit) + t * units * kTileRows + i0;
      int32_t* pt = reinterpret_cast<int32_t*>(pair_base) + t * pairs_a_row * kTileRows + i0;
      const int8_t* src[16];
      for (int i = 0; i < 16; ++i) src[i] = i < live ? rows.row(r0 + i).q : nullptr;
      int64_t k = 0;
      for (; k + 64 <= K; k += 64) {  // 16 dwords of 16 rows: element (row i, dword j)
        __m512 r[16];
        for (int i = 0; i < 16; ++i)
          r[i] = src[i] ? _mm512_loadu_ps(reinterpret_cast<const float*>(src[i] + k))
                        : _mm512_setzero_ps();
        transpose16(r);  // r[j] lane i: row i's dword j
        for (int j = 0; j < 16; ++j)
          _mm512_store_ps(reinterpret_cast<float*>(qt + (k + 4 * j) * kTileRows), r[j]);
      }
      for (; k < K; k += 4)
        for (int i = 0; i < 16; ++i) {
          int8_t* out = qt + k * kTileRows + 4 * i;
          if (src[i])
            std::memcpy(out, src[i] + k, 4);
          else
            std::memset(out, 0, 4);
        }
      for (int i = 0; i < 16; ++i) {
        if (!src[i]) {
          for (int64_t g = 0; g < groups; ++g) dt[g * kTileRows + i] = 0.f;
          for (int64_t u = 0; u < units; ++u) ut[u * kTileRows + i] = 0;
          for (int64_t p = 0; p < pairs_a_row; ++p) pt[p * kTileRows + i] = 0;
          continue;
        }
        const Q8Rows row = rows.row(r0 + i);
        for (int64_t g = 0; g < groups; ++g) dt[g * kTileRows + i] = row.d[g];
        if constexpr (T::kCodeMins) {  // |sum| <= 32 * 127: an int16
          int16_t* pairs = reinterpret_cast<int16_t*>(pt);
          for (int64_t u = 0; u < 2 * pairs_a_row; ++u)
            pairs[2 * ((u / 2) * kTileRows + i) + u % 2] =
                static_cast<int16_t>(unit_sum<T::kMinUnit>(row, u));
        }
        if constexpr (T::kOffset == 0 && !T::kFloatMins) continue;
        for (int64_t u = 0; u < units; ++u) {
          const int32_t sum = unit_sum<T::kUnit>(row, u);
          if constexpr (T::kFloatMins) {
            const float f = static_cast<float>(sum);
            std::memcpy(ut + u * kTileRows + i, &f, 4);
          } else {
            ut[u * kTileRows + i] = -T::kOffset * sum;
          }
        }
      }
    }
  });
  return {q, d, unit, reinterpret_cast<const int32_t*>(pair_base), tiles};
}

// A Q2_K / Q3_K super-block's codes, as CodeBlockDecoder gives them, into super_codes as the
// scaled codes (gguf_x8.h's scaled_field).
template <int64_t kType>
inline void store_scaled_codes(const CodeBlock& cb, uint8_t* super_codes) {
  alignas(64) static constexpr int16_t kUnitOfWord[32] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1,
                                                          1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2,
                                                          2, 2, 3, 3, 3, 3, 3, 3, 3, 3};
  const __m512i unit_scales =
      _mm512_castsi256_si512(_mm256_load_si256(reinterpret_cast<const __m256i*>(cb.scales)));
  for (int z = 0; z < 4; ++z) {  // units 4 z .. 4 z + 3, 8 words each
    __m512i v = _mm512_load_si512(cb.codes + 64 * z);
    if constexpr (kType == kQ3_K) v = _mm512_add_epi8(v, _mm512_set1_epi8(4));
    const __m512i unit_of_word = _mm512_add_epi16(_mm512_load_si512(kUnitOfWord),
                                                  _mm512_set1_epi16(static_cast<int16_t>(4 * z)));
    const __m512i scale = _mm512_permutexvar_epi16(unit_of_word, unit_scales);
    _mm512_storeu_si512(super_codes + 64 * z, scaled_field<kType>(v, scale));
  }
}

// A panel of weight rows unpacked: codes [rows][K], and per unit of kUnit weights scales
// [rows][K / kUnit] and mins: Q4_1's and Q5_1's [rows][K / kUnit]; a K-quant's integer mins
// min_codes [rows][K / kMinUnit] and -dmin in mins [rows][super-blocks]. Rows `units` apart (at
// least K / kMinUnit); rows past N have zero codes and scales.
struct Panel {
  uint8_t* codes;
  float* scales;
  float* mins;
  int16_t* min_codes;
  int64_t units;  // a row's stride
};

template <int64_t kType>
void unpack_row(const uint8_t* row, int64_t K, uint8_t* codes, float* scales, float* mins,
                int16_t* min_codes) {
  using S = Avx512Vnni;
  const int64_t nb = K / kBlock;
  if constexpr (is_code_block_type(kType)) {
    // codes + 128; d * scale a unit (Q2_K, Q3_K: scaled codes and d or -d a super-block); the
    // integer mins as they are and dmin a super-block
    constexpr int64_t kSuper = gguf_type_info(kType).unit_bytes;
    CodeBlock cb;
    for (int64_t sb = 0; sb < K / kCodeBlockWeights; ++sb) {
      CodeBlockDecoder<kType>::decode(row + sb * kSuper, &cb);
      uint8_t* super_codes = codes + sb * kCodeBlockWeights;
      if constexpr (GemmType<kType>::kScaledCodes) {
        store_scaled_codes<kType>(cb, super_codes);
        scales[sb] = kType == kQ3_K ? -cb.d : cb.d;
      } else {
        for (int z = 0; z < 4; ++z)
          _mm512_storeu_si512(super_codes + 64 * z,
                              _mm512_xor_si512(_mm512_load_si512(cb.codes + 64 * z),
                                               _mm512_set1_epi8(static_cast<char>(0x80))));
        const __m256i unit_scales =
            _mm256_load_si256(reinterpret_cast<const __m256i*>(cb.scales));
        _mm512_storeu_ps(scales + 16 * sb,
                         _mm512_mul_ps(_mm512_set1_ps(cb.d),
                                       _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(unit_scales))));
      }
      if constexpr (GemmType<kType>::kCodeMins) {
        std::memcpy(min_codes + 16 * sb, cb.mins, sizeof(cb.mins));
        mins[sb] = cb.dmin;
      }
    }
  } else if constexpr (kType == kQ6_K) {
    for (int64_t sb = 0; sb < K / 256; ++sb) {
      const uint8_t* s = row + sb * kQ6SuperBytes;
      // codes are q + 32, in order: 64 at a time (half z / 2, part z % 2, as gguf_q8_dot.h)
      for (int z = 0; z < 4; ++z)
        _mm512_storeu_si512(codes + sb * 256 + 64 * z,
                            S::q6_codes(S::load64(s + 64 * (z / 2)),
                                        S::broadcast32(s + 128 + 32 * (z / 2)), z % 2));
      const __m512 d = _mm512_set1_ps(half_to_float(load_u16(s + 208)));
      _mm512_storeu_ps(scales + sb * 16,
                       _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                                            reinterpret_cast<const __m128i*>(s + 192))))));
    }
  } else if constexpr (kType == kQ4_K || kType == kQ5_K) {
    constexpr int64_t kSuper = kType == kQ4_K ? kSuperBytes : kQ5SuperBytes;
    constexpr int64_t kNibbles = kType == kQ4_K ? 16 : 48;
    for (int64_t sb = 0; sb < K / 256; ++sb) {
      const uint8_t* s = row + sb * kSuper;
      for (int i = 0; i < 4; ++i) {  // sub-blocks 2i (low nibbles), 2i + 1 (high)
        __m512i c = S::nibbles32(s + kNibbles + 32 * i);
        if constexpr (kType == kQ5_K) c = S::add_fifth_bit(c, S::broadcast32(s + 16), 2 * i);
        _mm512_storeu_si512(codes + sb * 256 + 64 * i, c);
      }
      // d * scale_j, the 6-bit min_j as they are, and the super-block's -dmin
      const KScales k = k_scales_of(s);
      const float d = half_to_float(load_u16(s));
      for (int j = 0; j < 8; ++j) {
        scales[8 * sb + j] = d * static_cast<float>((k.scales >> 8 * j) & 63);
        min_codes[8 * sb + j] = static_cast<int16_t>((k.mins >> 8 * j) & 63);
      }
      mins[sb] = -half_to_float(load_u16(s + 2));
    }
  } else {
    constexpr int64_t bb = block_bytes(kType);
    constexpr int64_t kCodes = nibble_offset(kType);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * bb + kCodes;
      if constexpr (kType == kQ8_0) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + b * 32),
                            _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80))));
      } else {  // low nibbles: weights 0-15, high: 16-31
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)),
                      m = _mm_set1_epi8(15);
        const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(v, m)),
                                                     _mm_and_si128(_mm_srli_epi16(v, 4), m), 1);
        __m512i c = _mm512_castsi256_si512(both);
        if constexpr (has_fifth_bit(kType))  // byte i + 16 where weight i's fifth bit is set
          c = S::add_fifth_bits(c, fifth_bits<kType>(row + b * bb));
        if constexpr (is_table_nibble_type(kType))
          c = S::table_codes(c, nibble_values(kType));  // table values + 128
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + b * 32), _mm512_castsi512_si256(c));
      }
    }
    block_scales<kType>(row, nb, scales, mins);  // d (and Q4_1's, Q5_1's m)
  }
}

// out[c][i] = dot(row i of x tile t, weight row c0 + c of the panel), c < kCols, i < kTileRows.
// Also asks for the weight bytes [prefetch, prefetch_end) (the next panel's share of this
// call), a few lines a group.
template <int64_t kType, int kH>
void micro_kernel(const PackedX& x, int64_t t, const Panel& w, int64_t c0, int64_t K,
                  float* out, const uint8_t* prefetch, const uint8_t* prefetch_end) {
  using T = GemmType<kType>;
  constexpr int64_t kTileRows = hybridllm_gguf::kTileRows<kH>;
  constexpr int kCols = hybridllm_gguf::kCols<kType, kH>;
  constexpr int64_t kUnitsPerGroup = T::kGroup / T::kUnit;
  const int64_t groups = K / T::kGroup, units = K / T::kUnit;
  const int8_t* xq = x.q + t * K * kTileRows;
  const float* xd = x.d + t * groups * kTileRows;
  const int32_t* xu = static_cast<const int32_t*>(x.unit) + t * units * kTileRows;
  constexpr int64_t pairs_a_group = T::kGroup / T::kMinUnit / 2;
  const int32_t* xp = x.pairs + t * groups * pairs_a_group * kTileRows;
  const uint8_t* codes[kCols];
  const float *scales[kCols], *mins[kCols];
  const int16_t* min_codes[kCols];
  for (int c = 0; c < kCols; ++c) {
    codes[c] = w.codes + (c0 + c) * K;
    scales[c] = w.scales + (c0 + c) * w.units;
    mins[c] = w.mins + (c0 + c) * w.units;
    min_codes[c] = w.min_codes + (c0 + c) * w.units;
  }
  // The totals: in registers where a group is one unit (Q4_0, Q4_1, Q8_0: part is then only a
  // temporary), else in out (L1), updated once a group (as for the scaled codes' 12 columns).
  constexpr bool kTotalsInRegisters = kUnitsPerGroup == 1 && !T::kScaledCodes;
  __m512 acc[kCols][kH];
  for (int c = 0; c < kCols; ++c)
    for (int h = 0; h < kH; ++h) acc[c][h] = _mm512_setzero_ps();
  if constexpr (!kTotalsInRegisters)
    for (int i = 0; i < kCols * kTileRows; i += 16) _mm512_store_ps(out + i, _mm512_setzero_ps());
  const int64_t prefetch_a_group = ((prefetch_end - prefetch) / 64 + groups - 1) / groups;
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t j = 0; j < prefetch_a_group && prefetch < prefetch_end; ++j, prefetch += 64)
      _mm_prefetch(reinterpret_cast<const char*>(prefetch), _MM_HINT_T1);
    __m512 part[kCols][kH];  // this group's sums in units of x's scale
    // The mins' share: -dmin * sum over min units of m * sum(q), the products of two units at a
    // time (vpdpwssd) added in integers (|total| < 8 * 63 * 32 * 127). First for the K-quants;
    // after the codes for the scaled codes, whose loop over a whole group then keeps only its
    // sums live (with part live too, GCC copied every sum between registers each step).
    const auto add_mins = [&](auto first) {
      __m512i min_sum[kCols][kH];
      for (int c = 0; c < kCols; ++c)
        for (int h = 0; h < kH; ++h) min_sum[c][h] = _mm512_setzero_si512();
      for (int64_t p = g * pairs_a_group; p < (g + 1) * pairs_a_group; ++p) {
        __m512i pairs[kH];
        for (int h = 0; h < kH; ++h) pairs[h] = _mm512_load_si512(xp + p * kTileRows + 16 * h);
        for (int c = 0; c < kCols; ++c) {
          int32_t two;
          std::memcpy(&two, min_codes[c] + 2 * p, 4);
          const __m512i m = _mm512_set1_epi32(two);
          for (int h = 0; h < kH; ++h)
            min_sum[c][h] = _mm512_dpwssd_epi32(min_sum[c][h], m, pairs[h]);
        }
      }
      for (int c = 0; c < kCols; ++c) {
        const __m512 min_scale = _mm512_set1_ps(mins[c][g]);
        for (int h = 0; h < kH; ++h) {
          const __m512 share = _mm512_cvtepi32_ps(min_sum[c][h]);
          if constexpr (decltype(first)::value)
            part[c][h] = _mm512_mul_ps(share, min_scale);
          else
            part[c][h] = _mm512_fmadd_ps(share, min_scale, part[c][h]);
        }
      }
    };
    if constexpr (T::kCodeMins && !T::kScaledCodes) {
      add_mins(std::true_type{});
    } else {
      for (int c = 0; c < kCols; ++c)
        for (int h = 0; h < kH; ++h) part[c][h] = _mm512_setzero_ps();
    }
    for (int64_t u = g * kUnitsPerGroup; u < (g + 1) * kUnitsPerGroup; ++u) {
      __m512i sum[kCols][kH];
      for (int h = 0; h < kH; ++h) {
        // the offset's share (-kOffset * sum of x) as the integer sums' start
        const __m512i start = T::kOffset != 0 ? _mm512_load_si512(xu + u * kTileRows + 16 * h)
                                              : _mm512_setzero_si512();
        for (int c = 0; c < kCols; ++c) sum[c][h] = start;
      }
      // Compile-time trip counts of at most 8 steps, unrolled whole: written as k from u * kUnit
      // to (u + 1) * kUnit the loop got a remainder dispatch and register copies around it every
      // unit, and a 64-step loop (the scaled codes' 256) was not unrolled and copied every sum
      // between two registers each step.
      constexpr int64_t kStretch = std::min<int64_t>(T::kUnit, 32);
      for (int64_t k0 = u * T::kUnit; k0 < (u + 1) * T::kUnit; k0 += kStretch) {
#pragma GCC unroll 8
        for (int kk = 0; kk < kStretch; kk += 4) {
          const int64_t k = k0 + kk;
          __m512i xv[kH];
          for (int h = 0; h < kH; ++h)  // once for the kCols rows
            xv[h] = in_register(_mm512_load_si512(xq + k * kTileRows + 64 * h));
          for (int c = 0; c < kCols; ++c) {
            int32_t four;
            std::memcpy(&four, codes[c] + k, 4);
            const __m512i wv = _mm512_set1_epi32(four);
            for (int h = 0; h < kH; ++h) sum[c][h] = _mm512_dpbusd_epi32(sum[c][h], wv, xv[h]);
          }
        }
      }
      for (int c = 0; c < kCols; ++c) {
        const __m512 scale = _mm512_set1_ps(scales[c][u]);
        for (int h = 0; h < kH; ++h) {
          const __m512 total = _mm512_cvtepi32_ps(sum[c][h]);
          part[c][h] = T::kScaledCodes ? _mm512_mul_ps(total, scale)
                                       : _mm512_fmadd_ps(total, scale, part[c][h]);
        }
        if constexpr (T::kFloatMins) {
          const __m512 min = _mm512_set1_ps(mins[c][u]);
          for (int h = 0; h < kH; ++h)
            part[c][h] = _mm512_fmadd_ps(
                _mm512_load_ps(reinterpret_cast<const float*>(xu) + u * kTileRows + 16 * h), min,
                part[c][h]);
        }
      }
    }
    if constexpr (T::kScaledCodes && T::kCodeMins) add_mins(std::false_type{});
    for (int h = 0; h < kH; ++h) {
      const __m512 dx = _mm512_load_ps(xd + g * kTileRows + 16 * h);
      for (int c = 0; c < kCols; ++c) {
        if constexpr (kTotalsInRegisters) {
          acc[c][h] = _mm512_fmadd_ps(part[c][h], dx, acc[c][h]);
        } else {
          float* total = out + c * kTileRows + 16 * h;
          _mm512_store_ps(total, _mm512_fmadd_ps(part[c][h], dx, _mm512_load_ps(total)));
        }
      }
    }
  }
  if constexpr (kTotalsInRegisters)
    for (int c = 0; c < kCols; ++c)
      for (int h = 0; h < kH; ++h) _mm512_store_ps(out + c * kTileRows + 16 * h, acc[c][h]);
}

// Weight rows [0, count) from `rows` (row_bytes apart) into w, and zero weights up to a whole
// number of `cols`-row micro-kernel calls. kX8: the rows are kType in x8 groups
// (count a whole number of them), unpacked 8 at a time.
template <int64_t kType, bool kX8>
void unpack_panel(const uint8_t* rows, int64_t row_bytes, int64_t count, int64_t K, int cols,
                  const Panel& w) {
  if constexpr (kX8) {
    for (int64_t j = 0; j < count; j += kX8GroupRows)
      x8_unpack_group(x8_type_of(kType), rows + j * row_bytes, K, w.codes + j * K, K,
                      w.scales + j * w.units, w.min_codes + j * w.units, w.mins + j * w.units,
                      w.units);
  }
  for (int64_t j = kX8 ? count : 0; j < (count + cols - 1) / cols * cols; ++j) {
    if (j < count) {
      unpack_row<kType>(rows + j * row_bytes, K, w.codes + j * K, w.scales + j * w.units,
                        w.mins + j * w.units, w.min_codes + j * w.units);
    } else {
      std::memset(w.codes + j * K, 0, K);
      std::fill(w.scales + j * w.units, w.scales + (j + 1) * w.units, 0.f);
      std::fill(w.mins + j * w.units, w.mins + (j + 1) * w.units, 0.f);
      std::fill(w.min_codes + j * w.units, w.min_codes + (j + 1) * w.units, int16_t{0});
    }
  }
}

// kX8: the weight is kType in x8 groups.
template <int64_t kType, int kH, bool kX8 = false>
void q8_gemm_typed(const float* x, int64_t M, int64_t K, const uint8_t* qw, int64_t N, float* y) {
  using T = GemmType<kType>;
  constexpr int64_t kTileRows = hybridllm_gguf::kTileRows<kH>;
  constexpr int kCols = hybridllm_gguf::kCols<kType, kH>;
  thread_local std::vector<uint8_t> quantized, packed;  // kept from call to call
  const Q8Rows rows = quantize_rows<T::kGroup>(x, M, K, quantized);
  const PackedX px = pack_x<kType, kH>(rows, M, K, packed);
  constexpr int64_t kWeightType = kX8 ? x8_type_of(kType) : kType;
  const int64_t row_bytes = row_bytes_of(kWeightType, K);
  // rows a panel: a multiple of kCols (and of an x8 group), at least one micro-kernel's
  constexpr int64_t kStep = kX8 ? std::lcm<int64_t>(kX8GroupRows, kCols) : kCols;
  const int64_t threads = at::get_num_threads();
  const int64_t steps = (N + kStep - 1) / kStep;  // rows in kStep pieces
  // Each thread a contiguous run of rows, as equal as kStep pieces allow, cut into panels of at
  // most kPanelCodeBytes of codes. Dealt out as whole panels the threads' shares were unequal:
  // SmolLM2's o-proj (576 rows) made 2 + 1 panels, the 1B's q (2048 rows of 24-row steps) 22 + 21.
  const int64_t panel_rows = std::max<int64_t>(1, kPanelCodeBytes / K / kStep) * kStep;
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    // block_scales writes whole 16-wide vectors: a row's scales and mins padded to 16
    const int64_t units_padded = (K / T::kMinUnit + 15) / 16 * 16 + 16;
    thread_local std::vector<uint8_t> codes_buffer;
    thread_local std::vector<float> scale_buffer;
    codes_buffer.resize(panel_rows * K + 64);
    scale_buffer.resize(3 * panel_rows * units_padded + 16);  // scales, mins, min codes
    float* const scale_base = align64(scale_buffer.data());
    const Panel w{codes_buffer.data(), scale_base, scale_base + panel_rows * units_padded,
                  reinterpret_cast<int16_t*>(scale_base + 2 * panel_rows * units_padded),
                  units_padded};
    alignas(64) float out[kCols * kTileRows];
    for (int64_t share = begin; share < end; ++share) {
      const int64_t first = std::min(N, steps * share / threads * kStep);
      const int64_t last = std::min(N, steps * (share + 1) / threads * kStep);
      for (int64_t n0 = first; n0 < last; n0 += panel_rows) {
        const int64_t count = std::min(panel_rows, last - n0);
        unpack_panel<kType, kX8>(qw + n0 * row_bytes, row_bytes, count, K, kCols, w);
        // The next panel's weight bytes, asked for a slice a micro-kernel call and spread over
        // its groups, so that reading them from DRAM overlaps this panel's arithmetic instead of
        // stalling its unpacking. Asked for in one burst before each call, they overlapped
        // little: a Q4_K expert (2048 x 7168) at 16 rows of x took 1.67 ms from DRAM against
        // 1.09 from cache (2-core Zen 5); spread, 1.10. The DeepSeek-V3-shaped Q4_K_M file's
        // experts of a 64-token decode step (3 layers of 32, 8-22 rows each): 0.87x the time.
        const uint8_t* next = qw + (n0 + count) * row_bytes;
        const uint8_t* const next_end = qw + std::min(last, n0 + count + panel_rows) * row_bytes;
        const int64_t calls = px.tiles * ((count + kCols - 1) / kCols);
        const int64_t slice = ((next_end - next) / calls + 63) / 64 * 64;
        for (int64_t t = 0; t < px.tiles; ++t) {
          const int64_t tile_rows = std::min(kTileRows, M - t * kTileRows);
          for (int64_t c0 = 0; c0 < count; c0 += kCols) {
            const uint8_t* const slice_end = std::min(next + slice, next_end);
            micro_kernel<kType, kH>(px, t, w, c0, K, out, next, slice_end);
            next = slice_end;
            const int64_t cols = std::min<int64_t>(kCols, count - c0);
            float* yt = y + t * kTileRows * N + n0 + c0;
            for (int64_t i = 0; i < tile_rows; ++i)
              for (int64_t c = 0; c < cols; ++c) yt[i * N + c] = out[c * kTileRows + i];
          }
        }
      }
    }
  });
}

}  // namespace

bool q8_gemm(int64_t type, const float* x, int64_t M, int64_t K, const uint8_t* qw, int64_t N,
             float* y) {
  const auto run = [&](auto type_constant) {
    constexpr int64_t kType = decltype(type_constant)::value;
    if (M <= kTileRows<1>)
      q8_gemm_typed<kType, 1>(x, M, K, qw, N, y);
    else
      q8_gemm_typed<kType, 2>(x, M, K, qw, N, y);
    return true;
  };
  const auto run_x8 = [&](auto type_constant) {
    constexpr int64_t kType = decltype(type_constant)::value;
    if constexpr (!x8_source_built(kType)) {
      return false;  // x8 weights this build never makes
    } else {
      if (M <= kTileRows<1>)
        q8_gemm_typed<kType, 1, true>(x, M, K, qw, N, y);
      else
        q8_gemm_typed<kType, 2, true>(x, M, K, qw, N, y);
      return true;
    }
  };
  const auto none = [] { return false; };
  if (is_x8_type(type)) return dispatch_gguf_type<kX8Kernels>(type, run_x8, none);
  return dispatch_gguf_type<kInt8Kernels>(type, run, none);
}
#elif !defined(HYBRIDLLM_Q8_AVX2)  // AVX2 without AVX-512: gguf_q8_gemm_avx2_cpu.cpp
bool q8_gemm(int64_t, const float*, int64_t, int64_t, const uint8_t*, int64_t, float*) {
  return false;  // no int8 GEMM in this build: the few-rows kernels serve many rows
}
#endif

}  // namespace hybridllm_gguf
