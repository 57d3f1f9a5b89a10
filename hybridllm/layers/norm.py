"""Normalization layers: RMSNorm (with the fused residual add) and LayerNorm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm; `forward(x, residual)` first adds the residual and returns both.

    Deferring the residual add into the next norm (as vLLM does) lets a pipeline stage hand
    `(hidden_states, residual)` to the next one without materialising their sum twice.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.eps = eps
        self.normalized_shape = (hidden_size,)
        self.native = False  # CPU: the compiled hybridllm::rms_norm ops (see use_native_op)

    def use_native_op(self) -> None:
        """Run the compiled CPU ops (one pass per row; F.rms_norm's several ATen ops cost
        ~35 us per call at one token). Call only when `load_cpu_kernels()` is True."""
        self.native = True

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # x: [..., hidden]; variance in fp32 for half types on every path
        if self.native and residual is None and x.stride(-1) == 1:
            # also a strided x: Qwen3's per-head q and k, views into the qkv output
            return torch.ops.hybridllm.rms_norm(x, self.weight, self.eps)
        if self.native and residual is not None and x.is_contiguous() and residual.is_contiguous():
            return torch.ops.hybridllm.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)
        x = x + residual
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps), x


class LayerNorm(nn.Module):
    """LayerNorm whose affine parameters are optional (OPT's `layer_norm_elementwise_affine`)."""

    def __init__(
        self,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
    ):
        super().__init__()
        self.normalized_shape = (hidden_size,)
        self.eps = eps
        if elementwise_affine:
            self.weight = nn.Parameter(
                torch.empty(hidden_size, dtype=dtype, device=device), requires_grad=False
            )
            self.bias = nn.Parameter(
                torch.empty(hidden_size, dtype=dtype, device=device), requires_grad=False
            )
        else:
            self.weight = None
            self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
