// Row-wise argmax for CPU (greedy sampling): torch's argmax over [64, 49152] fp32 logits took
// 3.4 ms here against 0.47 ms for this loop. Same result as torch.argmax(dim=-1): the first
// index of the maximum, and the first NaN when a row has one. Registered as
// hybridllm::argmax_rows; built on first use by hybridllm/layers/cpu_kernels.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

namespace {

int64_t argmax_row(const float* row, int64_t n) {
  // lanes of 16 running maxima (strictly greater wins, so each lane keeps its first index),
  // then the best lane; a NaN anywhere makes the row's answer its first NaN
  constexpr int64_t kLanes = 16;
  float best[kLanes];
  int64_t index[kLanes];
  const int64_t body = n / kLanes * kLanes;
  int nan = 0;
  for (int64_t l = 0; l < kLanes; ++l) {
    best[l] = -INFINITY;
    index[l] = l < n ? l : 0;
  }
  for (int64_t i = 0; i < body; i += kLanes) {
#pragma omp simd reduction(| : nan)
    for (int64_t l = 0; l < kLanes; ++l) {
      const float v = row[i + l];
      nan |= static_cast<int>(v != v);
      const bool greater = v > best[l];
      best[l] = greater ? v : best[l];
      index[l] = greater ? i + l : index[l];
    }
  }
  int64_t result = index[0];
  float result_value = best[0];
  for (int64_t l = 1; l < kLanes; ++l) {
    if (best[l] > result_value || (best[l] == result_value && index[l] < result)) {
      result_value = best[l];
      result = index[l];
    }
  }
  for (int64_t i = body; i < n; ++i) {
    nan |= static_cast<int>(std::isnan(row[i]));
    if (row[i] > result_value) {
      result_value = row[i];
      result = i;
    }
  }
  if (nan) {
    for (int64_t i = 0; i < n; ++i)
      if (std::isnan(row[i])) return i;
  }
  return result;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat,
              "argmax_rows: x must be a float32 CPU tensor, got ", x.scalar_type(), " on ",
              x.device());
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "argmax_rows: x must be 2-D [rows, n > 0], got ",
              x.sizes());
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), n = xc.size(1);
  at::Tensor out = at::empty({rows}, xc.options().dtype(at::kLong));
  const float* data = xc.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(data + r * n, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(hybridllm, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
}
