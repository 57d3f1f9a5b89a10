"""Token embedding and LM head (which may share the embedding's weight when tied)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from hybridllm.layers.cpu_kernels import load_cpu_kernels
from hybridllm.layers.gguf_linear import (
    GGML_F32,
    X8_SOURCE_TYPES,
    default_activations,
    gguf_linear,
    repack_x8_where_grouped,
    unpack_x8,
)
from hybridllm.layers.linear import f32_kernel_applies, pack_linear_weight, packed_linear
from hybridllm.loader.gguf_dequant import dequantize
from hybridllm.loader.quantized_tensor import QuantizedTensor


class VocabEmbedding(nn.Module):
    """The token embedding table, or its GGUF blocks (rows decoded as they are looked up)."""

    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.vocab_size, self.dim, self.dtype = vocab_size, dim, dtype
        self.num_rows = vocab_size  # rows held (a vocab-parallel shard: its own rows only)
        self.weight = nn.Parameter(
            torch.empty(vocab_size, dim, dtype=dtype, device=device), requires_grad=False
        )
        # GGUF blocks [vocab, bytes_per_row] uint8, when rows are decoded from them
        self.register_buffer("qweight", None, persistent=False)
        self.ggml_type = -1

    def use_blocks(self, qweight: torch.Tensor, ggml_type: int, name: str) -> None:
        """Look rows up in GGUF blocks [vocab, bytes_per_row] and drop the float table: a
        tied LM head passes its own blocks, so the table is held once, in 4-8 bits."""
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        expected = (self.num_rows, self.dim // block_size * type_size)
        if tuple(qweight.shape) != expected or self.dim % block_size:
            raise ValueError(
                f"weight {name}: expected blocks {expected} for a [{self.num_rows}, {self.dim}] "
                f"table, got {tuple(qweight.shape)}"
            )
        self.qweight = qweight.to(self.weight.device)
        self.ggml_type = GGMLQuantizationType(ggml_type)
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def use_x8_blocks(self, qweight: torch.Tensor, x8_type: int) -> None:
        """Look rows up in a tied head's blocks repacked into x8 groups (in place of the
        plain blocks, which are then dropped): each row is unpacked from its group."""
        self.qweight, self.ggml_type = qweight, x8_type

    def _blocks_of(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The rows' GGUF blocks [num_tokens, bytes_per_row] and their type."""
        if self.ggml_type not in X8_SOURCE_TYPES:
            return self.qweight.index_select(0, input_ids), int(self.ggml_type)
        n = input_ids.shape[0]
        groups = self.qweight.view(self.num_rows // 8, -1)  # [vocab / 8, 8 * x8 bytes_per_row]
        picked = groups.index_select(0, input_ids.div(8, rounding_mode="floor"))
        source, source_type = unpack_x8(picked.view(n, 8, -1), self.ggml_type)  # [n, 8, bytes]
        return source[torch.arange(n, device=input_ids.device), input_ids % 8], source_type

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            rows, ggml_type = self._blocks_of(input_ids)  # [num_tokens, bytes_per_row]
            if rows.device.type == "cpu" and load_cpu_kernels():
                table = torch.ops.hybridllm.gguf_dequantize(rows, ggml_type, self.dim)
            else:
                table = dequantize(
                    rows.cpu().numpy(), GGMLQuantizationType(ggml_type), (rows.shape[0], self.dim)
                )
            return table.to(device=rows.device, dtype=self.dtype)  # [num_tokens, dim]
        return F.embedding(input_ids, self.weight)  # [num_tokens, dim]


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits; `tied_to` shares an embedding's weight."""

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        dtype: torch.dtype,
        device: torch.device,
        tied_to: VocabEmbedding | None = None,
    ):
        super().__init__()
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(
                torch.empty(vocab_size, dim, dtype=dtype, device=device), requires_grad=False
            )
        self.tied = tied_to is not None
        # where a repack hands a tied embedding the head's new blocks (a bound method, so the
        # embedding is not registered as this module's child too)
        self._share_x8_blocks = tied_to.use_x8_blocks if tied_to is not None else None
        self.packed_weight: torch.Tensor | None = None
        # GGUF blocks [vocab, bytes_per_row] uint8, when the weight is computed from them
        self.register_buffer("qweight", None, persistent=False)
        self.ggml_type = -1
        # the native op's `activations` (as Linear's: the engine config's, set after loading)
        self.activations = default_activations()

    def load_blocks(self, blocks: QuantizedTensor, name: str) -> None:
        """Project from GGUF blocks (a tied embedding then looks its rows up in them too)."""
        if tuple(blocks.shape) != tuple(self.weight.shape):
            raise ValueError(
                f"weight {name}: expected shape {tuple(self.weight.shape)}, got {blocks.shape}"
            )
        self.qweight = blocks.blocks().to(self.weight.device)
        self.ggml_type = int(blocks.ggml_type)
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def use_f32_kernel(self) -> None:
        """Project with the native op from the fp32 table's own bytes (shared with a tied
        embedding)."""
        if f32_kernel_applies(self.weight, self.qweight):
            self.qweight = self.weight.detach().view(torch.uint8)  # [vocab, dim * 4]
            self.ggml_type = GGML_F32

    def repack_for_cpu(self) -> None:
        """The head's blocks (of a type with an x8 form, rows in whole groups of 8) into the x8
        layout, as `Linear.repack_for_cpu`; a tied embedding then looks its rows up in the
        groups, so the table is still held once. On the 1B Q4_K_M file's tied Q6_K table
        (49,152 x 2048, 82.6 MB) one row of x took 3.9 ms against 6.8 ms from the plain rows."""
        if self.qweight is None:
            return
        qweight, ggml_type = repack_x8_where_grouped(
            self.qweight, self.ggml_type, self.qweight.shape[0]
        )
        if qweight is self.qweight:
            return
        self.qweight, self.ggml_type = qweight, ggml_type
        if self._share_x8_blocks is not None:
            self._share_x8_blocks(qweight, ggml_type)

    def pack_for_cpu(self) -> None:
        """Use oneDNN's prepacked bf16 layout; a tied head packs a copy (the embedding
        still needs the plain table), an untied one drops its plain weight."""
        if self.packed_weight is None and self.qweight is None:
            self.packed_weight = pack_linear_weight(self.weight)
            if not self.tied:
                self.weight = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # [n, dim] -> [n, vocab] float32 (the sampler works in fp32)
        if self.qweight is not None:
            # fp32 in, so the logits never pass through a narrower activation dtype
            return gguf_linear(
                hidden_states.float(),
                self.qweight,
                self.ggml_type,
                self.qweight.shape[0],
                self.activations,
            )
        if self.packed_weight is not None:
            return packed_linear(hidden_states, self.packed_weight, None).float()
        return F.linear(hidden_states, self.weight).float()
