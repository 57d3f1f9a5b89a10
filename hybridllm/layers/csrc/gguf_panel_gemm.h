// The panel GEMM of hybridllm::gguf_linear for many rows of x (AVX-512 only): y = x W^T with
// the GGUF weight rows decoded panel by panel into fp32 and an outer-product micro-kernel.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "gguf_blocks.h"
#include "vec_avx512.h"

#if defined(__AVX512F__)
#include <cpuid.h>

namespace hybridllm_gguf {

// Many rows of x, AVX-512: a GEMM of our own with the weights decoded on the fly, since BLAS at
// these shapes (M = 64, K = 576) reached only 60-70% of the FMA rate its large GEMMs reach here.
// Vectors run along rows of x, broadcasts along weight rows, so decoded weight rows are used as
// they are (no transpose): x is packed once per call as x^T tiles [K][kPanelM].
constexpr int kPanelM = 32;  // rows of x a micro-kernel call: two 16-lane vectors
// weight rows a panel: 2 x 12 accumulators + 2 x vectors in 32 registers
constexpr int kPanelN = 12;
// Up to this many rows of x the panel GEMM runs; above, BLAS on decoded weights (see
// dequantized_linear), where torch's BLAS is MKL on an Intel CPU. Interleaved A/B over SmolLM2's
// four linear shapes on a Xeon: panels 2.38 vs 3.27 ms at M = 64, even at 96-128, BLAS 2-7% ahead
// from 160 rows on.
constexpr int64_t kPanelMaxRows = 128;

// MKL runs its AVX-512 sgemm kernels only on Intel CPUs; elsewhere it takes its AVX2 ones, half
// the FMA width. On a 2-core AMD EPYC (Zen 5) it reached 190-210 GFLOP/s at SmolLM2's shapes at
// every M, the panel GEMM 400-450 from M = 64 to 2048, so there the panels serve every M.
inline bool blas_has_avx512_kernels() {
  static const bool intel = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    __get_cpuid(0, &eax, &ebx, &ecx, &edx);
    return ebx == 0x756e6547 && edx == 0x49656e69 && ecx == 0x6c65746e;  // "GenuineIntel"
  }();
  return intel;
}

inline int64_t panel_max_rows() {
  return blas_has_avx512_kernels() ? kPanelMaxRows : INT64_MAX;
}
// x^T tiles of one m-block: about 1 MB, so they stay in L2 while every panel passes over them.
constexpr int64_t kPanelBlockBytes = 1 << 20;

using hybridllm_avx512::transpose16;

// xt tile t = rows [32t, 32t + 32) of x transposed: xt[(t * K + k) * 32 + i] = x[32t + i][k],
// zero past M.
inline void pack_x_transposed(const float* x, int64_t M, int64_t K, float* xt) {
  const int64_t tiles = (M + kPanelM - 1) / kPanelM;
  at::parallel_for(0, tiles * 2, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {  // s: one 16-row half of a tile
      const int64_t r0 = s * 16, rows = std::clamp<int64_t>(M - r0, 0, 16);
      float* out = xt + (s / 2) * K * kPanelM + (s % 2) * 16;
      for (int64_t k = 0; k < K; k += 16) {
        __m512 r[16];
        for (int i = 0; i < 16; ++i)
          r[i] = i < rows ? _mm512_loadu_ps(x + (r0 + i) * K + k) : _mm512_setzero_ps();
        transpose16(r);
        for (int i = 0; i < 16; ++i) _mm512_store_ps(out + (k + i) * kPanelM, r[i]);
      }
    }
  });
}

// out[j * kPanelM + i] = dot(x row i of the tile, decoded weight row j), for kCols weight rows
// (w: [kCols][K]) against one x^T tile ([K][kPanelM]).
template <int kCols>
inline void panel_kernel(const float* xt, const float* w, int64_t K, float* out) {
  __m512 acc[kCols][2];
  for (int j = 0; j < kCols; ++j) acc[j][0] = acc[j][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 x0 = _mm512_load_ps(xt + k * kPanelM), x1 = _mm512_load_ps(xt + k * kPanelM + 16);
#pragma GCC unroll 12
    for (int j = 0; j < kCols; ++j) {
      const __m512 wv = _mm512_set1_ps(w[j * K + k]);
      acc[j][0] = _mm512_fmadd_ps(wv, x0, acc[j][0]);
      acc[j][1] = _mm512_fmadd_ps(wv, x1, acc[j][1]);
    }
  }
  for (int j = 0; j < kCols; ++j) {
    _mm512_store_ps(out + j * kPanelM, acc[j][0]);
    _mm512_store_ps(out + j * kPanelM + 16, acc[j][1]);
  }
}

template <int... kCols>
inline void panel_kernel_dispatch(int cols, const float* xt, const float* w, int64_t K, float* out,
                                  std::integer_sequence<int, kCols...>) {
  ((cols == kCols + 1 ? panel_kernel<kCols + 1>(xt, w, K, out) : void()), ...);
}

template <int64_t kType>
void panel_linear(const float* x, int64_t M, int64_t K, const uint8_t* qw, int64_t N, float* y) {
  constexpr int64_t bb = block_bytes(kType);
  const int64_t nb = K / kBlock, row_bytes = row_bytes_of(kType, K);
  const int64_t tiles = (M + kPanelM - 1) / kPanelM;
  float* xt = thread_scratch<kPackedXSlot>(tiles * K * kPanelM);
  pack_x_transposed(x, M, K, xt);
  const int64_t block_tiles = std::max<int64_t>(1, kPanelBlockBytes / (K * kPanelM * 4));
  const int64_t panels = (N + kPanelN - 1) / kPanelN;
  const int64_t threads = at::get_num_threads();
  at::parallel_for(0, panels, (panels + threads - 1) / threads, [&](int64_t begin, int64_t end) {
    // decoded weight rows of one panel and their block scales (one tile's results: `out`)
    float* w = thread_scratch<kPanelSlot>(kPanelN * K + 2 * (nb + 16));
    float* d = w + kPanelN * K;
    float* m = d + nb + 16;
    alignas(64) float out[kPanelN * kPanelM];
    for (int64_t t0 = 0; t0 < tiles; t0 += block_tiles) {
      const int64_t t1 = std::min(tiles, t0 + block_tiles);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n0 = p * kPanelN, cols = std::min<int64_t>(kPanelN, N - n0);
        const float* panel = w;  // fp32 weight rows are used where they lie
        if constexpr (kType == kF32)
          panel = reinterpret_cast<const float*>(qw + n0 * row_bytes);
        else
          for (int64_t j = 0; j < cols; ++j)
            dequantize_row<kType>(qw + (n0 + j) * row_bytes, nb, w + j * K, d, m);
        for (int64_t t = t0; t < t1; ++t) {
          panel_kernel_dispatch(static_cast<int>(cols), xt + t * K * kPanelM, panel, K, out,
                                std::make_integer_sequence<int, kPanelN>{});
          const int64_t rows = std::min<int64_t>(kPanelM, M - t * kPanelM);
          float* yt = y + t * kPanelM * N + n0;
          for (int64_t i = 0; i < rows; ++i)
            for (int64_t j = 0; j < cols; ++j) yt[i * N + j] = out[j * kPanelM + i];
        }
      }
    }
  });
}

}  // namespace hybridllm_gguf
#endif
