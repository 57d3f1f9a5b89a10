"""One projection of every expert, stacked [num_experts, rows, cols]: floats or GGUF blocks."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hybridllm.layers.gguf_linear import (
    GGML_F32,
    default_activations,
    gguf_linear,
    repack_x8_where_grouped,
)
from hybridllm.layers.linear import f32_kernel_applies
from hybridllm.loader.quantized_tensor import QuantizedTensor


class StackedExpertWeight(nn.Module):
    """`weight` [E, rows, cols], where each expert's rows stack `part_sizes` (gate | up).

    Loads whole stacks (a transformers-5 `experts.gate_up_proj` [E, 2I, H], a GGUF
    `ffn_gate_exps` [E, I, H] as blocks [E * I, bytes]) or single experts' parts (a checkpoint's
    `experts.3.up_proj`). GGUF blocks of every part, all of one type, are kept as `qweight`
    [E, rows, bytes] (an expert's rows are then one contiguous run of blocks that the native
    op reads in place); otherwise they are decoded into `weight` at `finish_loading`.
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
        self._pending: dict[int, QuantizedTensor] = {}

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

        Blocks come stacked over experts ([E * part rows, cols]) and wait for `finish_loading`.
        """
        target = self._target(part, expert)
        if isinstance(loaded, QuantizedTensor):
            if part is None or expert is not None:
                loaded = loaded.dequantize()  # only whole stacks of one part stay blocks
            else:
                expected = (target.shape[0] * target.shape[1], target.shape[2])
                if tuple(loaded.shape) != expected:
                    raise ValueError(
                        f"weight {name}: expected blocks of shape {expected}, got {loaded.shape}"
                    )
                self._pending[part] = loaded
                return
        if tuple(loaded.shape) != tuple(target.shape):
            raise ValueError(
                f"weight {name}: expected shape {tuple(target.shape)}, got {tuple(loaded.shape)}"
            )
        target.copy_(loaded)

    def finish_loading(self) -> None:
        """Keep the blocks when every part came as blocks of one type, else decode them."""
        pending, self._pending = self._pending, {}
        if not pending:
            return
        types = {q.ggml_type for q in pending.values()}
        if len(pending) == len(self.part_sizes) and len(types) == 1:
            # [E, rows, bytes]: per expert its parts' rows one after another (gate then up)
            parts = [
                pending[p].raw.reshape(self.num_experts, size, -1)
                for p, size in enumerate(self.part_sizes)
            ]
            # a copy out of the file's pages (the raw rows may be a read-only view of its mmap)
            raw = np.array(parts[0], copy=True) if len(parts) == 1 else np.concatenate(parts, 1)
            self.qweight = torch.from_numpy(raw).to(self.weight.device)
            self.ggml_type = int(types.pop())
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
            return
        for part, blocks in pending.items():
            floats = blocks.dequantize().view(self.num_experts, self.part_sizes[part], -1)
            self._target(part, None).copy_(floats)

    def use_f32_kernel(self) -> None:
        """Compute an fp32 CPU weight with the native op (its bytes read as F32 blocks)."""
        if self.qweight is None and f32_kernel_applies(self.weight[0], None):
            self.qweight = self.weight.detach().view(torch.uint8)  # [E, rows, cols * 4], shared
            self.ggml_type = GGML_F32

    def repack_for_cpu(self) -> None:
        """K-quant blocks into the int8 kernels' x8 layout (each expert's rows in groups of
        8)."""
        if self.qweight is not None:
            self.qweight, self.ggml_type = repack_x8_where_grouped(
                self.qweight, self.ggml_type, self.rows
            )

    def matmul(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """`x @ W[expert].T`: x [m, cols] -> [m, rows], reading only this expert's weights."""
        if self.qweight is not None:
            return gguf_linear(x, self.qweight[expert], self.ggml_type, self.rows, self.activations)
        return F.linear(x, self.weight[expert])
