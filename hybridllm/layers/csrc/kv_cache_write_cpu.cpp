// Writes a step's keys and values into their slots of the paged KV cache, for CPU workers: one
// copy per token and head straight from the strided views of the qkv output (index_copy_ from
// such a view ran ~4x slower than from a dense tensor). Registered as hybridllm::write_kv_cache.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace {

// kv_cache [2, num_blocks, block_size, kv_heads, head_dim]: slot s is row s of the flattened
// [2, num_blocks * block_size, kv_heads * head_dim] view; key/value [n, kv_heads, head_dim].
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                    const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "write_kv_cache: kv_cache must be a contiguous [2, num_blocks, block_size, "
              "kv_heads, head_dim]");
  const int64_t heads = kv_cache.size(3), dim = kv_cache.size(4);
  for (const at::Tensor* t : {&key, &value}) {
    TORCH_CHECK(t->dim() == 3 && t->size(1) == heads && t->size(2) == dim && t->stride(2) == 1 &&
                    t->size(0) == slot_mapping.size(0),
                "write_kv_cache: key and value must be [n, kv_heads, head_dim], one row per "
                "slot, with a dense last dim");
    TORCH_CHECK(t->scalar_type() == kv_cache.scalar_type(),
                "write_kv_cache: key/value and kv_cache dtypes differ");
  }
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.is_contiguous(),
              "write_kv_cache: slot_mapping must be a contiguous int64 [n]");
  const int64_t n = slot_mapping.size(0), slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t row_bytes = heads * dim * kv_cache.element_size();
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(slot[i] >= 0 && slot[i] < slots, "write_kv_cache: slot ", slot[i],
                " out of range [0, ", slots, ")");
  char* cache = static_cast<char*>(kv_cache.data_ptr());
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  const int64_t es = kv_cache.element_size(), head_bytes = dim * es;
  const int64_t k_token = key.stride(0) * es, k_head = key.stride(1) * es;
  const int64_t v_token = value.stride(0) * es, v_head = value.stride(1) * es;
  const int64_t value_offset = slots * row_bytes;
  // a decode step's rows (a few KB each) are copied on this thread; prefill chunks in parallel
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      char* dst = cache + slot[i] * row_bytes;
      for (int64_t h = 0; h < heads; ++h) {
        std::memcpy(dst + h * head_bytes, k + i * k_token + h * k_head, head_bytes);
        std::memcpy(dst + value_offset + h * head_bytes, v + i * v_token + h * v_head, head_bytes);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hybridllm, m) {
  m.def("write_kv_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(hybridllm, CPU, m) {
  m.impl("write_kv_cache", &write_kv_cache);
}
