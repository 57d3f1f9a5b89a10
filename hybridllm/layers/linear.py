"""Linear layer built without init cost; several HF projections may be stacked into one matmul."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from hybridllm.layers.gguf_linear import (
    GGML_F32,
    X8_SOURCE_TYPES,
    default_activations,
    gguf_linear,
    repack_x8_where_grouped,
    unpack_x8,
)
from hybridllm.loader.gguf_dequant import dequantize
from hybridllm.loader.quantized_tensor import QuantizedTensor


def cpu_bf16_packing_supported() -> bool:
    """Whether oneDNN can run bf16 linears from prepacked weights on this CPU."""
    try:
        return (
            torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        )
    except (AttributeError, RuntimeError):  # builds without these private ops
        return False


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """A copy of `weight` [out, in] in oneDNN's blocked layout, for `packed_linear` only.

    The result keeps the shape and dtype but not the meaning of a plain tensor.
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


def packed_linear(
    x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    # bf16 on CPU: about twice F.linear's speed for decode-sized inputs (memory-bound GEMV)
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


def f32_kernel_applies(weight: torch.Tensor | None, qweight: torch.Tensor | None) -> bool:
    """An fp32 CPU weight not already computed from blocks, its rows whole 32-float blocks."""
    return (
        qweight is None
        and weight is not None
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.shape[1] % 32 == 0
        and weight.is_contiguous()
    )


class Linear(nn.Module):
    """`y = x @ W.T + b` where W stacks `output_sizes` row blocks (e.g. q, k, v -> qkv).

    Weights start as `torch.empty`; `load_shard` copies one HF projection into its rows.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int] | int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        sizes = (output_sizes,) if isinstance(output_sizes, int) else tuple(output_sizes)
        self.in_features = in_features
        self.output_sizes = sizes
        self.out_features = sum(sizes)
        self.offsets = tuple(sum(sizes[:i]) for i in range(len(sizes)))
        self.weight = nn.Parameter(
            torch.empty(self.out_features, in_features, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.bias = (
            nn.Parameter(
                torch.empty(self.out_features, dtype=dtype, device=device), requires_grad=False
            )
            if bias
            else None
        )
        self.packed = False
        # GGUF blocks [out, bytes_per_row] uint8, when the weight is computed from them (for an
        # fp32 weight the native op reads: its own bytes, ggml_type F32)
        self.register_buffer("qweight", None, persistent=False)
        self.ggml_type = -1
        # the native op's `activations` for the blocks: the engine config's, set after loading
        # (read each call, so a plain attribute)
        self.activations = default_activations()
        # stacked projections whose blocks differ in type: (blocks, ggml type, rows) a shard
        self.shard_blocks: list[tuple[torch.Tensor, int, int]] = []
        self._pending_blocks: dict[int, QuantizedTensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.local_linear(x, self.bias)

    def local_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`x @ W.T + bias` from whichever form of the weight this layer holds."""
        if self.qweight is not None:
            y = gguf_linear(x, self.qweight, self.ggml_type, self.out_features, self.activations)
            return y if bias is None else y + bias
        if self.shard_blocks:
            # [n, out]: each shard's rows from its own blocks, side by side
            activations = self.activations
            y = torch.cat(
                [gguf_linear(x, q, t, rows, activations) for q, t, rows in self.shard_blocks], -1
            )
            return y if bias is None else y + bias
        if self.packed:
            return packed_linear(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def block_shards(self) -> tuple[list[torch.Tensor], list[int]] | None:
        """The weight's blocks as the native decode layer takes them: its one tensor of blocks,
        or one a shard ([rows, bytes] each, side by side in the output); None without blocks."""
        if self.qweight is not None:
            return [self.qweight], [self.ggml_type]
        if self.shard_blocks:
            return [q for q, _, _ in self.shard_blocks], [t for _, t, _ in self.shard_blocks]
        return None

    def dense_weight(self) -> torch.Tensor:
        """The weight as floats [out, in], whichever form this layer holds it in (after
        `finish_loading`): GGUF blocks are decoded, a plain weight is returned as is."""
        if self.packed:
            raise ValueError("a oneDNN-packed weight cannot be read back as a dense matrix")
        if self.ggml_type == GGML_F32 or (self.qweight is None and not self.shard_blocks):
            return self.weight.detach()
        if self.qweight is not None:
            return _decode_blocks(self.qweight, self.ggml_type, self.out_features, self.in_features)
        return torch.cat(
            [_decode_blocks(q, t, rows, self.in_features) for q, t, rows in self.shard_blocks]
        )

    def use_f32_kernel(self) -> None:
        """Compute an fp32 weight with the native op (after loading; no loads afterwards)."""
        if f32_kernel_applies(self.weight, self.qweight):
            self.qweight = self.weight.detach().view(torch.uint8)  # [out, in * 4], shared
            self.ggml_type = GGML_F32

    def repack_for_cpu(self) -> None:
        """Blocks of a type with an x8 form (of rows in whole groups of 8) into the int8 kernels'
        x8 layout (after loading, on a CPU worker computing with int8 activations; see
        `x8_repacking`)."""
        if self.qweight is not None:
            self.qweight, self.ggml_type = repack_x8_where_grouped(
                self.qweight, self.ggml_type, self.out_features
            )
        self.shard_blocks = [
            (*repack_x8_where_grouped(q, t, rows), rows) for q, t, rows in self.shard_blocks
        ]

    def pack_for_cpu(self) -> None:
        """Switch to oneDNN's prepacked bf16 layout (after loading; no loads afterwards)."""
        if not self.packed and self.qweight is None and not self.shard_blocks:
            self.weight = nn.Parameter(pack_linear_weight(self.weight), requires_grad=False)
            self.packed = True

    def load_shard(
        self, kind: str, shard: int, loaded: torch.Tensor | QuantizedTensor, name: str = ""
    ) -> None:
        """Copy (with dtype conversion) one projection's `weight` or `bias` into its rows.

        GGUF blocks (`QuantizedTensor`) wait for `finish_loading`, which keeps or decodes them.
        """
        what = name or f"{kind} shard {shard}"
        if self.packed:
            raise ValueError(f"cannot load {what} into a packed Linear: load before packing")
        target = self.weight if kind == "weight" else self.bias
        if target is None:
            raise ValueError(f"{what}: this Linear has no {kind}")
        if isinstance(loaded, QuantizedTensor) and kind != "weight":
            loaded = loaded.dequantize()
        start, size = self.offsets[shard], self.output_sizes[shard]
        rows = target[start : start + size]
        if tuple(loaded.shape) != tuple(rows.shape):
            raise ValueError(
                f"weight {what}: expected shape {tuple(rows.shape)}, got {tuple(loaded.shape)}"
            )
        if isinstance(loaded, QuantizedTensor):
            # kept or dequantized in finish_loading; copied now, while the loader has the
            # file's pages in memory (it drops them once this returns, see GGUFSource)
            self._pending_blocks[shard] = loaded.copy()
            return
        rows.copy_(loaded)

    def finish_loading(self) -> None:
        """Keep GGUF blocks when every weight shard came as blocks, else decode them.

        Stacked projections (q, k, v) of one block type share one matmul; of several types (a
        Q4_K_M file's Q6_K v beside Q4_K q and k) each shard runs from its own blocks.
        """
        pending, self._pending_blocks = self._pending_blocks, {}
        if not pending:
            return
        types = {q.ggml_type for q in pending.values()}
        if len(pending) == len(self.output_sizes):
            shards = [pending[shard] for shard in range(len(self.output_sizes))]
            if len(types) == 1:
                # stacked shards side by side (one shard: its copy as it is)
                raw = shards[0].raw if len(shards) == 1 else np.concatenate([b.raw for b in shards])
                self.qweight = torch.from_numpy(raw).to(self.weight.device)
                self.ggml_type = int(types.pop())
            else:
                self.shard_blocks = [
                    (
                        torch.from_numpy(blocks.raw).to(self.weight.device),
                        int(blocks.ggml_type),
                        rows,
                    )
                    for blocks, rows in zip(shards, self.output_sizes)
                ]
            # the float weight was never written (torch.empty): free its address space
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
            return
        for shard, blocks in pending.items():
            start, size = self.offsets[shard], self.output_sizes[shard]
            self.weight[start : start + size].copy_(blocks.dequantize())


def _decode_blocks(blocks: torch.Tensor, ggml_type: int, rows: int, cols: int) -> torch.Tensor:
    """GGUF blocks [rows, bytes_per_row] uint8 -> float weights [rows, cols]."""
    if ggml_type in X8_SOURCE_TYPES:
        blocks, ggml_type = unpack_x8(blocks.cpu(), ggml_type)
    return dequantize(blocks.cpu().numpy(), GGMLQuantizationType(ggml_type), (rows, cols))
