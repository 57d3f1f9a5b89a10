// hybridllm::gguf_linear's int8-activation path for few rows of x: x quantized once a call
// (gguf_q8_quantize.h), then the weight rows split among threads in contiguous runs as in the
// fp32 direct kernel, each run walked in tiles of rows of x by the integer kernels of
// gguf_q8_dot.h.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "gguf_blocks.h"
#include "gguf_prefetch.h"
#include "gguf_x8.h"
#include "gguf_q8_dot.h"
#include "gguf_q8_linear.h"
#include "gguf_q8_quantize.h"
#include "gguf_q8_simd.h"

namespace hybridllm_gguf {
namespace {

constexpr bool is_k_quant(int64_t type) { return type == kQ4_K || type == kQ5_K || type == kQ6_K; }

// Rows of x a tile of the vector paths (q8_rows_simd). Up to this many rows every weight byte is
// read once a call, so the weights stream past L2 and L3 (see start_prefetch): SmolLM2 Q4_1,
// 2 and 4 concurrent decodes (one process switching), 476 -> 494 and 722 -> 756 tok/s, faster
// in 6 of 6 rounds each, against streaming at one row only. 5, not 4: a speculative verify
// step of 4 drafts is 5 rows, one tile (SmolLM2 Q4_1, a layer's four linears at 5 rows: 261 ->
// 221 us; 1 and 4 rows unchanged). Tiles of 4 weight rows are built for 1-2 rows of x only
// (their accumulators fit), which keeps the kernels' build time.
constexpr int64_t kRowTile = 5;

#if defined(HYBRIDLLM_Q8_AVX2)
template <class S, int64_t kType, int kRows, int kCols>
void tile(const Q8Rows& x, const uint8_t* w, int64_t row_bytes, int64_t K, float* y, int64_t ldy,
          const PrefetchWindow& prefetch) {
  if constexpr (is_code_block_type(kType))
    q8_dot_code_blocks<S, kType, kRows, kCols>(x, w, row_bytes, K, y, ldy, prefetch);
  else if constexpr (is_k_quant(kType))
    q8_dot_super_blocks<S, kType, kRows, kCols>(x, w, row_bytes, K, y, ldy, prefetch);
  else
    q8_dot_blocks<S, kType, kRows, kCols>(x, w, row_bytes, K / kBlock, y, ldy, prefetch);
}

template <class S, int64_t kType, int kCols, int... kRows>
void tile_dispatch(int rows, std::integer_sequence<int, kRows...>, const Q8Rows& x,
                   const uint8_t* w, int64_t row_bytes, int64_t K, float* y, int64_t ldy,
                   const PrefetchWindow& prefetch) {
  ((rows == kRows + 1 ? tile<S, kType, kRows + 1, kCols>(x, w, row_bytes, K, y, ldy, prefetch)
                      : void()),
   ...);
}

// The vector paths, for the weight rows [begin, end) of y = x W^T (y's rows N apart). Rows of x a
// tile: kRowTile; weight rows a call: 4 while the tile has 1-2 rows of x (their accumulators
// fit), else 2.
template <class S, int64_t kType>
void q8_rows_simd(const Q8Rows& xq, int64_t M, int64_t K, const uint8_t* qw, int64_t N, float* y,
                  int64_t begin, int64_t end, const PrefetchWindow& prefetch) {
  const int64_t row_bytes = row_bytes_of(kType, K);
  // groups of 16 weight rows, the x tiles outside: a tile's int8 rows and the group's weight
  // bytes stay in cache while every weight row meets every tile
  for (int64_t n0 = begin; n0 < end; n0 += 16) {
    const int64_t count = std::min<int64_t>(16, end - n0);
    for (int64_t r0 = 0; r0 < M; r0 += kRowTile) {
      const int rows = static_cast<int>(std::min<int64_t>(kRowTile, M - r0));
      const Q8Rows x = xq.row(r0);
      const auto run = [&](auto kCols, int64_t i) {
        constexpr int kTileCols = decltype(kCols)::value;
        tile_dispatch<S, kType, kTileCols>(
            rows, std::make_integer_sequence<int, kTileCols == 4 ? 2 : kRowTile>{}, x,
            qw + (n0 + i) * row_bytes, row_bytes, K, y + r0 * N + n0 + i, N, prefetch);
      };
      for (int64_t i = 0; i < count;) {
        const int64_t left = count - i;
        if (rows <= 2 && left >= 4) {
          run(std::integral_constant<int, 4>{}, i);
          i += 4;
        } else if (left >= 2) {
          run(std::integral_constant<int, 2>{}, i);
          i += 2;
        } else {
          run(std::integral_constant<int, 1>{}, i);
          i += 1;
        }
      }
    }
  }
}
#endif

template <int64_t kType>
void q8_rows_scalar(const Q8Rows& xq, int64_t M, int64_t K, const uint8_t* qw, int64_t N, float* y,
                    int64_t begin, int64_t end, const PrefetchWindow&) {
  const int64_t row_bytes = row_bytes_of(kType, K);
  for (int64_t n = begin; n < end; ++n)
    for (int64_t r = 0; r < M; ++r)
      y[r * N + n] = q8_dot_scalar<kType>(xq.row(r), qw + n * row_bytes, K);
}

// The weight rows [begin, end) of y = x W^T on one path.
using RowsFn = void (*)(const Q8Rows&, int64_t, int64_t, const uint8_t*, int64_t, float*, int64_t,
                        int64_t, const PrefetchWindow&);

template <int64_t kType>
RowsFn rows_fn(int64_t path) {
  switch (path) {
#if defined(HYBRIDLLM_Q8_AVX512)
    case kQ8Avx512Vnni:
      return &q8_rows_simd<Avx512Vnni, kType>;
#endif
#if defined(HYBRIDLLM_Q8_AVX2_VNNI)
    case kQ8Avx2Vnni:
      return &q8_rows_simd<Avx2Q8<true>, kType>;
#endif
#if defined(HYBRIDLLM_Q8_AVX2)
    case kQ8Avx2:
      return &q8_rows_simd<Avx2Q8<false>, kType>;
#endif
    default:
      return &q8_rows_scalar<kType>;
  }
}

// x's rows quantized as every path reads them: for the 4-bit 32-weight block types in quads of
// blocks (see q8_dot_blocks) except on the scalar path, which reads them in order.
template <int64_t kType>
Q8Rows quantize_for(int64_t path, const float* x, int64_t M, int64_t K) {
  thread_local std::vector<uint8_t> buffer;  // kept from call to call, as thread_scratch
  constexpr bool kQuads = is_nibble_block_type(kType);
  return path == kQ8Scalar ? quantize_rows<q8_group(kType)>(x, M, K, buffer)
                           : quantize_rows<q8_group(kType), kQuads>(x, M, K, buffer);
}

template <int64_t kType>
void q8_linear_typed(int64_t path, const float* x, int64_t M, int64_t K, const uint8_t* qw,
                     int64_t N, float* y) {
  const Q8Rows xq = quantize_for<kType>(path, x, M, K);
  const RowsFn rows = rows_fn<kType>(path);
  for_weight_rows(qw, row_bytes_of(kType, K), N, K / kBlock * M * N, M <= kRowTile,
                  [&](int64_t begin, int64_t end, const PrefetchWindow& pf) {
                    rows(xq, M, K, qw, N, y, begin, end, pf);
                  });
}

template <int64_t kType>
void q8_linear_grouped_typed(int64_t path, const float* x, const int64_t* starts, int64_t groups,
                             int64_t K, const uint8_t* const* weights, int64_t N, float* y) {
  const int64_t M = starts[groups];
  const Q8Rows xq = quantize_for<kType>(path, x, M, K);
  const RowsFn rows = rows_fn<kType>(path);
  // every group's weight rows one after the other, split among the threads in contiguous runs
  for_grouped_weight_rows(
      weights, row_bytes_of(kType, K), groups, N, K / kBlock * M * N,
      [&](int64_t g) { return starts[g + 1] - starts[g] <= kRowTile; },
      [&](int64_t g, int64_t n0, int64_t n1, const PrefetchWindow& window) {
        const int64_t r0 = starts[g], m = starts[g + 1] - r0;
        if (m > 0) rows(xq.row(r0), m, K, weights[g], N, y + r0 * N, n0, n1, window);
      });
}

}  // namespace

const std::vector<int64_t>& q8_paths() {
  // 64-byte vectors first. On the project's AMD EPYC (Zen 5, KVM guest) a zmm integer op took
  // 3.4-3.9x the time of its ymm form, and in cache the 32-byte Q4_K kernel was faster (5.4 vs
  // 6.8 ns a super-block), but streaming weights from DRAM, as decode does, the 64-byte kernels
  // (half the instructions a byte) read 15% faster: a 1B-shaped Q4_K_M step's linears 26.3 vs
  // 30.2 ms, Q5_K_M 29.5 vs 34.7.
  static const std::vector<int64_t> paths = [] {
    std::vector<int64_t> built;
#if defined(HYBRIDLLM_Q8_AVX512)
    built.push_back(kQ8Avx512Vnni);
#endif
#if defined(HYBRIDLLM_Q8_AVX2_VNNI)
    built.push_back(kQ8Avx2Vnni);
#endif
#if defined(HYBRIDLLM_Q8_AVX2)
    built.push_back(kQ8Avx2);
#endif
    built.push_back(kQ8Scalar);
    return built;
  }();
  return paths;
}

namespace {
int64_t checked_path(int64_t path) {
  const std::vector<int64_t>& paths = q8_paths();
  if (path == kQ8Best) path = paths.front();
  TORCH_CHECK(std::find(paths.begin(), paths.end(), path) != paths.end(), "gguf_linear: int8 path ",
              path, " is not in this build (see gguf_int8_paths())");
  return path;
}

// x8 weights: their own kernels, on the build's best int8 path only
void x8_only(int64_t type, int64_t path, const float* x, const int64_t* starts, int64_t groups,
             int64_t K, const uint8_t* const* weights, int64_t N, float* y) {
  TORCH_CHECK(path == q8_paths().front() &&
                  x8_linear_grouped(type, x, starts, groups, K, weights, N, y),
              "gguf_linear: x8 weights (ggml_type ", type, ") have kernels on int8 path ",
              q8_paths().front(), " of this build only (see x8_source_types()), not path ", path);
}

// what q8_linear and q8_linear_grouped do for a type without int8 kernels
void no_int8_path(int64_t type) {
  TORCH_CHECK(false, "gguf_linear: no int8 path for ggml_type ", type);
}
}  // namespace

void q8_linear(int64_t type, int64_t path, const float* x, int64_t M, int64_t K, const uint8_t* qw,
               int64_t N, float* y) {
  path = checked_path(path);
  if (is_x8_type(type)) {
    const int64_t starts[2] = {0, M};
    x8_only(type, path, x, starts, 1, K, &qw, N, y);
    return;
  }
  dispatch_gguf_type<kInt8Kernels>(
      type, [&](auto t) { q8_linear_typed<decltype(t)::value>(path, x, M, K, qw, N, y); },
      [&] { no_int8_path(type); });
}

void q8_linear_grouped(int64_t type, int64_t path, const float* x, const int64_t* starts,
                       int64_t groups, int64_t K, const uint8_t* const* weights, int64_t N,
                       float* y) {
  path = checked_path(path);
  if (is_x8_type(type)) {
    x8_only(type, path, x, starts, groups, K, weights, N, y);
    return;
  }
  dispatch_gguf_type<kInt8Kernels>(
      type,
      [&](auto t) {
        q8_linear_grouped_typed<decltype(t)::value>(path, x, starts, groups, K, weights, N, y);
      },
      [&] { no_int8_path(type); });
}

}  // namespace hybridllm_gguf
