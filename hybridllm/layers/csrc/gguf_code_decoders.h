// The CodeBlockDecoder (gguf_code_blocks.h) of each K-quant type computed as code blocks: Q2_K,
// Q3_K, and IQ4_XS (its non-linear 4-bit values).
#pragma once

#include <cstdint>
#include <cstring>

#include "gguf_code_blocks.h"

namespace hybridllm_gguf {}  // namespace hybridllm_gguf
