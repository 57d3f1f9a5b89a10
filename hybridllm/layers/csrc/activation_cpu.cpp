// SiLU-gated activation for CPU: out = silu(gate) * up over x = [gate | up] in one pass, instead
// of F.silu plus an in-place multiply (two passes and a temporary; 46 us a call at [64, 3072]
// against 26 us here, measured). Registered as hybridllm::silu_and_mul; built on first use by
// hybridllm/layers/cpu_kernels.py.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "vec_math.h"

namespace {

// rows [begin, end) of x [rows, 2 * width] -> out [rows, width], fp32 math
template <typename scalar_t>
void silu_and_mul_rows(const scalar_t* x, scalar_t* out, int64_t begin, int64_t end,
                       int64_t width) {
  for (int64_t r = begin; r < end; ++r) {
    const scalar_t* gate = x + r * 2 * width;
    const scalar_t* up = gate + width;
    scalar_t* orow = out + r * width;
    int64_t i = 0;
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<scalar_t, float>)  // 16 at a time (vec_math.h: 4x GCC's loop)
      for (; i + 16 <= width; i += 16)
        _mm512_storeu_ps(orow + i, _mm512_mul_ps(hybridllm_math::silu16(_mm512_loadu_ps(gate + i)),
                                                 _mm512_loadu_ps(up + i)));
#elif defined(__AVX2__) && defined(__FMA__)
    if constexpr (std::is_same_v<scalar_t, float>)  // 8 at a time (vec_math.h's silu8)
      for (; i + 8 <= width; i += 8)
        _mm256_storeu_ps(orow + i, _mm256_mul_ps(hybridllm_math::silu8(_mm256_loadu_ps(gate + i)),
                                                 _mm256_loadu_ps(up + i)));
#endif
#pragma omp simd
    for (int64_t j = i; j < width; ++j)
      orow[j] = static_cast<scalar_t>(hybridllm_math::silu(static_cast<float>(gate[j])) *
                                      static_cast<float>(up[j]));
  }
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "silu_and_mul: x must be a CPU tensor, got ", x.device());
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "silu_and_mul: x must be a contiguous 2-D ",
              "[tokens, 2 * intermediate], got sizes ", x.sizes());
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul: the last dim must be even, got ", x.size(1));
  const int64_t rows = x.size(0), width = x.size(1) / 2;
  at::Tensor out = at::empty({rows, width}, x.options());
  // a grain of whole rows worth ~16k elements: small steps stay on the calling thread
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      silu_and_mul_rows<scalar_t>(in, o, begin, end, width);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(hybridllm, CPU, m) {
  m.impl("silu_and_mul", &silu_and_mul);
}
