"""One projection of every expert, stacked [num_experts, rows, cols]: floats or GGUF blocks."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from hybridllm.layers.gguf_linear import (
    GGML_F32,
    default_activations,
    gguf_linear,
    repack_x8_where_grouped,
)
from hybridllm.layers.linear import f32_kernel_applies
from hybridllm.loader.gguf_dequant import dequantize
from hybridllm.loader.quantized_tensor import QuantizedTensor


class StackedExpertWeight(nn.Module):
    """`weight` [E, rows, cols], where each expert's rows stack `part_sizes` (gate | up).

    Loads whole stacks (a transformers-5 `experts.gate_up_proj` [E, 2I, H], a GGUF
    `ffn_gate_exps` [E, I, H] as blocks [E * I, bytes]) or single experts' parts (a checkpoint's
    `experts.3.up_proj`). GGUF blocks, whole stacks or single experts' parts (on-load
    quantization blocks each checkpoint tensor), are copied as they come into `qweight`
    [E, rows, bytes] (an expert's rows are then one contiguous run of blocks that the native op
    reads in place). When every part of every expert came as blocks of one type they are kept;
    otherwise `finish_loading` decodes the blocks that came into `weight`.
    """

    def __init__(
        self,
        num_experts: int,
        part_sizes: Sequence[int],
        in_features: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.num_experts = num_experts
        self.part_sizes = tuple(part_sizes)
        self.part_offsets = tuple(sum(self.part_sizes[:i]) for i in range(len(self.part_sizes)))
        self.rows = sum(self.part_sizes)
        self.in_features = in_features
        # torch.empty: untouched pages cost nothing when the blocks replace it
        self.weight = nn.Parameter(
            torch.empty(num_experts, self.rows, in_features, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.register_buffer("qweight", None, persistent=False)  # [E, rows, bytes] uint8
        self.ggml_type = -1
        # the native op's `activations` (as Linear's: the engine config's, set after loading)
        self.activations = default_activations()
        # blocks gathered while loading: [E, rows, bytes], their type, which (expert, part)
        # came as blocks [E, parts], and whether some blocks of another type were decoded
        self._blocks: np.ndarray | None = None
        self._blocks_type: GGMLQuantizationType | None = None
        self._filled = np.zeros((num_experts, len(self.part_sizes)), dtype=bool)
        self._mixed = False

    def _target(self, part: int | None, expert: int | None) -> torch.Tensor:
        rows = self.weight if expert is None else self.weight[expert]
        if part is None:
            return rows
        start = self.part_offsets[part]
        return rows[..., start : start + self.part_sizes[part], :]

    def load(
        self,
        loaded: torch.Tensor | QuantizedTensor,
        name: str,
        part: int | None = None,
        expert: int | None = None,
    ) -> None:
        """Copy `loaded` into one part (None: all) of one expert (None: every expert).

        Blocks come with the rows of the experts (and parts) they cover one after another
        ([E * part rows, cols] for a whole stack) and are gathered for `finish_loading`.
        """
        target = self._target(part, expert)
        if isinstance(loaded, QuantizedTensor):
            expected = (math.prod(target.shape[:-1]), target.shape[-1])
            if tuple(loaded.shape) != expected:
                raise ValueError(
                    f"weight {name}: expected blocks of shape {expected}, got {loaded.shape}"
                )
            if self._keep_blocks(loaded, part, expert):
                return
            loaded = loaded.dequantize().view(target.shape)  # another type than the rest
        if tuple(loaded.shape) != tuple(target.shape):
            raise ValueError(
                f"weight {name}: expected shape {tuple(target.shape)}, got {tuple(loaded.shape)}"
            )
        target.copy_(loaded)

    def _keep_blocks(self, loaded: QuantizedTensor, part: int | None, expert: int | None) -> bool:
        """Copy `loaded` into the gathered blocks; False when its type differs from theirs."""
        raw = loaded.raw  # [rows covered, bytes], perhaps a read-only view of a file's pages
        if self._blocks is None:
            shape = (self.num_experts, self.rows, raw.shape[1])
            self._blocks = np.empty(shape, dtype=np.uint8)  # pages filled as blocks come
            self._blocks_type = loaded.ggml_type
        elif loaded.ggml_type != self._blocks_type:
            self._mixed = True
            return False
        parts = range(len(self.part_sizes)) if part is None else range(part, part + 1)
        start = self.part_offsets[parts[0]]
        end = self.part_offsets[parts[-1]] + self.part_sizes[parts[-1]]
        experts = slice(None) if expert is None else slice(expert, expert + 1)
        self._blocks[experts, start:end] = raw.reshape(-1, end - start, raw.shape[1])
        self._filled[experts, parts[0] : parts[-1] + 1] = True
        return True

    def finish_loading(self) -> None:
        """Keep the blocks when every part of every expert came as blocks of one type, else
        decode those that came."""
        blocks, ggml_type, filled = self._blocks, self._blocks_type, self._filled
        self._blocks, self._blocks_type = None, None
        self._filled = np.zeros_like(filled)
        if blocks is None:
            return
        if filled.all() and not self._mixed:
            # [E, rows, bytes]: per expert its parts' rows one after another (gate then up)
            self.qweight = torch.from_numpy(blocks).to(self.weight.device)
            self.ggml_type = int(ggml_type)
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
            return
        for expert, part in zip(*np.nonzero(filled)):
            start, size = self.part_offsets[part], self.part_sizes[part]
            floats = dequantize(blocks[expert, start : start + size], ggml_type, (size, -1))
            self._target(int(part), int(expert)).copy_(floats.view(size, -1))

    def use_f32_kernel(self) -> None:
        """Compute an fp32 CPU weight with the native op (its bytes read as F32 blocks)."""
        if self.qweight is None and f32_kernel_applies(self.weight[0], None):
            self.qweight = self.weight.detach().view(torch.uint8)  # [E, rows, cols * 4], shared
            self.ggml_type = GGML_F32

    def repack_for_cpu(self) -> None:
        """Blocks of a type with an x8 form into the int8 kernels' x8 layout (each expert's
        rows in groups of 8)."""
        if self.qweight is not None:
            self.qweight, self.ggml_type = repack_x8_where_grouped(
                self.qweight, self.ggml_type, self.rows
            )

    def matmul(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """`x @ W[expert].T`: x [m, cols] -> [m, rows], reading only this expert's weights."""
        if self.qweight is not None:
            return gguf_linear(x, self.qweight[expert], self.ggml_type, self.rows, self.activations)
        return F.linear(x, self.weight[expert])
