// hybridllm::gguf_linear's int8-activation GEMM for many rows of x on AVX2 without AVX-512
// (Zen 2 and 3, Intel before Ice Lake): x quantized as the few-rows path does
// (gguf_q8_quantize.h) and packed in tiles of 8 rows, the weight rows unpacked a panel at a time
// into codes and fp32 scales, and a micro-kernel whose vpmaddubsw multiplies 4 codes of one
// weight row (broadcast) with 4 values of each of the tile's 8 rows (a vector), adding the
// products in int16 as far as the codes' size allows before widening them (vpmaddwd).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_blocks.h"
#include "gguf_q8_dot.h"
#include "gguf_q8_linear.h"
#include "gguf_q8_quantize.h"
#include "gguf_q8_simd.h"
#include "gguf_x8.h"

namespace hybridllm_gguf {

#if defined(HYBRIDLLM_Q8_AVX2) && !defined(HYBRIDLLM_Q8_AVX512)
namespace {

constexpr int64_t kTile = 8;  // rows of x a tile: a 32-bit lane of a ymm each
constexpr int kCols = 4;      // weight rows a micro-kernel call (its sums stay in registers)
// Bytes of unpacked codes a panel holds: with a tile of x (8 * K bytes) it stays in L2 while
// every tile of x passes over it.
constexpr int64_t kPanelCodeBytes = 128 << 10;

// A weight type as this GEMM sees it: weight = scale * (code - kOffset) + min, one scale a unit
// of kUnit weights, x quantized in groups of kGroup. Signed codes (kSigned: Q8_0's, IQ4_NL's and
// MXFP4's table values, the code blocks' without a kCodeOffset) stay signed: |w| times x with
// w's sign, as the few-rows AVX2 kernels do. Code blocks: a float scale d * scale a unit of 16,
// codes + kCodeOffset where the type has one, and Q2_K's integer mins times dmin as the
// K-quants' are. vpmaddubsw's pair sums are at most 2 * kMaxCode * 127, so kSteps of them add
// up in int16 before they are widened (Q2_K's codes are 2 bits, Q3_K's 3 with its offset, the
// grid types' |code| at most 9-62: code_block_max_code).
template <int64_t kType>
struct GemmType {
  static constexpr bool kCodeBlocks = is_code_block_type(kType);
  static constexpr int64_t kGroup = q8_group(kType);
  static constexpr int64_t kUnit = kType == kQ6_K || kCodeBlocks ? 16 : 32;
  // integer mins a unit times one float a super-block: Q4_K's and Q5_K's 6-bit mins times
  // -dmin, Q2_K's times dmin
  static constexpr bool kKMins = kType == kQ4_K || kType == kQ5_K || code_block_mins<kType>();
  static constexpr bool kFloatMins = has_block_min(kType);  // Q4_1, Q5_1
  static constexpr bool kSigned = kType == kQ8_0 || is_table_nibble_type(kType) ||
                                  (kCodeBlocks && code_block_offset<kType>() < 0);
  // Signed codes that are never -128 (every signed type's but Q8_0's int8s): x's signs can go on
  // them (vpsignb of -128 stays -128), |x| <= 127 unsigned
  static constexpr bool kSignsOnCodes = kSigned && kType != kQ8_0;
  static constexpr int32_t kOffset = kType == kQ4_0   ? 8
                                     : kType == kQ5_0 ? 16
                                     : kType == kQ6_K ? 32
                                     : kCodeBlocks    ? std::max(code_block_offset<kType>(), 0)
                                                      : 0;
  static constexpr int kMaxCode = kType == kQ2_K                                     ? 3
                                  : kType == kQ3_K                                    ? 7
                                  : kCodeBlocks ? code_block_max_code<kType>()
                                  : kSigned                                           ? 128
                                  : kType == kQ6_K                                    ? 63
                                  : kType == kQ5_0 || kType == kQ5_1 || kType == kQ5_K ? 31
                                                                                       : 15;
  // K-quants: a 6-bit min a sub-block of 32 weights; code blocks: a min a unit of 16
  static constexpr int64_t kMinUnit = kCodeBlocks ? 16 : 32;
  // the most steps (of 4 weights) that fit, a divisor of a unit's: IQ2's 43 fit 3, take 2
  static constexpr int kSteps = [] {
    int steps = std::min<int>(kUnit / 4, 32767 / (2 * kMaxCode * 127));
    while ((kUnit / 4) % steps != 0) --steps;
    return steps;
  }();
  static_assert(kSteps >= 1);
};

// x's rows in tiles of 8: tile t's int8 values [K / 4][8][4] (4 consecutive values of a row a
// 32-bit lane, rows past M zero), its scales [groups][8], per unit of weights the int32
// -kOffset * sum(q) (`start`) or, for Q4_1 / Q5_1, the float sum(q) (`fsum`), and for integer
// mins [K / kMinUnit / 2][8] pairs of int16 kMinUnit-value sums (`pairs`).
struct PackedX {
  const int8_t* q;
  const float* d;
  const int32_t* start;
  const float* fsum;
  const int32_t* pairs;
};

inline int32_t sum_of(const int8_t* q, int64_t n) {
  int32_t s = 0;
  for (int64_t i = 0; i < n; ++i) s += q[i];
  return s;
}

template <int64_t kType>
PackedX pack_x(const Q8Rows& rows, int64_t M, int64_t K, std::vector<uint8_t>& buffer) {
  using T = GemmType<kType>;
  const int64_t tiles = (M + kTile - 1) / kTile;
  const int64_t groups = K / T::kGroup, units = K / T::kUnit;
  const int64_t pairs = T::kKMins ? K / T::kMinUnit / 2 : 0;
  const int64_t q_bytes = tiles * K * kTile, d_bytes = tiles * groups * kTile * 4;
  const int64_t unit_bytes = tiles * units * kTile * 4, pair_bytes = tiles * pairs * kTile * 4;
  buffer.resize(q_bytes + d_bytes + unit_bytes + pair_bytes + 64);
  uint8_t* base = buffer.data() + (64 - reinterpret_cast<uintptr_t>(buffer.data()) % 64) % 64;
  int8_t* q = reinterpret_cast<int8_t*>(base);
  float* d = reinterpret_cast<float*>(base + q_bytes);
  int32_t* unit = reinterpret_cast<int32_t*>(base + q_bytes + d_bytes);
  int32_t* pair = reinterpret_cast<int32_t*>(base + q_bytes + d_bytes + unit_bytes);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      int8_t* qt = q + t * K * kTile;
      for (int64_t i = 0; i < kTile; ++i) {
        const int64_t r = t * kTile + i;
        float* dt = d + t * groups * kTile + i;
        int32_t* ut = unit + t * units * kTile + i;
        int32_t* pt = pair + t * pairs * kTile + i;
        if (r >= M) {
          for (int64_t k = 0; k < K; k += 4) std::memset(qt + k * kTile + 4 * i, 0, 4);
          for (int64_t g = 0; g < groups; ++g) dt[g * kTile] = 0.f;
          for (int64_t u = 0; u < units; ++u) ut[u * kTile] = 0;
          for (int64_t p = 0; p < pairs; ++p) pt[p * kTile] = 0;
          continue;
        }
        const Q8Rows row = rows.row(r);
        for (int64_t k = 0; k < K; k += 4) std::memcpy(qt + k * kTile + 4 * i, row.q + k, 4);
        for (int64_t g = 0; g < groups; ++g) dt[g * kTile] = row.d[g];
        // the unit sums only where the micro-kernel reads them (integer mins take the pairs
        // below; signed codes need neither)
        if constexpr (T::kOffset != 0 || T::kFloatMins) {
          for (int64_t u = 0; u < units; ++u) {
            const int32_t sum = sum_of(row.q + u * T::kUnit, T::kUnit);
            if constexpr (T::kFloatMins) {
              const float f = static_cast<float>(sum);
              std::memcpy(ut + u * kTile, &f, 4);
            } else {
              ut[u * kTile] = -T::kOffset * sum;
            }
          }
        }
        for (int64_t p = 0; p < pairs; ++p) {  // |sum| <= 32 * 127: an int16
          const int32_t lo = sum_of(row.q + 2 * T::kMinUnit * p, T::kMinUnit),
                        hi = sum_of(row.q + 2 * T::kMinUnit * p + T::kMinUnit, T::kMinUnit);
          pt[p * kTile] = static_cast<int32_t>((static_cast<uint32_t>(hi) << 16) |
                                               (static_cast<uint32_t>(lo) & 0xffff));
        }
      }
    }
  });
  return {q, d, unit, reinterpret_cast<const float*>(unit), pair};
}

// A panel of weight rows unpacked: codes [rows][K]; per unit scales [rows][units] (and Q4_1's,
// Q5_1's float mins [rows][units]); integer mins min_codes [rows][units] and their factor (a
// K-quant's -dmin, Q2_K's dmin) in mins [rows][super-blocks]. Rows `units` apart; rows past N
// zero.
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
  using S = Avx2Q8<false>;
  const auto store = [](uint8_t* p, __m256i v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
  };
  if constexpr (GemmType<kType>::kCodeBlocks) {
    constexpr int64_t kSuper = gguf_type_info(kType).unit_bytes;
    constexpr int kOffset = GemmType<kType>::kOffset;
    CodeBlock cb;
    for (int64_t sb = 0; sb < K / kCodeBlockWeights; ++sb) {
      CodeBlockDecoder<kType>::decode(row + sb * kSuper, &cb);
      for (int64_t i = 0; i < kCodeBlockWeights; i += 32) {
        const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(cb.codes + i));
        store(codes + sb * kCodeBlockWeights + i,
              kOffset > 0 ? _mm256_add_epi8(v, _mm256_set1_epi8(kOffset)) : v);
      }
      for (int64_t u = 0; u < kCodeBlockWeights / kCodeUnit; ++u) {
        scales[16 * sb + u] = cb.d * static_cast<float>(cb.scales[u]);
        if constexpr (GemmType<kType>::kKMins) min_codes[16 * sb + u] = cb.mins[u];
      }
      if constexpr (GemmType<kType>::kKMins) mins[sb] = cb.dmin;
    }
  } else if constexpr (kType == kQ6_K) {
    for (int64_t sb = 0; sb < K / 256; ++sb) {
      const uint8_t* s = row + sb * kQ6SuperBytes;
      for (int z = 0; z < 4; ++z) {  // weights 64 z .. 64 z + 63: q + 32
        const S::V c =
            S::q6_codes(S::load64(s + 64 * (z / 2)), S::broadcast32(s + 128 + 32 * (z / 2)), z % 2);
        store(codes + sb * 256 + 64 * z, c.lo);
        store(codes + sb * 256 + 64 * z + 32, c.hi);
      }
      const float d = half_to_float(load_u16(s + 208));
      const int8_t* sc = reinterpret_cast<const int8_t*>(s + 192);
      for (int j = 0; j < 16; ++j) scales[16 * sb + j] = d * static_cast<float>(sc[j]);
    }
  } else if constexpr (kType == kQ4_K || kType == kQ5_K) {
    constexpr int64_t kSuper = kType == kQ4_K ? kSuperBytes : kQ5SuperBytes;
    constexpr int64_t kNibbles = kType == kQ4_K ? 16 : 48;
    for (int64_t sb = 0; sb < K / 256; ++sb) {
      const uint8_t* s = row + sb * kSuper;
      for (int i = 0; i < 4; ++i) {  // sub-blocks 2i (low nibbles), 2i + 1 (high)
        S::V c = S::nibbles32(s + kNibbles + 32 * i);
        if constexpr (kType == kQ5_K) c = S::add_fifth_bit(c, S::broadcast32(s + 16), 2 * i);
        store(codes + sb * 256 + 64 * i, c.lo);
        store(codes + sb * 256 + 64 * i + 32, c.hi);
      }
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
    const int64_t nb = K / kBlock;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * bb;
      uint8_t* out = codes + b * 32;
      if constexpr (kType == kQ8_0) {
        std::memcpy(out, blk + 2, 32);
      } else {  // low nibbles: weights 0-15, high: 16-31
        const __m128i v =
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + nibble_offset(kType)));
        const __m128i m = _mm_set1_epi8(15);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_and_si128(v, m));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16),
                         _mm_and_si128(_mm_srli_epi16(v, 4), m));
        if constexpr (has_fifth_bit(kType)) {
          const uint32_t fifth = fifth_bits<kType>(blk);
          for (int j = 0; j < 32; ++j) out[j] |= ((fifth >> j) & 1) << 4;
        }
        if constexpr (is_table_nibble_type(kType)) {  // IQ4_NL, MXFP4: the signed values
          const __m128i table =
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(nibble_values(kType)));
          for (int h = 0; h < 2; ++h) {
            __m128i* half = reinterpret_cast<__m128i*>(out + 16 * h);
            _mm_storeu_si128(half, _mm_shuffle_epi8(table, _mm_loadu_si128(half)));
          }
        }
      }
    }
    block_scales<kType>(row, nb, scales, mins);  // d (MXFP4's E8M0), Q4_1's and Q5_1's m
  }
}

// out[c][i] = dot(row i of x tile t, weight row c0 + c of the panel), c < kCols, i < kTile.
template <int64_t kType>
void micro_kernel(const PackedX& x, int64_t t, const Panel& w, int64_t c0, int64_t K,
                  float* out) {
  using T = GemmType<kType>;
  constexpr int64_t kUnitsPerGroup = T::kGroup / T::kUnit;
  constexpr int64_t kQuads = T::kUnit / 4;
  const int64_t groups = K / T::kGroup, units = K / T::kUnit;
  const int8_t* xq = x.q + t * K * kTile;
  const float* xd = x.d + t * groups * kTile;
  const int32_t* xs = x.start + t * units * kTile;
  const float* xf = x.fsum + t * units * kTile;
  constexpr int64_t kPairsPerGroup = T::kGroup / T::kMinUnit / 2;
  const int32_t* xp = x.pairs + t * (T::kKMins ? K / T::kMinUnit / 2 : 0) * kTile;
  const uint8_t* codes[kCols];
  const float *scales[kCols], *mins[kCols];
  const int16_t* min_codes[kCols];
  for (int c = 0; c < kCols; ++c) {
    codes[c] = w.codes + (c0 + c) * K;
    scales[c] = w.scales + (c0 + c) * w.units;
    mins[c] = w.mins + (c0 + c) * w.units;
    min_codes[c] = w.min_codes + (c0 + c) * w.units;
  }
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 total[kCols];
  for (int c = 0; c < kCols; ++c) total[c] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    // x's scales go into each unit's float factor, not onto a group's sum kept apart: with 4
    // more accumulators the loop's state overflowed the 16 registers and GCC kept sums on the
    // stack (with the asm below, one thread's 256 x 2048 by 2048 x 2048 Q4_K product 1.17x)
    const __m256 dx = _mm256_load_ps(xd + g * kTile);
    if constexpr (T::kKMins) {  // (-)dmin * sum over min units of m * sum(q), two at a time
      __m256i min_sum[kCols];
      for (int c = 0; c < kCols; ++c) min_sum[c] = _mm256_setzero_si256();
      for (int64_t p = kPairsPerGroup * g; p < kPairsPerGroup * (g + 1); ++p) {
        const __m256i sums = _mm256_load_si256(reinterpret_cast<const __m256i*>(xp + p * kTile));
        for (int c = 0; c < kCols; ++c) {
          int32_t two;
          std::memcpy(&two, min_codes[c] + 2 * p, 4);
          min_sum[c] = _mm256_add_epi32(min_sum[c],
                                        _mm256_madd_epi16(_mm256_set1_epi32(two), sums));
        }
      }
      for (int c = 0; c < kCols; ++c)
        total[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(min_sum[c]),
                                   _mm256_mul_ps(_mm256_set1_ps(mins[c][g]), dx), total[c]);
    }
    for (int64_t u = g * kUnitsPerGroup; u < (g + 1) * kUnitsPerGroup; ++u) {
      __m256i sum[kCols];
      const __m256i start =
          T::kOffset != 0 ? _mm256_load_si256(reinterpret_cast<const __m256i*>(xs + u * kTile))
                          : _mm256_setzero_si256();
      for (int c = 0; c < kCols; ++c) sum[c] = start;
#pragma GCC unroll 8
      for (int s0 = 0; s0 < kQuads; s0 += T::kSteps) {
        __m256i pairs[kCols];
#pragma GCC unroll 8
        for (int s = 0; s < T::kSteps; ++s) {
          const int64_t k = u * T::kUnit + 4 * (s0 + s);
          // in a register once for the kCols weight rows: GCC otherwise folded the load into
          // each vpmaddubsw, two loads a multiply with the weights' broadcast
          __m256i xv = _mm256_load_si256(reinterpret_cast<const __m256i*>(xq + k * kTile));
          asm("" : "+x"(xv));
          // signed codes above -128: |x| (once for the kCols rows) times the codes with x's
          // signs, one operation a row fewer than |code| times x with the codes' signs
          const __m256i x_magnitudes = T::kSignsOnCodes ? _mm256_abs_epi8(xv) : xv;
          for (int c = 0; c < kCols; ++c) {
            int32_t four;
            std::memcpy(&four, codes[c] + k, 4);
            const __m256i wv = _mm256_set1_epi32(four);
            const __m256i p =
                T::kSignsOnCodes ? _mm256_maddubs_epi16(x_magnitudes, _mm256_sign_epi8(wv, xv))
                : T::kSigned
                    ? _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv))
                    : _mm256_maddubs_epi16(wv, xv);
            pairs[c] = s == 0 ? p : _mm256_add_epi16(pairs[c], p);
            // added as it comes: GCC otherwise computed all kSteps x kCols products first and
            // kept them on the stack
            asm("" : "+x"(pairs[c]));
          }
        }
        for (int c = 0; c < kCols; ++c)
          sum[c] = _mm256_add_epi32(sum[c], _mm256_madd_epi16(pairs[c], ones));
      }
      for (int c = 0; c < kCols; ++c) {
        total[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[c]),
                                   _mm256_mul_ps(_mm256_set1_ps(scales[c][u]), dx), total[c]);
        if constexpr (T::kFloatMins)
          total[c] = _mm256_fmadd_ps(_mm256_load_ps(xf + u * kTile),
                                     _mm256_mul_ps(_mm256_set1_ps(mins[c][u]), dx), total[c]);
      }
    }
  }
  for (int c = 0; c < kCols; ++c) _mm256_store_ps(out + c * kTile, total[c]);
}

// Weight rows [0, count) from `rows` (row_bytes apart) into w, and zero weights up to a whole
// number of micro-kernel calls. kX8: the rows are kType in x8 groups (count a whole number of
// them), unpacked 8 at a time.
template <int64_t kType, bool kX8>
void unpack_panel(const uint8_t* rows, int64_t row_bytes, int64_t count, int64_t K,
                  const Panel& w) {
  if constexpr (kX8) {
    for (int64_t j = 0; j < count; j += kX8GroupRows)
      x8_unpack_group(x8_type_of(kType), rows + j * row_bytes, K, w.codes + j * K, K,
                      w.scales + j * w.units, w.min_codes + j * w.units, w.mins + j * w.units,
                      w.units);
  }
  for (int64_t j = kX8 ? count : 0; j < (count + kCols - 1) / kCols * kCols; ++j) {
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
template <int64_t kType, bool kX8 = false>
void q8_gemm_typed(const float* x, int64_t M, int64_t K, const uint8_t* qw, int64_t N, float* y) {
  using T = GemmType<kType>;
  thread_local std::vector<uint8_t> quantized, packed;  // kept from call to call
  const Q8Rows rows = quantize_rows<T::kGroup>(x, M, K, quantized);
  const PackedX px = pack_x<kType>(rows, M, K, packed);
  const int64_t tiles = (M + kTile - 1) / kTile;
  const int64_t row_bytes = row_bytes_of(kX8 ? x8_type_of(kType) : kType, K);
  const int64_t threads = at::get_num_threads();
  // rows in pieces of kCols, or of whole x8 groups
  constexpr int64_t kStep = kX8 ? std::max<int64_t>(kCols, kX8GroupRows) : kCols;
  const int64_t steps = (N + kStep - 1) / kStep;
  // each thread a contiguous run of rows, cut into panels of at most kPanelCodeBytes of codes
  const int64_t panel_rows = std::max<int64_t>(1, kPanelCodeBytes / K / kStep) * kStep;
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    // block_scales writes whole 16-wide vectors: a row's scales and mins padded to 16
    const int64_t units_padded = (K / T::kUnit + 15) / 16 * 16 + 16;
    thread_local std::vector<uint8_t> codes_buffer;
    thread_local std::vector<float> scale_buffer;
    codes_buffer.resize(panel_rows * K + 64);
    scale_buffer.resize(3 * panel_rows * units_padded + 16);  // scales, mins, min codes
    float* const scale_base = align64(scale_buffer.data());
    const Panel w{codes_buffer.data(), scale_base, scale_base + panel_rows * units_padded,
                  reinterpret_cast<int16_t*>(scale_base + 2 * panel_rows * units_padded),
                  units_padded};
    alignas(32) float out[kCols * kTile];
    for (int64_t share = begin; share < end; ++share) {
      const int64_t first = std::min(N, steps * share / threads * kStep);
      const int64_t last = std::min(N, steps * (share + 1) / threads * kStep);
      for (int64_t n0 = first; n0 < last; n0 += panel_rows) {
        const int64_t count = std::min(panel_rows, last - n0);
        unpack_panel<kType, kX8>(qw + n0 * row_bytes, row_bytes, count, K, w);
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t tile_rows = std::min(kTile, M - t * kTile);
          for (int64_t c0 = 0; c0 < count; c0 += kCols) {
            micro_kernel<kType>(px, t, w, c0, K, out);
            const int64_t cols = std::min<int64_t>(kCols, count - c0);
            float* yt = y + t * kTile * N + n0 + c0;
            for (int64_t i = 0; i < tile_rows; ++i)
              for (int64_t c = 0; c < cols; ++c) yt[i * N + c] = out[c * kTile + i];
          }
        }
      }
    }
  });
}

}  // namespace

bool q8_gemm(int64_t type, const float* x, int64_t M, int64_t K, const uint8_t* qw, int64_t N,
             float* y) {
  bool done = false;
  if (is_x8_type(type)) {
    dispatch_gguf_type<kX8Kernels>(
        type,
        [&](auto t) {
          constexpr int64_t kSource = decltype(t)::value;
          if constexpr (x8_source_built(kSource))
            q8_gemm_typed<kSource, true>(x, M, K, qw, N, y), done = true;
        },
        [] {});
    return done;  // false: x8 weights of a type this build does not repack
  }
  dispatch_gguf_type<kInt8Kernels>(
      type, [&](auto t) { q8_gemm_typed<decltype(t)::value>(x, M, K, qw, N, y), done = true; },
      [] {});
  return done;  // false: a type without int8 kernels
}
#endif

}  // namespace hybridllm_gguf
