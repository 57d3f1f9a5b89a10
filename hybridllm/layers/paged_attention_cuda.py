"""CUDA paged attention: a Triton decode kernel when triton is importable, SDPA for prefill.

Without triton (or for shapes the kernel does not cover) every call falls back to the torch
gather path of `TorchPagedAttention`, so this module is safe to import on any machine.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from hybridllm.layers.paged_attention_cpu import TorchPagedAttention
from hybridllm.layers.prepared_attention import PreparedAttention

try:  # triton is optional: absent on CPU-only installs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

_NO_WINDOW = 1 << 30  # a window no sequence reaches: the kernel's "no sliding window"


def triton_available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _paged_decode_kernel(
        out_ptr,
        q_ptr,
        cache_ptr,
        block_tables_ptr,
        seq_lens_ptr,
        scale,
        sliding_window,
        stride_q_tok,
        stride_q_head,
        stride_o_tok,
        stride_o_head,
        stride_c_kv,
        stride_c_block,
        stride_c_tok,
        stride_c_head,
        stride_bt_seq,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        # one program per (decode sequence, kv head): streams that head's blocks once and
        # serves all GROUP query heads sharing it, with an online softmax in fp32
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq_len = tl.load(seq_lens_ptr + seq)
        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        offs_t = tl.arange(0, BLOCK_SIZE)
        g_mask = offs_g < GROUP
        d_mask = offs_d < HEAD_DIM
        heads = kv_head * GROUP + offs_g
        q_ptrs = q_ptr + seq * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :]
        q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
        q = q * scale  # [G, D]

        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
        start = tl.maximum(seq_len - sliding_window, 0)
        for b in range(start // BLOCK_SIZE, tl.cdiv(seq_len, BLOCK_SIZE)):
            block_id = tl.load(block_tables_ptr + seq * stride_bt_seq + b).to(tl.int64)
            pos = b * BLOCK_SIZE + offs_t
            t_mask = (pos < seq_len) & (pos >= start)
            base = cache_ptr + block_id * stride_c_block + kv_head * stride_c_head
            kv_offs = offs_t[:, None] * stride_c_tok + offs_d[None, :]
            kv_mask = t_mask[:, None] & d_mask[None, :]
            k = tl.load(base + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)  # [BS, D]
            v = tl.load(base + stride_c_kv + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G, BS]
            s = tl.where(t_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new
        out = acc / l_i[:, None]
        o_ptrs = out_ptr + seq * stride_o_tok + heads[:, None] * stride_o_head + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


def triton_paged_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """query [B, H, D] -> [B, H, D]; block_tables [>=B, max_blocks] int32, seq_lens [>=B]."""
    batch, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    # Triton launches on the current device, not the tensors': under the uni executor a worker
    # on cuda:1 shares a process whose current device is cuda:0. (CPU tensors: the interpreter.)
    with torch.cuda.device(query.device) if query.is_cuda else contextlib.nullcontext():
        _paged_decode_kernel[(batch, num_kv_heads)](
            out,
            query,
            kv_cache,
            block_tables,
            seq_lens,
            scale,
            _NO_WINDOW if sliding_window is None else sliding_window,
            query.stride(0),
            query.stride(1),
            out.stride(0),
            out.stride(1),
            kv_cache.stride(0),
            kv_cache.stride(1),
            kv_cache.stride(2),
            kv_cache.stride(3),
            block_tables.stride(0),
            GROUP=group,
            GROUP_PAD=max(triton.next_power_of_2(group), 1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
            BLOCK_SIZE=block_size,
        )
    return out


class CudaPagedAttention(TorchPagedAttention):
    """Triton decode when available; prefill through SDPA's fused kernels."""

    def __init__(self, use_triton: bool | None = None):
        super().__init__(native_ops=False)  # the native ops are registered for CPU only
        self.use_triton = triton_available() if use_triton is None else use_triton
        if self.use_triton and not triton_available():
            raise ValueError("use_triton=True but triton is not importable")

    def decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        prep: PreparedAttention,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        if not self.use_triton or query.stride(-1) != 1 or kv_cache.stride(-1) != 1:
            return super().decode(query, kv_cache, prep, scale, sliding_window)
        return triton_paged_decode(
            query, kv_cache, prep.decode_block_tables, prep.decode_seq_lens, scale, sliding_window
        )

    @staticmethod
    def sdpa(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
    ) -> torch.Tensor:
        if mask is not None and q.shape[1] != k.shape[1]:
            # a masked call cannot use the flash kernel, and the memory-efficient one has no
            # GQA: repeating K/V heads keeps it off the quadratic-memory math path
            group = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
