"""Paged attention in plain torch: the CPU backend, and the CUDA backend's fallback.

Keys and values live in a per-layer cache [2, num_blocks, block_size, num_kv_heads, head_dim],
in the compute dtype or, under fp32 compute, a 16-bit `kv_cache_dtype` (halves the bytes decode
reads): keys and values are rounded to it when written and widened back when read.
Decode rows gather their blocks into one padded batch and run a single SDPA call in which
the query heads of one KV head act as that head's "query length" (GQA without repeating K/V).
Prefill rows run SDPA per sequence over their context, causal with the prefix offset; with
`native_ops` (CPU, fp32) the compiled `hybridllm::prefill_attention` instead.

Attention sinks (gpt-oss: a learned logit per query head that joins each softmax's denominator
and attends to nothing) and logit soft-capping (Gemma 2: scores -> cap * tanh(scores / cap)
before the mask) are beyond SDPA: where either is set, the torch path computes the scores
itself (`eager_attention`, fp32); the native ops take both as arguments (`softcap`, 0 for
none, and `sinks`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridllm.layers.prepared_attention import PrefillSequence, PreparedAttention

# fp32 scores `eager_attention` materialises at once in a prefill (64 MiB): longer chunks run
# in slices of query rows
EAGER_SCORE_ELEMENTS = 1 << 24


def eager_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    logit_softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention with soft-capped scores and/or sinks, computed in fp32.

    q [B, H, Lq, D], k/v [B, kvh, Lk, D] (GQA: H a multiple of kvh, K/V not repeated); `mask`
    bool, True where a query may attend, broadcastable to [B, kvh, H / kvh, Lq, Lk]; `sinks`
    [H] -> [B, H, Lq, D] in q's dtype. The scores are q.k * scale, then
    cap * tanh(scores / cap), then masked; with sinks each row's softmax also runs over its
    head's sink logit, whose column is then dropped (the row's weights sum to less than 1).
    """
    batch, num_heads, q_len, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    qf = q.float().reshape(batch, num_kv_heads, group, q_len, head_dim)
    kf = k.float().unsqueeze(2)  # [B, kvh, 1, Lk, D]
    vf = v.float().unsqueeze(2)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # [B, kvh, G, Lq, Lk]
    if logit_softcap is not None:
        scores = torch.tanh(scores / logit_softcap) * logit_softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = scores.softmax(-1)
    else:
        sink = sinks.to(scores.device, torch.float32).view(1, num_kv_heads, group, 1, 1)
        sink = sink.expand(batch, num_kv_heads, group, q_len, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    out = torch.matmul(probs, vf)  # [B, kvh, G, Lq, D]
    return out.reshape(batch, num_heads, q_len, head_dim).to(q.dtype)


def native_sinks(sinks: torch.Tensor | None) -> torch.Tensor | None:
    """`sinks` as the native ops take them: contiguous fp32 (the layer's parameter already is)."""
    if sinks is None:
        return None
    return sinks.detach().to(torch.float32).contiguous()


def write_kv_cache(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter this step's key/value [num_tokens, kv_heads, head_dim] into their cache slots
    (rounded to the cache's dtype)."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)  # [2, num_blocks * block_size, kvh, D]
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


class TorchPagedAttention:
    """Gather + SDPA implementation; one instance may serve every layer.

    With `native_ops`, decode rows use the compiled `hybridllm::paged_decode_attention`
    op (CPU tensors only), which reads the blocks in place instead of gathering a padded copy,
    and the step's keys and values go to the cache through `hybridllm::write_kv_cache`.
    """

    def __init__(self, native_ops: bool = False):
        self.native_ops = native_ops

    def write_step_kv(
        self,
        kv_cache: torch.Tensor | None,
        key: torch.Tensor,
        value: torch.Tensor,
        prep: PreparedAttention,
    ) -> None:
        """Write this step's keys and values through the slot mapping; a step that must read
        the cache (decode rows, cached prefixes) without one is an error."""
        if kv_cache is not None and kv_cache.numel():
            if self.native_ops:
                torch.ops.hybridllm.write_kv_cache(key, value, kv_cache, prep.slot_mapping)
            else:
                write_kv_cache(kv_cache, key, value, prep.slot_mapping)
        elif prep.reads_cache:
            raise ValueError("decode rows and cached prefixes need a KV cache, got none")

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

        `logit_softcap` (Gemma 2) caps the scores at +-cap through tanh; `sinks` [H] fp32
        (gpt-oss) adds one logit per query head to every softmax's denominator."""
        num_tokens, num_heads, head_dim = query.shape
        self.write_step_kv(kv_cache, key, value, prep)
        num_decodes = prep.num_decodes
        extra = {"logit_softcap": logit_softcap, "sinks": sinks}
        if num_decodes == num_tokens and num_decodes:
            out = self.decode(query, kv_cache, prep, scale, sliding_window, **extra)
            return out.reshape(num_tokens, num_heads * head_dim)
        if num_decodes == 0 and len(prep.prefills) == 1:
            out = self.prefill(
                query, key, value, kv_cache, prep, prep.prefills[0], scale, sliding_window, **extra
            )
            return out.reshape(num_tokens, num_heads * head_dim)
        out = query.new_empty(num_tokens, num_heads, head_dim)
        if num_decodes:
            out[:num_decodes] = self.decode(
                query[:num_decodes], kv_cache, prep, scale, sliding_window, **extra
            )
        for seq in prep.prefills:
            out[seq.query_start : seq.query_end] = self.prefill(
                query, key, value, kv_cache, prep, seq, scale, sliding_window, **extra
            )
        return out.view(num_tokens, num_heads * head_dim)

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
        """query [B, H, D] of single-token rows -> [B, H, D]."""
        if self.native_ops:
            return torch.ops.hybridllm.paged_decode_attention(
                query.contiguous(),
                kv_cache,
                prep.decode_block_tables,
                prep.decode_seq_lens,
                scale,
                sliding_window or 0,
                logit_softcap or 0.0,
                native_sinks(sinks),
            )
        eager = logit_softcap is not None or sinks is not None
        batch, num_heads, head_dim = query.shape
        num_kv_heads = kv_cache.shape[3]
        padded_len = prep.decode_padded_len
        gathered = kv_cache.index_select(1, prep.decode_block_ids)  # [2, B * nb, bs, kvh, D]
        kv = gathered.view(2, batch, padded_len, num_kv_heads, head_dim).to(query.dtype)
        mask = None
        if batch == 1:
            # one row: slice to its exact (windowed) context instead of masking
            end = prep.decode_seq_lens_cpu[0]
            start = 0 if sliding_window is None else max(0, end - sliding_window)
            kv = kv[:, :, start:end]
        else:
            mask = prep.decode_mask(sliding_window)  # [B, 1, 1, L]
        key = kv[0].transpose(1, 2)  # [B, kvh, L, D]
        value = kv[1].transpose(1, 2)
        if eager:
            out = eager_attention(
                query.unsqueeze(2),  # [B, H, 1, D]
                key,
                value,
                None if mask is None else mask.unsqueeze(1),  # [B, 1, 1, 1, L]
                scale,
                logit_softcap,
                sinks,
            )
            return out.reshape(batch, num_heads, head_dim)
        # [B, kvh, group, D]: the group's query heads play the role of query positions
        grouped = query.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, scale=scale)
        return out.reshape(batch, num_heads, head_dim)

    def prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor | None,
        prep: PreparedAttention,
        seq: PrefillSequence,
        scale: float,
        sliding_window: int | None,
        logit_softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of one sequence's chunk over its context -> [query_len, H, D]."""
        rows = slice(seq.query_start, seq.query_end)
        eager = logit_softcap is not None or sinks is not None
        if self.native_ops and query.dtype == torch.float32:
            # the chunk's own keys and values (strided views), or its whole context's
            k, v = (
                (key[rows], value[rows]) if seq.block_ids is None else self.context(kv_cache, seq)
            )
            return torch.ops.hybridllm.prefill_attention(
                query[rows],
                k,
                v,
                scale,
                sliding_window or 0,
                logit_softcap or 0.0,
                native_sinks(sinks),
            )
        q = query[rows].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        if seq.block_ids is None:
            k = key[rows].transpose(0, 1).unsqueeze(0)  # [1, kvh, q_len, D]
            v = value[rows].transpose(0, 1).unsqueeze(0)
        else:
            k, v = (t.to(q.dtype) for t in self.gather_context(kv_cache, seq))
        mask = prep.prefill_mask(seq, sliding_window)
        if eager:
            return self.eager_prefill(q, k, v, mask, scale, logit_softcap, sinks)
        out = self.sdpa(q, k, v, mask, scale)  # [1, H, q_len, D]
        return out[0].transpose(0, 1)

    @staticmethod
    def eager_prefill(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float,
        logit_softcap: float | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """q [1, H, q_len, D], k/v [1, kvh, ctx, D] (the chunk's queries are the context's last
        q_len positions), mask [q_len, ctx] or None (causal) -> [q_len, H, D] by
        `eager_attention`, in slices of query rows that bound the scores' memory."""
        num_heads, q_len = q.shape[1], q.shape[2]
        ctx = k.shape[2]
        if mask is None:
            mask = torch.ones(q_len, ctx, dtype=torch.bool, device=q.device).tril(ctx - q_len)
        rows = max(1, EAGER_SCORE_ELEMENTS // (num_heads * ctx))
        out = q.new_empty(q_len, num_heads, q.shape[3])
        for start in range(0, q_len, rows):
            end = min(q_len, start + rows)
            part = eager_attention(
                q[:, :, start:end], k, v, mask[start:end], scale, logit_softcap, sinks
            )  # [1, H, end - start, D]
            out[start:end] = part[0].transpose(0, 1)
        return out

    @staticmethod
    def context(kv_cache: torch.Tensor, seq: PrefillSequence) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequence's keys and values from the cache, each [context_len, kvh, D], in the
        cache's dtype."""
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        gathered = kv_cache.index_select(1, seq.block_ids)  # [2, nb, bs, kvh, D]
        kv = gathered.view(2, -1, num_kv_heads, head_dim)[:, : seq.context_len]
        return kv[0], kv[1]

    @classmethod
    def gather_context(
        cls, kv_cache: torch.Tensor, seq: PrefillSequence
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`context`, each as [1, kvh, context_len, D]."""
        key, value = cls.context(kv_cache, seq)
        return key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0)

    @staticmethod
    def sdpa(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
    ) -> torch.Tensor:
        """q [1, H, q_len, D], k/v [1, kvh, ctx, D]; mask None means causal over equal lengths."""
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
