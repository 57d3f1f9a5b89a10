// Q4_K / Q5_K / Q6_K / IQ4_XS rows repacked in groups of 8 (gguf_x8.h): the repacking ops,
// registered as hybridllm::repack_x8 / unpack_x8 (for every x8 type), and the AVX-512 int8
// kernels for few rows of x that gguf_linear and fused_moe run on K-quants. One vpdpbusd
// multiplies 4 codes of each of the 8 rows, twice over (lanes 0-7 and 8-15 take consecutive
// quads of weights), with x's values broadcast to match, so a super-block's sub-block scales are
// one vector multiply for 8 rows.
// Streaming a 1 GB Q4_K matrix from DRAM at one row of x (2 threads, the 2-core AMD EPYC of
// docs/benchmarks.md) this read 39-44 GB/s against 36-37 for the row-at-a-time Q4_K kernel, and
// 129 against 62 GB/s from cache.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_blocks.h"
#include "gguf_prefetch.h"
#include "gguf_x8.h"
#include "gguf_q8_quantize.h"
#include "gguf_q8_simd.h"

namespace hybridllm_gguf {
namespace {

// Q4_K's 6-bit scale and min of sub-block j from its 12 packed bytes q (ggml's layout).
void scale_min(const uint8_t* q, int j, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// The inverse: the 12 bytes of 8 scales and 8 mins of 6 bits.
void pack_scale_min(const uint8_t* sc, const uint8_t* m, uint8_t* q) {
  for (int j = 0; j < 4; ++j) {
    q[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
    q[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
    q[j + 8] = (sc[j + 4] & 15) | ((m[j + 4] & 15) << 4);
  }
}

// The weight of its sub-block (0-31) whose code is the low nibble of byte 4 (8 h + r) + b of
// chunk c; the high nibble holds that of the weight 8 later.
inline int chunk_weight(int c, int h, int b) { return 16 * c + 4 * h + b; }

// Where a source super-block's 4-bit codes start (Q5_K: its 32 high-bit bytes first, bit j of
// byte v weight v's of sub-block j); a group super-block's: kGroupCodes (gguf_x8.h).
template <int64_t kType>
constexpr int64_t kSourceNibbles = kType == kQ4_K ? 16 : 48;

// Where a Q6_K super-block (ggml's layout) keeps weight w's (0-255) low 4 bits and top 2 bits:
// byte offsets and shifts, as q6_k_bits gives them for its block w / 32.
struct Q6Place {
  int low, low_shift, high, high_shift;
};
inline Q6Place q6_place(int w) {
  const int b = w / 32, l = w % 32, half = b / 4, g = b % 4;
  return {half * 64 + (g % 2) * 32 + l, (g / 2) * 4, 128 + half * 32 + l, 2 * g};
}

template <int64_t kType>
void repack_group(const uint8_t* rows, int64_t nsb, uint8_t* out) {
  constexpr int64_t kSource = kSourceBytes<kType>, kNibbles = kSourceNibbles<kType>;
  std::memset(out, 0, nsb * kGroupBytes<kType>);  // the fifth bits are or-ed in
  for (int64_t s = 0; s < nsb; ++s) {
    uint8_t* o = out + s * kGroupBytes<kType>;
    for (int r = 0; r < 8; ++r) {
      const uint8_t* q = rows + r * nsb * kSource + s * kSource;
      std::memcpy(o + 2 * r, q, 2);
      std::memcpy(o + 16 + 2 * r, q + 2, 2);
      for (int j = 0; j < 8; ++j)
        scale_min(q + 4, j, o + 32 + 8 * j + r, o + 96 + 16 * (j / 2) + 2 * r + j % 2);
      // weight v of sub-block j is nibble (j % 2) of byte 32 (j / 2) + v of the codes
      const auto code = [&](int j, int v) {
        const uint8_t byte = q[kNibbles + 32 * (j / 2) + v];
        return j % 2 ? byte >> 4 : byte & 15;
      };
      for (int j = 0; j < 8; ++j)
        for (int c = 0; c < 2; ++c)
          for (int h = 0; h < 2; ++h)
            for (int b = 0; b < 4; ++b) {
              const int v = chunk_weight(c, h, b), i = 4 * (8 * h + r) + b, chunk = 2 * j + c;
              o[chunk_code_offset<kType>(chunk) + i] =
                  static_cast<uint8_t>(code(j, v) | (code(j, v + 8) << 4));
              if constexpr (kType == kQ5_K)
                for (int half = 0; half < 2; ++half)
                  if (q[16 + v + 8 * half] >> j & 1)
                    o[q5_high_offset(chunk) + 8 * half + i / 8] |=
                        static_cast<uint8_t>(1 << (i % 8));
            }
    }
  }
}

template <int64_t kType>
void unpack_group(const uint8_t* group, int64_t nsb, uint8_t* rows) {
  constexpr int64_t kSource = kSourceBytes<kType>, kNibbles = kSourceNibbles<kType>;
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* o = group + s * kGroupBytes<kType>;
    for (int r = 0; r < 8; ++r) {
      uint8_t* q = rows + r * nsb * kSource + s * kSource;
      if constexpr (kType == kQ5_K) std::memset(q + 16, 0, 32);  // the fifth bits are or-ed in
      std::memcpy(q, o + 2 * r, 2);
      std::memcpy(q + 2, o + 16 + 2 * r, 2);
      uint8_t sc[8], m[8];
      for (int j = 0; j < 8; ++j) {
        sc[j] = o[32 + 8 * j + r];
        m[j] = o[96 + 16 * (j / 2) + 2 * r + j % 2];
      }
      pack_scale_min(sc, m, q + 4);
      for (int j = 0; j < 8; ++j)
        for (int c = 0; c < 2; ++c)
          for (int h = 0; h < 2; ++h)
            for (int b = 0; b < 4; ++b) {
              const int i = 4 * (8 * h + r) + b, chunk = 2 * j + c;
              const uint8_t byte = o[chunk_code_offset<kType>(chunk) + i];
              for (int half = 0; half < 2; ++half) {
                const int v = chunk_weight(c, h, b) + 8 * half;
                const uint8_t nibble = half ? byte >> 4 : byte & 15;
                uint8_t& dst = q[kNibbles + 32 * (j / 2) + v];
                dst = j % 2 ? static_cast<uint8_t>((dst & 15) | (nibble << 4))
                            : static_cast<uint8_t>((dst & 0xF0) | nibble);
                if constexpr (kType == kQ5_K)
                  if (o[q5_high_offset(chunk) + 8 * half + i / 8] >> (i % 8) & 1)
                    q[16 + v] |= static_cast<uint8_t>(1 << j);
              }
            }
    }
  }
}

// Every code field of row r in a Q6_K super-block: field(source byte, its shift, group byte, its
// shift, mask) for the low 4 bits and the top 2 bits of each of its 256 codes.
template <class Field>
void q6_code_fields(int r, Field field) {
  for (int c = 0; c < 16; ++c)
    for (int h = 0; h < 2; ++h)
      for (int b = 0; b < 4; ++b)
        for (int half = 0; half < 2; ++half) {
          const Q6Place p = q6_place(16 * c + 8 * half + 4 * h + b);
          const int i = 4 * (8 * h + r) + b;
          field(p.low, p.low_shift, chunk_code_offset<kQ6_K>(c) + i, 4 * half, 15);
          field(p.high, p.high_shift, q6_top_offset(c) + 16 * half + i % 16, 2 * (i / 16), 3);
        }
}

void repack_q6_group(const uint8_t* rows, int64_t nsb, uint8_t* out) {
  std::memset(out, 0, nsb * kGroupBytes<kQ6_K>);  // the codes' bits are or-ed in
  for (int64_t s = 0; s < nsb; ++s) {
    uint8_t* o = out + s * kGroupBytes<kQ6_K>;
    for (int r = 0; r < 8; ++r) {
      const uint8_t* q = rows + r * nsb * kQ6SuperBytes + s * kQ6SuperBytes;
      std::memcpy(o + 2 * r, q + 208, 2);
      for (int c = 0; c < 16; ++c) o[16 + 8 * c + r] = q[192 + c];
      q6_code_fields(r, [&](int src, int src_shift, int64_t dst, int dst_shift, int mask) {
        o[dst] |= static_cast<uint8_t>((q[src] >> src_shift & mask) << dst_shift);
      });
    }
  }
}

void unpack_q6_group(const uint8_t* group, int64_t nsb, uint8_t* rows) {
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* o = group + s * kGroupBytes<kQ6_K>;
    for (int r = 0; r < 8; ++r) {
      uint8_t* q = rows + r * nsb * kQ6SuperBytes + s * kQ6SuperBytes;
      std::memset(q, 0, 192);  // the codes' bits are or-ed in
      std::memcpy(q + 208, o + 2 * r, 2);
      for (int c = 0; c < 16; ++c) q[192 + c] = o[16 + 8 * c + r];
      q6_code_fields(r, [&](int src, int src_shift, int64_t dst, int dst_shift, int mask) {
        q[src] |= static_cast<uint8_t>((o[dst] >> dst_shift & mask) << src_shift);
      });
    }
  }
}

// IQ4_XS's code of weight v (0-31) of sub-block j: nibble v / 16 of byte 8 + 16 j + v % 16.
inline int iq4_code(const uint8_t* q, int j, int v) {
  return q[8 + 16 * j + v % 16] >> (4 * (v / 16)) & 15;
}
inline void or_iq4_code(uint8_t* q, int j, int v, int code) {
  q[8 + 16 * j + v % 16] |= static_cast<uint8_t>(code << (4 * (v / 16)));
}

// IQ4_XS's 6-bit scale of sub-block j, from its fields at q + 2 (scales_h) and q + 4 (scales_l).
inline int iq4_scale(const uint8_t* q, int j) {
  return ((q[4 + j / 2] >> (4 * (j % 2))) & 15) | ((q[2 + j / 4] >> (2 * (j % 4))) & 3) << 4;
}
inline void or_iq4_scale(uint8_t* q, int j, int ls) {
  q[4 + j / 2] |= static_cast<uint8_t>((ls & 15) << (4 * (j % 2)));
  q[2 + j / 4] |= static_cast<uint8_t>((ls >> 4) << (2 * (j % 4)));
}

// Group chunk 2 j + c's byte i = 4 (8 h + r) + b: row r's codes of weights v = chunk_weight(c, h,
// b) and v + 8 of sub-block j.
template <class Byte>
void iq4_code_bytes(int r, Byte byte) {
  for (int j = 0; j < 8; ++j)
    for (int c = 0; c < 2; ++c)
      for (int h = 0; h < 2; ++h)
        for (int b = 0; b < 4; ++b)
          byte(j, chunk_weight(c, h, b),
               chunk_code_offset<kIQ4_XS>(2 * j + c) + 4 * (8 * h + r) + b);
}

void repack_iq4_group(const uint8_t* rows, int64_t nsb, uint8_t* out) {
  for (int64_t s = 0; s < nsb; ++s) {
    uint8_t* o = out + s * kGroupBytes<kIQ4_XS>;
    for (int r = 0; r < 8; ++r) {
      const uint8_t* q = rows + (r * nsb + s) * kSourceBytes<kIQ4_XS>;
      std::memcpy(o + 2 * r, q, 2);
      for (int j = 0; j < 8; ++j)
        o[16 + 8 * j + r] = static_cast<uint8_t>(static_cast<int8_t>(iq4_scale(q, j) - 32));
      iq4_code_bytes(r, [&](int j, int v, int64_t i) {
        o[i] = static_cast<uint8_t>(iq4_code(q, j, v) | iq4_code(q, j, v + 8) << 4);
      });
    }
  }
}

void unpack_iq4_group(const uint8_t* group, int64_t nsb, uint8_t* rows) {
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* o = group + s * kGroupBytes<kIQ4_XS>;
    for (int r = 0; r < 8; ++r) {
      uint8_t* q = rows + (r * nsb + s) * kSourceBytes<kIQ4_XS>;
      std::memset(q, 0, kSourceBytes<kIQ4_XS>);  // every field is or-ed in
      std::memcpy(q, o + 2 * r, 2);
      for (int j = 0; j < 8; ++j) or_iq4_scale(q, j, static_cast<int8_t>(o[16 + 8 * j + r]) + 32);
      iq4_code_bytes(r, [&](int j, int v, int64_t i) {
        or_iq4_code(q, j, v, o[i] & 15);
        or_iq4_code(q, j, v + 8, o[i] >> 4);
      });
    }
  }
}

// Checks `blocks` ([..., rows, bytes] uint8, dense, rows % 8 == 0, `bytes` a whole number of
// `super_bytes` super-blocks) and returns (groups, super-blocks a row).
std::pair<int64_t, int64_t> group_shape(const at::Tensor& blocks, int64_t super_bytes,
                                        const char* op) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() >= 2 &&
                  blocks.is_contiguous(),
              op, ": expected contiguous uint8 CPU blocks [..., rows, bytes], got ",
              blocks.scalar_type(), " ", blocks.sizes(), " on ", blocks.device());
  const int64_t bytes = blocks.size(-1), rows = blocks.numel() / std::max<int64_t>(bytes, 1);
  TORCH_CHECK(bytes > 0 && bytes % super_bytes == 0, op, ": a row of ", bytes,
              " bytes is not a whole number of ", super_bytes, "-byte super-blocks");
  TORCH_CHECK(blocks.size(-2) % kX8GroupRows == 0, op, ": ", blocks.size(-2),
              " rows a matrix is not a multiple of ", kX8GroupRows);
  return {rows / kX8GroupRows, bytes / super_bytes};
}

// `blocks` of ggml_type `type` (Q4_K, Q5_K, Q6_K, Q2_K, Q3_K, IQ4_XS, IQ2_XXS, IQ3_XXS, Q4_0,
// Q4_1, Q8_0, IQ4_NL) into x8 groups (repack) or back (unpack).
at::Tensor convert(const at::Tensor& blocks, int64_t type, bool repack) {
  const char* op = repack ? "repack_x8" : "unpack_x8";
  return dispatch_gguf_type<kX8Kernels>(
      x8_type_of(type),
      [&](auto type_constant) {
        constexpr int64_t kType = decltype(type_constant)::value;
        constexpr int64_t source = kSourceBytes<kType>, group = kGroupBytes<kType>;
        const auto [groups, nsb] = group_shape(blocks, repack ? source : group / 8, op);
        std::vector<int64_t> shape(blocks.sizes().begin(), blocks.sizes().end());
        shape.back() = nsb * (repack ? group / 8 : source);
        at::Tensor out = at::empty(shape, blocks.options());
        const uint8_t* src = blocks.data_ptr<uint8_t>();
        uint8_t* dst = out.data_ptr<uint8_t>();
        at::parallel_for(0, groups, 16, [&](int64_t begin, int64_t end) {
          for (int64_t g = begin; g < end; ++g) {
            const int64_t rows = g * 8 * nsb * source, x8 = g * nsb * group;  // byte offsets
            if constexpr (is_block_x8_source(kType)) {
              if (repack) block_x8_convert(kType, src + rows, nsb, dst + x8, true);
              else block_x8_convert(kType, src + x8, nsb, dst + rows, false);
            } else if constexpr (kType == kIQ4_XS) {
              if (repack) repack_iq4_group(src + rows, nsb, dst + x8);
              else unpack_iq4_group(src + x8, nsb, dst + rows);
            } else if constexpr (is_grid_x8_source(kType)) {
              if (repack) grid_x8_convert(kType, src + rows, nsb, dst + x8, true);
              else grid_x8_convert(kType, src + x8, nsb, dst + rows, false);
            } else if constexpr (is_code_x8_source(kType)) {
              if (repack) code_x8_convert(kType, src + rows, nsb, dst + x8, true);
              else code_x8_convert(kType, src + x8, nsb, dst + rows, false);
            } else if constexpr (kType == kQ6_K) {
              if (repack) repack_q6_group(src + rows, nsb, dst + x8);
              else unpack_q6_group(src + x8, nsb, dst + rows);
            } else {
              if (repack) repack_group<kType>(src + rows, nsb, dst + x8);
              else unpack_group<kType>(src + x8, nsb, dst + rows);
            }
          }
        });
        return out;
      },
      [&]() -> at::Tensor {
        TORCH_CHECK(false, op,
                    ": ggml_type must be Q4_K (12), Q5_K (13), Q6_K (14), Q2_K (10), Q3_K (11), "
                    "IQ4_XS (23), IQ2_XXS (16), IQ3_XXS (18), Q4_0 (2), Q4_1 (3), Q8_0 (8) or "
                    "IQ4_NL (20), got ",
                    type);
        return {};
      });
}

at::Tensor repack_x8(const at::Tensor& blocks, int64_t type) {
  return convert(blocks, type, true);
}
at::Tensor unpack_x8(const at::Tensor& blocks, int64_t type) {
  return convert(blocks, type, false);
}

#if defined(HYBRIDLLM_Q8_AVX512)
// Rows of x as the kernel reads them, from q8's Q4_K quantization (groups of 256):
//   q[r][k]   x's int8 values
//   d[r][s]   super-block s's scale
//   mins[r][p] (Q4_K, Q5_K) int16 pair (B 2p, B 2p+1), B j the sum of q over sub-block j's 32
//             values
//   offsets[r][c][h] (Q6_K) -32 times the sum of q over the 8 values of chunk c (values 16 c ..
//             16 c + 15) that lanes 8 h .. 8 h + 7 of its code vectors meet (16 c + 4 h .. + 3,
//             16 c + 8 + 4 h .. + 3), so that integer sums started there are those of code - 32:
//             a pair a chunk, spread over the lanes by one permute. Stored as the 16-lane vector
//             itself (4 bytes a lane, 4 times x's own bytes: 28 KB for K = 7168) the array
//             left L1 as the weights streamed past: alternating in one process (2-core Zen 5),
//             the vector form took 1.25x the pair's time for a 16384 x 7168 matrix from DRAM on 2
//             threads and 1.32x from cache at 2048 x 7168 (equal at K = 2048 from DRAM).
struct X8Rows {
  const int8_t* q;
  const float* d;
  const int32_t* mins;
  const int32_t* offsets;
  int64_t q_stride, d_stride, mins_stride, offsets_stride;  // in elements, a row

  X8Rows from(int64_t r) const {  // the rows from row r on
    return {q + r * q_stride,    d + r * d_stride,
            mins + r * mins_stride, offsets + r * offsets_stride,
            q_stride,            d_stride,
            mins_stride,         offsets_stride};
  }
};

template <int64_t kType>
X8Rows prepare_rows(const float* x, int64_t M, int64_t K) {
  thread_local std::vector<uint8_t> quantized;
  thread_local std::vector<int32_t> buffer;
  const Q8Rows q8 = quantize_rows<256>(x, M, K, quantized);
  constexpr bool kQ6 = kType == kQ6_K;
  const int64_t mins_stride = kQ6 ? 0 : K / 64, offsets_stride = kQ6 ? K / 8 : 0;
  buffer.resize(M * (mins_stride + offsets_stride));
  int32_t* offsets = buffer.data();
  int32_t* mins = offsets + M * offsets_stride;
  for (int64_t r = 0; r < M; ++r) {
    const Q8Rows row = q8.row(r);
    if constexpr (kQ6) {
      for (int64_t c = 0; c < K / 16; ++c)
        for (int h = 0; h < 2; ++h) {
          int32_t sum = 0;
          for (int b = 0; b < 4; ++b)
            sum += row.q[16 * c + 4 * h + b] + row.q[16 * c + 8 + 4 * h + b];
          offsets[r * offsets_stride + 2 * c + h] = -32 * sum;
        }
    } else {
      for (int64_t p = 0; p < K / 64; ++p)
        mins[r * mins_stride + p] = k_min_pair(row.bsums + 4 * p);
    }
  }
  return {q8.q, q8.d, mins, offsets, q8.q_stride, q8.g_stride, mins_stride, offsets_stride};
}

// Chunk q's codes of the group super-block at o, as unsigned bytes in the kernel's lanes: those
// in its low nibbles (half 0: weights 16 q + 4 h + b of lane 8 h + r) or high nibbles (half 1,
// weights 8 later), with Q5_K's fifth bit or Q6_K's top 2 bits added.
template <int64_t kType>
inline __m512i chunk_codes(const uint8_t* o, int q, int half) {
  const __m512i c = _mm512_loadu_si512(o + chunk_code_offset<kType>(q));
  const __m512i v = _mm512_and_si512(half ? _mm512_srli_epi16(c, 4) : c, _mm512_set1_epi8(15));
  if constexpr (kType == kQ5_K) {
    uint64_t bits;
    std::memcpy(&bits, o + q5_high_offset(q) + 8 * half, 8);
    return _mm512_mask_add_epi8(v, _cvtu64_mask64(bits), v, _mm512_set1_epi8(16));
  }
  if constexpr (kType == kQ6_K) {
    // 128-bit lane G's top bits are bits 2 G, 2 G + 1 of its 16 bytes: rotated to bits 4, 5
    // (within each byte: 4, 2, 0 and -2 places)
    const __m512i top = _mm512_rolv_epi64(
        _mm512_broadcast_i32x4(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(o + q6_top_offset(q) + 16 * half))),
        _mm512_setr_epi64(4, 4, 2, 2, 0, 0, 62, 62));
    return _mm512_ternarylogic_epi32(v, top, _mm512_set1_epi8(0x30), 0xF8);  // v | (top & 0x30)
  }
  return v;
}

// Rows of x a tile: each group super-block's codes are decoded once for all of them. A row at a
// time, the kernel ran at 125-135 GMAC/s in cache whatever the rows; 4 rows an expert over
// Qwen3-Next's experts (Q4_K gate/up, 2-core Zen 5) took 0.63 against 0.74-0.81 ms in cache and
// 36 against 46-48 ms from DRAM (384 experts).
constexpr int kTileRows = 4;

// y[r * ldy + i] = dot(x row r, weight row i of the group at wg) for the kRows rows of x; `first`:
// the tile that reads the group from memory, which prefetches ahead.
template <int64_t kType, int kRows>
void x8_group_tile(const X8Rows& x, int64_t nsb, const uint8_t* wg, float* y, int64_t ldy,
                   bool first, const PrefetchWindow& prefetch) {
  constexpr int64_t kBytes = kGroupBytes<kType>;
  __m512 acc[kRows];     // lanes i and 8 + i: weight row i's two halves
  __m256 minacc[kRows];  // Q4_K/Q5_K: weight row i's dmin * sum_j m_j B_j, in x's units
  for (int r = 0; r < kRows; ++r) {
    acc[r] = _mm512_setzero_ps();
    minacc[r] = _mm256_setzero_ps();
  }
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* o = wg + s * kBytes;
    if (first) prefetch_ahead(prefetch, o, 1, 0, kBytes);
    __m512i sums[kRows];
    for (int r = 0; r < kRows; ++r) sums[r] = _mm512_setzero_si512();
    if constexpr (kType == kQ6_K) {
      const __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
#pragma GCC unroll 16
      for (int q = 0; q < 16; ++q) {
        const __m512i c0 = chunk_codes<kType>(o, q, 0), c1 = chunk_codes<kType>(o, q, 1);
        uint64_t sc;
        std::memcpy(&sc, o + 16 + 8 * q, 8);
        const __m512i scale = _mm512_cvtepi8_epi32(_mm_set1_epi64x(static_cast<int64_t>(sc)));
        for (int r = 0; r < kRows; ++r) {
          // the -32 offset's share: the chunk's pair, lanes 0-7 and 8-15
          const int32_t* xo = x.offsets + r * x.offsets_stride + s * 32 + 2 * q;
          const int8_t* xs = x.q + r * x.q_stride + 256 * s + 16 * q;
          const __m128i pair = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(xo));
          __m512i t = _mm512_permutexvar_epi32(halves, _mm512_castsi128_si512(pair));
          t = _mm512_dpbusd_epi32(t, c0, x_quads(xs, 0));
          t = _mm512_dpbusd_epi32(t, c1, x_quads(xs, 1));
          // |t| <= 8 * 32 * 128, |scale| <= 128: |sums| < 16 * 2^22
          sums[r] = _mm512_add_epi32(sums[r], _mm512_mullo_epi32(t, scale));
        }
      }
    } else {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {  // chunks 2 j, 2 j + 1: sub-block j
        const __m512i c00 = chunk_codes<kType>(o, 2 * j, 0), c01 = chunk_codes<kType>(o, 2 * j, 1);
        const __m512i c10 = chunk_codes<kType>(o, 2 * j + 1, 0);
        const __m512i c11 = chunk_codes<kType>(o, 2 * j + 1, 1);
        uint64_t sc;
        std::memcpy(&sc, o + 32 + 8 * j, 8);
        const __m512i scale = _mm512_cvtepu8_epi32(_mm_set1_epi64x(static_cast<int64_t>(sc)));
        for (int r = 0; r < kRows; ++r) {
          const int8_t* x0 = x.q + r * x.q_stride + 256 * s + 32 * j;
          const int8_t* x1 = x0 + 16;
          const __m512i zero = _mm512_setzero_si512();
          __m512i s0 = _mm512_dpbusd_epi32(zero, c00, x_quads(x0, 0));
          __m512i s1 = _mm512_dpbusd_epi32(zero, c01, x_quads(x0, 1));
          s0 = _mm512_dpbusd_epi32(s0, c10, x_quads(x1, 0));
          s1 = _mm512_dpbusd_epi32(s1, c11, x_quads(x1, 1));
          // |sum| <= 32 * 31 * 127 * 63 * 8: int32
          sums[r] = _mm512_add_epi32(sums[r], _mm512_mullo_epi32(_mm512_add_epi32(s0, s1), scale));
        }
      }
      __m256i m[4];  // the 8 rows' min codes, sub-blocks 2 p and 2 p + 1 as int16 pairs
      for (int p = 0; p < 4; ++p)
        m[p] = _mm256_cvtepu8_epi16(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 96 + 16 * p)));
      const __m256 dmin =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 16)));
      for (int r = 0; r < kRows; ++r) {
        const int32_t* xm = x.mins + r * x.mins_stride + 4 * s;
        __m256i mins = _mm256_setzero_si256();
        for (int p = 0; p < 4; ++p)
          mins = _mm256_add_epi32(mins, _mm256_madd_epi16(m[p], _mm256_set1_epi32(xm[p])));
        minacc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins),
                                    _mm256_mul_ps(dmin, _mm256_set1_ps(x.d[r * x.d_stride + s])),
                                    minacc[r]);
      }
    }
    const __m512 d = _mm512_cvtph_ps(
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o))));
    for (int r = 0; r < kRows; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]),
                               _mm512_mul_ps(d, _mm512_set1_ps(x.d[r * x.d_stride + s])), acc[r]);
  }
  for (int r = 0; r < kRows; ++r) {
    const __m256 halves = _mm256_add_ps(
        _mm512_castps512_ps256(acc[r]),
        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1)));
    _mm256_storeu_ps(y + r * ldy, _mm256_sub_ps(halves, minacc[r]));
  }
}

// y[r * ldy + 8 g + i] = dot(x row r, weight row 8 g + i) for the groups [g0, g1) of `w` (the
// weight's first group) and every row of x.
template <int64_t kType>
void x8_groups(const X8Rows& x, int64_t M, int64_t K, const uint8_t* w, float* y, int64_t ldy,
               int64_t g0, int64_t g1, const PrefetchWindow& prefetch) {
  const int64_t nsb = K / 256, group_bytes = nsb * kGroupBytes<kType>;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wg = w + g * group_bytes;
    for (int64_t r0 = 0; r0 < M; r0 += kTileRows) {
      const X8Rows xt = x.from(r0);
      float* yt = y + r0 * ldy + 8 * g;
      const bool first = r0 == 0;  // the weights come from memory once, for the first tile
      switch (std::min<int64_t>(kTileRows, M - r0)) {
        case 1: x8_group_tile<kType, 1>(xt, nsb, wg, yt, ldy, first, prefetch); break;
        case 2: x8_group_tile<kType, 2>(xt, nsb, wg, yt, ldy, first, prefetch); break;
        case 3: x8_group_tile<kType, 3>(xt, nsb, wg, yt, ldy, first, prefetch); break;
        default: x8_group_tile<kType, 4>(xt, nsb, wg, yt, ldy, first, prefetch); break;
      }
    }
  }
}

template <int64_t kType>
void x8_grouped_typed(const float* x, const int64_t* starts, int64_t groups, int64_t K,
                      const uint8_t* const* weights, int64_t N, float* y) {
  const X8Rows xr = prepare_rows<kType>(x, starts[groups], K);
  for_x8_row_groups(starts, groups, K, weights, N, K / 256 * kGroupBytes<kType>,
                    [&](int64_t p, int64_t g0, int64_t g1, const PrefetchWindow& window) {
                      const int64_t r0 = starts[p];
                      x8_groups<kType>(xr.from(r0), starts[p + 1] - r0, K, weights[p],
                                       y + r0 * N, N, g0, g1, window);
                    });
}

template <int64_t kType>
void x8_unpack_typed(const uint8_t* group, int64_t K, uint8_t* codes, int64_t code_stride,
                     float* scales, int16_t* min_codes, float* min_scales, int64_t unit_stride) {
  for (int64_t s = 0; s < K / 256; ++s) {
    const uint8_t* o = group + s * kGroupBytes<kType>;
    for (int q = 0; q < 16; ++q)  // chunk q: weights 16 q .. 16 q + 15
      store_chunk_rows(chunk_codes<kType>(o, q, 0), chunk_codes<kType>(o, q, 1),
                       codes + s * 256 + 16 * q, code_stride);
    for (int r = 0; r < 8; ++r) {
      const float d = half_to_float(load_u16(o + 2 * r));
      if constexpr (kType == kQ6_K) {
        for (int q = 0; q < 16; ++q)
          scales[r * unit_stride + 16 * s + q] =
              d * static_cast<float>(static_cast<int8_t>(o[16 + 8 * q + r]));
        continue;
      }
      min_scales[r * unit_stride + s] = -half_to_float(load_u16(o + 16 + 2 * r));
      for (int j = 0; j < 8; ++j) {
        scales[r * unit_stride + 8 * s + j] = d * static_cast<float>(o[32 + 8 * j + r]);
        min_codes[r * unit_stride + 8 * s + j] = o[96 + 16 * (j / 2) + 2 * r + j % 2];
      }
    }
  }
}
#endif

}  // namespace

bool x8_linear(int64_t type, const float* x, int64_t M, int64_t K, const uint8_t* qw, int64_t N,
               float* y) {
  const int64_t starts[2] = {0, M};
  return x8_linear_grouped(type, x, starts, 1, K, &qw, N, y);
}

bool x8_linear_grouped(int64_t type, const float* x, const int64_t* starts, int64_t groups,
                       int64_t K, const uint8_t* const* weights, int64_t N, float* y) {
#if defined(HYBRIDLLM_Q8_AVX512)
  return dispatch_gguf_type<kX8Kernels>(
      type,
      [&](auto source) {
        constexpr int64_t kType = decltype(source)::value;
        if constexpr (!x8_source_built(kType))
          return false;
        else if constexpr (is_block_x8_source(kType))
          block_x8_linear_grouped(kType, x, starts, groups, K, weights, N, y);
        else if constexpr (is_code_x8_source(kType))
          code_x8_linear_grouped(kType, x, starts, groups, K, weights, N, y);
        else
          x8_grouped_typed<kType>(x, starts, groups, K, weights, N, y);
        return true;
      },
      [] { return false; });
#elif defined(HYBRIDLLM_X8_AVX2)
  const int64_t source = x8_source_type(type);
  if (!x8_source_built(source)) return false;
  if (is_code_x8_source(source))
    code_x8_linear_grouped(source, x, starts, groups, K, weights, N, y);
  else if (is_grid_x8_source(source))
    grid_x8_linear_grouped(source, x, starts, groups, K, weights, N, y);
  else if (is_block_x8_source(source))
    block_x8_linear_grouped(source, x, starts, groups, K, weights, N, y);
  else
    avx2_x8_linear_grouped(source, x, starts, groups, K, weights, N, y);
  return true;
#else
  (void)type, (void)x, (void)starts, (void)groups, (void)K, (void)weights, (void)N, (void)y;
  return false;
#endif
}

void x8_unpack_group(int64_t type, const uint8_t* group, int64_t K, uint8_t* codes,
                     int64_t code_stride, float* scales, int16_t* min_codes, float* min_scales,
                     int64_t unit_stride) {
#if defined(HYBRIDLLM_Q8_AVX512)
  const bool done = dispatch_gguf_type<kX8Kernels>(
      type,
      [&](auto source) {
        constexpr int64_t kType = decltype(source)::value;
        if constexpr (!x8_source_built(kType))
          return false;
        else if constexpr (is_block_x8_source(kType))
          block_x8_unpack_group(kType, group, K, codes, code_stride, scales, min_scales,
                                unit_stride);
        else if constexpr (is_code_x8_source(kType))
          code_x8_unpack_group(kType, group, K, codes, code_stride, scales, min_codes, min_scales,
                               unit_stride);
        else
          x8_unpack_typed<kType>(group, K, codes, code_stride, scales, min_codes, min_scales,
                                 unit_stride);
        return true;
      },
      [] { return false; });
  if (done) return;
#elif defined(HYBRIDLLM_X8_AVX2)
  const int64_t source = x8_source_type(type);
  if (x8_source_built(source)) {
    if (is_code_x8_source(source))
      code_x8_unpack_group(source, group, K, codes, code_stride, scales, min_codes, min_scales,
                           unit_stride);
    else if (is_grid_x8_source(source))
      grid_x8_unpack_group(source, group, K, codes, code_stride, scales, unit_stride);
    else if (is_block_x8_source(source))
      block_x8_unpack_group(source, group, K, codes, code_stride, scales, min_scales, unit_stride);
    else
      avx2_x8_unpack_group(source, group, K, codes, code_stride, scales, min_codes, min_scales,
                           unit_stride);
    return;
  }
#else
  (void)group, (void)K, (void)codes, (void)code_stride, (void)scales, (void)min_codes;
  (void)min_scales, (void)unit_stride;
#endif
  TORCH_CHECK(false, "x8 weights of type ", type, " have no unpacking in this build");
}

}  // namespace hybridllm_gguf

TORCH_LIBRARY_IMPL(hybridllm, CPU, m) {
  m.impl("repack_x8", &hybridllm_gguf::repack_x8);
  m.impl("unpack_x8", &hybridllm_gguf::unpack_x8);
}

// Without a tensor argument (schema in torch_bindings.cpp): for every dispatch key.
TORCH_LIBRARY_IMPL(hybridllm, CompositeImplicitAutograd, m) {
  m.impl("x8_source_types", [] {
    std::vector<int64_t> types;
    for (int64_t type = 0; type < 256; ++type)  // every ggml type id
      if (hybridllm_gguf::x8_source_built(type)) types.push_back(type);
    return types;
  });
}
