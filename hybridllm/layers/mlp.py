"""Gated MLP (Llama family): down(act(gate(x)) * up(x)) with gate/up fused in one matmul."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from hybridllm.layers.tensor_parallel import column_linear, local_range, row_linear

if TYPE_CHECKING:
    from hybridllm.distributed.parallel_groups import TPGroup


_GATES = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),  # Gemma
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}
GATED_ACTIVATIONS = (*_GATES, "swigluoai")


@dataclass(frozen=True)
class ExpertActivation:
    """How a gated block combines its gate and up halves [..., 2I] -> [..., I].

    "silu"/"gelu_pytorch_tanh": act(gate) * up. "swigluoai" (gpt-oss): gate clamped above at
    `limit`, up to [-limit, limit], then gate * sigmoid(alpha * gate) * (up + 1).
    """

    name: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        if self.name not in GATED_ACTIVATIONS:
            raise ValueError(
                f"unsupported gated activation {self.name!r}; supported: {GATED_ACTIVATIONS}"
            )

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        if self.name != "swigluoai":
            return _GATES[self.name](gate).mul_(up)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (gate * torch.sigmoid(gate * self.alpha)).mul_(up + 1)


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
        self.activation = ExpertActivation(hidden_act)
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
        silu = self.activation.name == "silu"
        if silu and self.native and gate_up.dim() == 2 and gate_up.is_contiguous():
            return self.down_proj(torch.ops.hybridllm.silu_and_mul(gate_up))
        return self.down_proj(self.activation(gate_up))
