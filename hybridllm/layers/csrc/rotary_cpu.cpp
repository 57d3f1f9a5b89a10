// Rotary position embedding (rotate-half layout) applied in place, for CPU workers: one pass
// over q and k instead of torch's cat + mul_ + addcmul_ (three passes and a temporary).
// Registered as the torch op hybridllm::rotary_embedding_.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

namespace {

// x[i, h, :] = x * cos + swap_halves(x) * sin_signed for every token i and head h; the
// tables hold one row of head_dim values per token (rows cs_stride apart).
template <typename scalar_t>
void rotary_kernel(scalar_t* x, int64_t tokens, int64_t heads, int64_t dim, int64_t token_stride,
                   int64_t head_stride, const scalar_t* cos, const scalar_t* sin,
                   int64_t cs_stride) {
  const int64_t half = dim / 2;
  // ~100 heads a grain: a decode step's 64 tokens x 12 heads wake both threads
  const int64_t grain = std::max<int64_t>(1, 128 / std::max<int64_t>(heads, 1));
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const scalar_t* c = cos + i * cs_stride;
      const scalar_t* s = sin + i * cs_stride;
      for (int64_t h = 0; h < heads; ++h) {
        scalar_t* row = x + i * token_stride + h * head_stride;
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) {
          const float a = static_cast<float>(row[d]), b = static_cast<float>(row[d + half]);
          row[d] = static_cast<scalar_t>(a * static_cast<float>(c[d]) +
                                         b * static_cast<float>(s[d]));
          row[d + half] = static_cast<scalar_t>(b * static_cast<float>(c[d + half]) +
                                                a * static_cast<float>(s[d + half]));
        }
      }
    }
  });
}

void rotary_embedding_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rotary_embedding_: x must be [tokens, heads, head_dim] with a dense, even last dim");
  TORCH_CHECK(cos.dim() == 3 && sin.sizes() == cos.sizes() && cos.size(0) == x.size(0) &&
                  cos.size(1) == 1 && cos.size(2) == x.size(2) && cos.stride(2) == 1 &&
                  sin.stride(2) == 1 && sin.stride(0) == cos.stride(0),
              "rotary_embedding_: cos and sin must be [tokens, 1, head_dim] with dense rows");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary_embedding_: x, cos and sin dtypes differ");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    rotary_kernel<scalar_t>(x.data_ptr<scalar_t>(), x.size(0), x.size(1), x.size(2), x.stride(0),
                            x.stride(1), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
                            cos.stride(0));
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(hybridllm, CPU, m) {
  m.impl("rotary_embedding_", &rotary_embedding_);
}
