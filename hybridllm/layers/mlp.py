"""SiLU-gated MLP (Llama family): down(silu(gate(x)) * up(x)) with gate/up fused in one matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridllm.layers.linear import Linear


class GatedMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        hidden_act: str,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"GatedMLP supports hidden_act='silu' only, got {hidden_act!r}")
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, (intermediate_size,) * 2, bias, dtype, device)
        self.down_proj = Linear(intermediate_size, hidden_size, bias, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate]
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))
