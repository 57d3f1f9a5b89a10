"""CUDA paged attention: a Triton decode kernel when triton is importable, varlen flash prefill.

Without triton (or for shapes the kernel does not cover) every call falls back to the torch
gather path of `TorchPagedAttention`, so this module is safe to import on any machine.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.nn.functional as F

from hybridllm.layers.paged_attention_cpu import TorchPagedAttention
from hybridllm.layers.prepared_attention import PreparedAttention

try:  # triton is optional: absent on CPU-only installs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

logger = logging.getLogger(__name__)

_NO_WINDOW = 1 << 30  # a window no sequence reaches: the kernel's "no sliding window"


def triton_available() -> bool:
    return triton is not None


# Split-KV ("flash-decoding"): when a step has too few (sequence, kv head) programs to fill the
# GPU, each sequence's context is cut into ranges of whole blocks, one program per range, and a
# second kernel merges the ranges' partial softmax results.
SPLIT_MIN_TOKENS = 256  # a range shorter than this costs more to merge than it saves
SPLIT_MAX = 64  # ranges per sequence; the merge kernel holds [SPLIT_MAX, head_dim] fp32
SPLIT_PROGRAMS_PER_SM = 2  # programs in flight per SM that a split aims for


def decode_num_splits(
    batch: int,
    num_kv_heads: int,
    context_tokens: int,
    block_size: int,
    num_sms: int,
) -> tuple[int, int]:
    """(ranges per sequence, blocks per range) for a decode batch whose longest attended
    context is `context_tokens` (a sliding window already applied); (1, 0) means no split.

    Splits only when batch x kv_heads programs leave SMs idle, into ranges of at least
    SPLIT_MIN_TOKENS: enough programs for SPLIT_PROGRAMS_PER_SM per SM, at most SPLIT_MAX.
    """
    programs = batch * num_kv_heads
    blocks = -(-context_tokens // block_size)
    wanted = -(-SPLIT_PROGRAMS_PER_SM * num_sms // programs)
    min_blocks = max(1, SPLIT_MIN_TOKENS // block_size)
    splits = min(wanted, blocks // min_blocks, SPLIT_MAX)
    if splits < 2:
        return 1, 0
    per_split = -(-blocks // splits)
    return -(-blocks // per_split), per_split


if triton is not None:

    @triton.jit
    def _paged_decode_kernel(
        out_ptr,
        part_out_ptr,
        part_lse_ptr,
        q_ptr,
        cache_ptr,
        block_tables_ptr,
        seq_lens_ptr,
        sinks_ptr,
        scale,
        softcap,
        sliding_window,
        blocks_per_split,
        stride_q_tok,
        stride_q_head,
        stride_o_tok,
        stride_o_head,
        stride_p_tok,
        stride_p_head,
        stride_p_split,
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
        SPLIT: tl.constexpr,
        SOFTCAP: tl.constexpr,
        HAS_SINKS: tl.constexpr,
    ):
        # one program per (decode sequence, kv head, context range): streams that head's blocks
        # of the range once and serves all GROUP query heads sharing it, with an online softmax
        # in fp32. SPLIT=False: one range, the whole (windowed) context, written to out.
        # SPLIT=True: the range's normalized output and log-sum-exp go to the partial buffers
        # [B, H, splits, D] and [B, H, splits] for _merge_splits_kernel.
        # SOFTCAP: scores become softcap * tanh(scores / softcap) before the mask (Gemma 2).
        # HAS_SINKS (gpt-oss): a head's sink logit sinks_ptr[h] joins the softmax's denominator:
        # the running max starts at it and the running sum at 1; a split leaves it to the merge.
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
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

        if HAS_SINKS and not SPLIT:
            m_i = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0).to(tl.float32)
            l_i = tl.full([GROUP_PAD], 1.0, tl.float32)
        else:
            m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
            l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
        start = tl.maximum(seq_len - sliding_window, 0)
        first = start // BLOCK_SIZE
        last = tl.cdiv(seq_len, BLOCK_SIZE)
        if SPLIT:
            # every block in [first, last) holds a token of the window: a range is empty only
            # when it starts past the sequence's last block (a shorter sequence of the batch)
            first = first + split * blocks_per_split
            last = tl.minimum(last, first + blocks_per_split)
        for b in range(first, last):
            block_id = tl.load(block_tables_ptr + seq * stride_bt_seq + b).to(tl.int64)
            pos = b * BLOCK_SIZE + offs_t
            t_mask = (pos < seq_len) & (pos >= start)
            base = cache_ptr + block_id * stride_c_block + kv_head * stride_c_head
            kv_offs = offs_t[:, None] * stride_c_tok + offs_d[None, :]
            kv_mask = t_mask[:, None] & d_mask[None, :]
            k = tl.load(base + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)  # [BS, D]
            v = tl.load(base + stride_c_kv + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G, BS]
            if SOFTCAP:
                # tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2 |y|): no overflow
                y = s / softcap
                e = tl.exp(-2.0 * tl.abs(y))
                t = (1.0 - e) / (1.0 + e)
                s = softcap * tl.where(y < 0, -t, t)
            s = tl.where(t_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new
        out_mask = g_mask[:, None] & d_mask[None, :]
        if SPLIT:
            # an empty range (l_i == 0) writes zeros and a log-sum-exp of -inf: weight 0
            nonempty = l_i > 0
            out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
            lse = tl.where(nonempty, m_i + tl.log(tl.where(nonempty, l_i, 1.0)), float("-inf"))
            p_off = seq * stride_p_tok + heads * stride_p_head + split * stride_p_split  # [G]
            tl.store(part_out_ptr + p_off[:, None] * HEAD_DIM + offs_d[None, :], out, mask=out_mask)
            tl.store(part_lse_ptr + p_off, lse, mask=g_mask)
        else:
            out = acc / l_i[:, None]
            o_ptrs = out_ptr + seq * stride_o_tok + heads[:, None] * stride_o_head + offs_d[None, :]
            tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)

    @triton.jit
    def _merge_splits_kernel(
        out_ptr,
        part_out_ptr,
        part_lse_ptr,
        sinks_ptr,
        num_splits,
        stride_o_tok,
        stride_o_head,
        stride_p_tok,
        stride_p_head,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
        HAS_SINKS: tl.constexpr,
    ):
        # one program per (decode sequence, query head): the ranges' outputs weighted by
        # exp(lse - max lse), over the sum of those weights (the softmax over all ranges);
        # HAS_SINKS: the head's sink logit joins the max and adds its weight to the sum only
        seq = tl.program_id(0)
        head = tl.program_id(1)
        offs_s = tl.arange(0, SPLITS_PAD)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        s_mask = offs_s < num_splits
        d_mask = offs_d < HEAD_DIM
        p_off = seq * stride_p_tok + head * stride_p_head + offs_s  # [S] (split stride 1)
        lse = tl.load(part_lse_ptr + p_off, mask=s_mask, other=float("-inf"))
        top = tl.max(lse, axis=0)  # every sequence has a token: finite
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + head).to(tl.float32)
            top = tl.maximum(top, sink)
            sink_weight = tl.exp(sink - top)
        else:
            sink_weight = 0.0
        weight = tl.exp(lse - top)  # [S]
        part = tl.load(
            part_out_ptr + p_off[:, None] * HEAD_DIM + offs_d[None, :],
            mask=s_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # [S, D]
        total = tl.sum(weight, axis=0) + sink_weight
        out = tl.sum(weight[:, None] * part, axis=0) / total
        o_ptrs = out_ptr + seq * stride_o_tok + head * stride_o_head + offs_d
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def triton_paged_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    num_splits: int = 1,
    blocks_per_split: int = 0,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [B, H, D] -> [B, H, D]; block_tables [>=B, max_blocks] int32, seq_lens [>=B].

    `num_splits` > 1 (with `blocks_per_split`, from `decode_num_splits`) cuts each context
    into that many ranges of `blocks_per_split` blocks, counted from the window's first block.
    `logit_softcap` caps the scores (Gemma 2); `sinks` [H] fp32 adds each head's sink logit to
    its softmax's denominator (gpt-oss).
    """
    batch, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    split = num_splits > 1
    has_sinks = sinks is not None
    if has_sinks:
        sinks = sinks.detach().to(query.device, torch.float32).contiguous()
    sinks_arg = sinks if has_sinks else out  # unused by the kernels without sinks
    if split:
        # [B, H, splits, D] and [B, H, splits], fp32, contiguous (the kernels index them so)
        part_out = torch.empty(
            batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty(
            batch, num_heads, num_splits, dtype=torch.float32, device=query.device
        )
        p_strides = (part_lse.stride(0), part_lse.stride(1), part_lse.stride(2))
    else:
        part_out = part_lse = out  # unused by the kernel
        p_strides = (0, 0, 0)
        num_splits, blocks_per_split = 1, 0
    # Triton launches on the current device, not the tensors': under the uni executor a worker
    # on cuda:1 shares a process whose current device is cuda:0. (CPU tensors: the interpreter.)
    with torch.cuda.device(query.device) if query.is_cuda else contextlib.nullcontext():
        _paged_decode_kernel[(batch, num_kv_heads, num_splits)](
            out,
            part_out,
            part_lse,
            query,
            kv_cache,
            block_tables,
            seq_lens,
            sinks_arg,
            scale,
            logit_softcap or 1.0,
            _NO_WINDOW if sliding_window is None else sliding_window,
            blocks_per_split,
            query.stride(0),
            query.stride(1),
            out.stride(0),
            out.stride(1),
            *p_strides,
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
            SPLIT=split,
            SOFTCAP=logit_softcap is not None,
            HAS_SINKS=has_sinks,
        )
        if split:
            _merge_splits_kernel[(batch, num_heads)](
                out,
                part_out,
                part_lse,
                sinks_arg,
                num_splits,
                out.stride(0),
                out.stride(1),
                part_lse.stride(0),
                part_lse.stride(1),
                HEAD_DIM=head_dim,
                HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
                SPLITS_PAD=triton.next_power_of_2(num_splits),
                HAS_SINKS=has_sinks,
            )
    return out


def varlen_kwargs(
    params: Collection[str], scale: float, head_dim: int, sliding_window: int | None, gqa: bool
) -> dict[str, Any] | None:
    """Keyword arguments of torch's `varlen_attn` (whose `params` differ across releases) for
    causal attention aligned bottom-right, optionally windowed; None when it cannot express it.

    A window of W keys (a query sees positions in (p - W, p]) is flash-attention's left window
    W - 1. torch 2.10 has `is_causal` only, 2.11 on `window_size`; `enable_gqa` came later, and
    earlier releases hand GQA straight to the flash kernel, which supports it.
    """
    kwargs: dict[str, Any] = {}
    if "scale" in params:
        kwargs["scale"] = scale
    elif not math.isclose(scale, head_dim**-0.5, rel_tol=1e-6):
        return None
    if "window_size" in params:
        kwargs["window_size"] = (-1 if sliding_window is None else sliding_window - 1, 0)
    elif "is_causal" in params and sliding_window is None:
        kwargs["is_causal"] = True
    else:
        return None
    if gqa and "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    return kwargs


class CudaPagedAttention(TorchPagedAttention):
    """Triton decode when available (split-KV for small batches of long contexts); every
    prefill sequence of a step in one variable-length flash-attention call (torch's
    `varlen_attn`, fp16/bf16 on sm80+), else SDPA per sequence.

    `num_sms` overrides the device's SM count and `varlen_fn` torch's varlen attention (tests:
    CPU tensors under TRITON_INTERPRET=1, a reference varlen function).
    """

    def __init__(
        self,
        use_triton: bool | None = None,
        num_sms: int | None = None,
        varlen_fn: Callable[..., torch.Tensor] | None = None,
    ):
        super().__init__(native_ops=False)  # the native ops are registered for CPU only
        self.use_triton = triton_available() if use_triton is None else use_triton
        if self.use_triton and not triton_available():
            raise ValueError("use_triton=True but triton is not importable")
        self.num_sms = num_sms
        self._varlen_fn = varlen_fn
        self._varlen_injected = varlen_fn is not None
        self._varlen_params: frozenset[str] | None = None
        self._varlen_failed = False  # set after a call raised: SDPA per sequence from then on
        self._sm80: dict[int, bool] = {}  # device index -> compute capability >= 8.0

    # ---- decode -------------------------------------------------------------------------------

    def decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        prep: PreparedAttention,
        scale: float,
        sliding_window: int | None,
        logit_softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not self.use_triton or query.stride(-1) != 1 or kv_cache.stride(-1) != 1:
            return super().decode(
                query,
                kv_cache,
                prep,
                scale,
                sliding_window,
                logit_softcap=logit_softcap,
                sinks=sinks,
            )
        block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
        context = max(prep.decode_seq_lens_cpu)
        if sliding_window is not None:
            context = min(context, sliding_window + block_size)  # the window's blocks
        splits, per_split = decode_num_splits(
            query.shape[0], num_kv_heads, context, block_size, self._sm_count(query.device)
        )
        return triton_paged_decode(
            query,
            kv_cache,
            prep.decode_block_tables,
            prep.decode_seq_lens,
            scale,
            sliding_window,
            splits,
            per_split,
            logit_softcap=logit_softcap,
            sinks=sinks,
        )

    def _sm_count(self, device: torch.device) -> int:
        if self.num_sms is None:
            # CPU tensors run under the Triton interpreter: an H100's count
            cuda = device.type == "cuda"
            self.num_sms = (
                torch.cuda.get_device_properties(device).multi_processor_count if cuda else 132
            )
        return self.num_sms

    # ---- prefill ------------------------------------------------------------------------------

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor | None,
        prep: PreparedAttention,
        scale: float,
        sliding_window: int | None,
        logit_softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query [n, H, D], key/value [n, kvh, D] (this step's) -> output [n, H * D].

        torch's varlen flash attention has no soft-capping or sinks: with either, prefills run
        the torch path per sequence (`TorchPagedAttention.prefill`)."""
        extra = {"logit_softcap": logit_softcap, "sinks": sinks}
        kwargs = None
        if prep.prefills and logit_softcap is None and sinks is None:
            kwargs = self._varlen_kwargs(query, key, scale, sliding_window)
        if kwargs is None:
            return super().forward(
                query, key, value, kv_cache, prep, scale, sliding_window, **extra
            )
        num_tokens, num_heads, head_dim = query.shape
        self.write_step_kv(kv_cache, key, value, prep)
        nd = prep.num_decodes
        try:
            prefill = self.prefill_varlen(
                query[nd:], key[nd:], value[nd:], kv_cache, prep, sliding_window, kwargs
            )  # [num_prefill_tokens, H, D]
        except RuntimeError as exc:
            if self._varlen_injected:
                raise
            logger.warning("varlen attention failed (%s); prefill runs SDPA per sequence", exc)
            self._varlen_failed = True
            return super().forward(query, key, value, kv_cache, prep, scale, sliding_window)
        if nd == 0:
            return prefill.reshape(num_tokens, num_heads * head_dim)
        out = query.new_empty(num_tokens, num_heads, head_dim)
        out[:nd] = self.decode(query[:nd], kv_cache, prep, scale, sliding_window)
        out[nd:] = prefill
        return out.view(num_tokens, num_heads * head_dim)

    def prefill_varlen(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor | None,
        prep: PreparedAttention,
        sliding_window: int | None,
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        """The prefill rows query [Tq, H, D] (and their key/value [Tq, kvh, D]) -> [Tq, H, D],
        every sequence at once; a chunk with a cached prefix reads its context from the cache
        (written already), gathered from the first key its window shows it."""
        varlen = prep.varlen_prefill(sliding_window)
        if varlen.kv_slots is None:
            k, v = key, value
        else:
            num_kv_heads, head_dim = kv_cache.shape[-2:]
            flat = kv_cache.view(2, -1, num_kv_heads, head_dim)  # [2, blocks * bs, kvh, D]
            kv = flat.index_select(1, varlen.kv_slots)  # [2, Tk, kvh, D]
            k, v = kv[0], kv[1]
        return self._varlen_fn(
            query,
            k,
            v,
            varlen.cu_seqlens_q,
            varlen.cu_seqlens_k,
            varlen.max_query_len,
            varlen.max_key_len,
            **kwargs,
        )

    def _varlen_kwargs(
        self, query: torch.Tensor, key: torch.Tensor, scale: float, sliding_window: int | None
    ) -> dict[str, Any] | None:
        """`varlen_kwargs` when the varlen path can take this call, else None."""
        if self._varlen_failed:
            return None
        head_dim = query.shape[-1]
        if not self._varlen_injected:
            # torch's flash kernel: fp16/bf16, head_dim a multiple of 8 up to 256, sm80+
            if (
                not query.is_cuda
                or query.dtype not in (torch.float16, torch.bfloat16)
                or head_dim % 8
                or head_dim > 256
                or query.stride(-1) != 1
                or key.stride(-1) != 1
                or not self._is_sm80(query.device)
            ):
                return None
            if self._varlen_fn is None:
                try:
                    from torch.nn.attention.varlen import varlen_attn
                except ImportError:
                    self._varlen_failed = True
                    return None
                self._varlen_fn = varlen_attn
        if self._varlen_params is None:
            self._varlen_params = frozenset(inspect.signature(self._varlen_fn).parameters)
        gqa = query.shape[1] != key.shape[1]
        return varlen_kwargs(self._varlen_params, scale, head_dim, sliding_window, gqa)

    def _is_sm80(self, device: torch.device) -> bool:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._sm80:
            self._sm80[index] = torch.cuda.get_device_capability(index) >= (8, 0)
        return self._sm80[index]

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
