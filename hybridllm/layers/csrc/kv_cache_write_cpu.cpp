// Writes a step's keys and values into their slots of the paged KV cache, for CPU workers: one
// copy per token and head straight from the strided views of the qkv output (index_copy_ from
// such a view ran ~4x slower than from a dense tensor). A 16-bit cache (kv_cache_dtype) under
// fp32 keys and values takes them rounded to its dtype on the way in.
// Registered as hybridllm::write_kv_cache.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

// One head's `dim` values from fp32 into the cache's 16-bit dtype.
template <typename cache_t>
void convert_head(cache_t* dst, const float* src, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<cache_t>(src[d]);
}

// Token i's key and value heads into slot slot[i] (rows of row_bytes; values value_offset
// bytes after the keys), copied as they are or, for src_t float into a 16-bit cache_t,
// converted.
template <typename cache_t, typename src_t>
void copy_rows(char* cache, int64_t value_offset, int64_t row_bytes, const at::Tensor& key,
               const at::Tensor& value, const int64_t* slot, int64_t n, int64_t heads,
               int64_t dim) {
  const src_t* k = key.data_ptr<src_t>();
  const src_t* v = value.data_ptr<src_t>();
  const int64_t k_token = key.stride(0), k_head = key.stride(1);
  const int64_t v_token = value.stride(0), v_head = value.stride(1);
  // a decode step's rows (a few KB each) are copied on this thread; prefill chunks in parallel
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      cache_t* dk = reinterpret_cast<cache_t*>(cache + slot[i] * row_bytes);
      cache_t* dv = reinterpret_cast<cache_t*>(cache + value_offset + slot[i] * row_bytes);
      for (int64_t h = 0; h < heads; ++h) {
        const src_t* sk = k + i * k_token + h * k_head;
        const src_t* sv = v + i * v_token + h * v_head;
        if constexpr (std::is_same_v<cache_t, src_t>) {
          std::memcpy(dk + h * dim, sk, dim * sizeof(cache_t));
          std::memcpy(dv + h * dim, sv, dim * sizeof(cache_t));
        } else {
          convert_head(dk + h * dim, sk, dim);
          convert_head(dv + h * dim, sv, dim);
        }
      }
    }
  });
}

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
    TORCH_CHECK(t->scalar_type() == kv_cache.scalar_type() ||
                    (t->scalar_type() == at::kFloat &&
                     (kv_cache.scalar_type() == at::kHalf ||
                      kv_cache.scalar_type() == at::kBFloat16)),
                "write_kv_cache: key/value (", t->scalar_type(), ") must have kv_cache's dtype (",
                kv_cache.scalar_type(), "), or be float32 over a float16/bfloat16 cache");
  }
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "write_kv_cache: key (",
              key.scalar_type(), ") and value (", value.scalar_type(), ") dtypes differ");
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
  const int64_t value_offset = slots * row_bytes;
  if (key.scalar_type() != kv_cache.scalar_type()) {
    AT_DISPATCH_REDUCED_FLOATING_TYPES(kv_cache.scalar_type(), "write_kv_cache", [&] {
      copy_rows<scalar_t, float>(cache, value_offset, row_bytes, key, value, slot, n, heads, dim);
    });
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, kv_cache.scalar_type(),
                                  "write_kv_cache", [&] {
    copy_rows<scalar_t, scalar_t>(cache, value_offset, row_bytes, key, value, slot, n, heads, dim);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(hybridllm, CPU, m) {
  m.impl("write_kv_cache", &write_kv_cache);
}
