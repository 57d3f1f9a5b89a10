// The CodeBlockDecoder (gguf_code_blocks.h) of each grid type: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS,
// IQ2_S, IQ3_XXS, IQ3_S, whose weights are groups of 4 or 8 values looked up in a grid
// (gguf_iq_grids.h) with signs.
#pragma once

#include <cstdint>
#include <cstring>

#include "gguf_code_blocks.h"

namespace hybridllm_gguf {}  // namespace hybridllm_gguf
