"""SiLU-gated MLP (Llama family): down(silu(gate(x)) * up(x)) with gate/up fused in one matmul."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from hybridllm.layers.tensor_parallel import column_linear, local_range, row_linear

if TYPE_CHECKING:
    from hybridllm.distributed.parallel_groups import TPGroup


class GatedMLP(nn.Module):
    """Under tensor parallelism gate/up keep this rank's intermediate columns and down_proj
    sums the ranks' partial outputs."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        hidden_act: str,
        dtype: torch.dtype,
        device: torch.device,
        tp_group: TPGroup | None = None,
    ):
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"GatedMLP supports hidden_act='silu' only, got {hidden_act!r}")
        cols = local_range(intermediate_size, tp_group)
        self.intermediate_size = cols[1] - cols[0]  # this rank's share
        self.gate_up_proj = column_linear(
            hidden_size, (intermediate_size,) * 2, (cols, cols), bias, dtype, device, tp_group
        )
        self.down_proj = row_linear(
            intermediate_size, cols, hidden_size, bias, dtype, device, tp_group
        )
        self.native = False  # CPU: the compiled hybridllm::silu_and_mul (see use_native_op)

    def use_native_op(self) -> None:
        """Run the compiled CPU op: one pass over gate/up instead of F.silu, a temporary and a
        multiply. Call only when `load_cpu_kernels()` is True."""
        self.native = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate]
        if self.native and gate_up.dim() == 2 and gate_up.is_contiguous():
            return self.down_proj(torch.ops.hybridllm.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))
