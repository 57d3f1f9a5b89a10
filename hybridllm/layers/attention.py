"""Paged attention layer: writes this step's K/V to the cache and attends over it.

The backend is chosen by device type: CUDA (Triton decode when available) or plain torch.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridllm.layers.cpu_kernels import load_cpu_kernels
from hybridllm.layers.paged_attention_cpu import TorchPagedAttention
from hybridllm.layers.prepared_attention import PreparedAttention


def get_attention_backend(device: torch.device) -> TorchPagedAttention:
    """The paged-attention implementation for `device` (a stateless object)."""
    if device.type == "cuda":
        # imported lazily: the CUDA module probes for triton at import time
        from hybridllm.layers.paged_attention_cuda import CudaPagedAttention

        return CudaPagedAttention()
    return TorchPagedAttention(native_ops=load_cpu_kernels())


class PagedAttention(nn.Module):
    """Multi-head attention over the paged KV cache; holds no weights but the optional
    attention sinks (one fp32 logit per query head)."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        scale: float | None = None,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        has_sinks: bool = False,
        kv_group: int = 0,
    ):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        # Gemma 2: scores become cap * tanh(scores / cap) before the mask and softmax
        self.logit_softcap = logit_softcap or None
        # gpt-oss: one learned logit per query head (this rank's heads) that joins every
        # softmax's denominator and attends to nothing; the model's weight loader fills it
        self.sinks = (
            nn.Parameter(
                torch.zeros(num_heads, dtype=torch.float32, device=device), requires_grad=False
            )
            if has_sinks
            else None
        )
        # which KV cache group's block tables this layer reads (engine/kv_cache_groups.py)
        self.kv_group = kv_group
        self.backend = get_attention_backend(torch.device(device))

    def use_torch_ops(self) -> None:
        """Attend with torch alone where the backend calls native ops: an engine whose config
        turns the CPU kernels off (the backend is chosen at construction, from whether they
        are built)."""
        if getattr(self.backend, "native_ops", False):
            self.backend = TorchPagedAttention(native_ops=False)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor | None,
        prep: PreparedAttention,
    ) -> torch.Tensor:
        """query [n, H, D], key/value [n, kvh, D] -> [n, H * D]."""
        return self.backend.forward(
            query,
            key,
            value,
            kv_cache,
            prep,
            self.scale,
            self.sliding_window,
            logit_softcap=self.logit_softcap,
            sinks=self.sinks,
        )
