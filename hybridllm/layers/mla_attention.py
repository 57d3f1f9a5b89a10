"""Multi-head latent attention (DeepSeek's MLA) over a paged cache of latents.

A layer's cache is [num_blocks, block_size, latent_dim + rope_dim]: per token the normed
compressed key-value `c_kv` and the rotated shared key part `k_pe`, one row for every head
(576 values for DeepSeek-V3, where expanded keys and values would take 128 heads x 320).
The per-head key and value up-projections `w_uk` [H, nope, latent] and `w_uv` [H, v, latent]
(`kv_b_proj`'s rows) are applied in one of two equal ways:

- expanded (prefill): the context's latents are up-projected into per-head keys and values and
  attention runs as usual (what the step costs is the chunk's queries, not the cache's width);
- absorbed (decode): each query's nope part is multiplied into the latent space
  (`q_nope @ w_uk`), attention runs over the latent rows themselves (key = the whole row, value
  = its latent part) and the result is projected by `w_uv` after, so a step reads every cached
  row once for all heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridllm.layers.gguf_linear import repack_x8, x8_repacking, x8_source_types
from hybridllm.layers.prepared_attention import PreparedAttention


@dataclass(frozen=True)
class HeadBlocks:
    """MLA's up-projections as Q8_0 blocks: all of `kv_b_proj`'s rows for the expanded form,
    and per head the key part transposed and the value part for the absorbed one."""

    kv_b: torch.Tensor  # [H * (nope + v), L row bytes]
    uk_t: torch.Tensor  # [H, L, nope row bytes]
    uv: torch.Tensor  # [H, v, L row bytes]
    ggml_type: int
    activations: int


class LatentAttention:
    """The attention math of one MLA layer (no weights of its own: the up-projections are
    passed in). `native_ops`: the compiled `hybridllm::mla_decode_attention` for CPU decode."""

    def __init__(
        self,
        num_heads: int,
        nope_dim: int,
        rope_dim: int,
        v_dim: int,
        latent_dim: int,
        scale: float,
        native_ops: bool = False,
    ):
        self.num_heads = num_heads
        self.nope_dim = nope_dim
        self.rope_dim = rope_dim
        self.v_dim = v_dim
        self.latent_dim = latent_dim
        self.scale = scale
        self.native_ops = native_ops
        self.absorb_decode = True  # False: decode rows expanded as prefill is (tests compare)
        # CPU, a model computing from GGUF blocks: the up-projections as blocks too
        # (`use_head_blocks`); None: the float `w_kv_b` passed to forward
        self.head_blocks: HeadBlocks | None = None

    def use_head_blocks(self, w_kv_b: torch.Tensor, activations: int) -> None:
        """Compute with Q8_0 blocks of `w_kv_b` [H, nope + v, L] from now on (the caller may
        drop its floats): the expanded prefill through `hybridllm::gguf_linear`, the absorbed
        decode's per-head products through `hybridllm::gguf_head_linear` (torch's bmm of one
        row a head ran at 2-3 GB/s); in groups of 8 rows where the int8 x8 kernels run. Needs
        nope and L multiples of 32."""
        import gguf

        q8 = gguf.GGMLQuantizationType.Q8_0
        heads, nope, latent_dim = self.num_heads, self.nope_dim, self.latent_dim

        def blocks(rows: torch.Tensor) -> torch.Tensor:  # [n, L or nope] -> [n, row bytes]
            return torch.from_numpy(gguf.quants.quantize(rows.contiguous().numpy(), q8))

        w = w_kv_b.detach().float()
        kv_b = blocks(w.reshape(-1, latent_dim))  # [H * (nope + v), L / 32 blocks]
        uk_t = blocks(w[:, :nope].transpose(1, 2).reshape(-1, nope)).view(heads, latent_dim, -1)
        uv = blocks(w[:, nope:].reshape(-1, latent_dim)).view(heads, self.v_dim, -1)
        ggml_type = int(q8)
        if x8_repacking(activations) and ggml_type in x8_source_types() and self.v_dim % 8 == 0:
            # each matrix's rows (H * (nope + v), L, v) in groups of 8: DeepSeek-V3's two
            # absorbing products from DRAM took 0.91x the plain rows' time at 1 decode row,
            # 0.73x at 4 (2-core Zen 5, alternating in one process)
            kv_b, _ = repack_x8(kv_b, ggml_type)
            uk_t, _ = repack_x8(uk_t, ggml_type)
            uv, ggml_type = repack_x8(uv, ggml_type)
        self.head_blocks = HeadBlocks(kv_b, uk_t, uv, ggml_type, activations)

    @staticmethod
    def write(kv_cache: torch.Tensor | None, latent: torch.Tensor, prep: PreparedAttention) -> None:
        """Scatter the step's latents [n, latent_dim + rope_dim] into their cache slots."""
        if kv_cache is None or not kv_cache.numel():
            if prep.reads_cache:
                raise ValueError("decode rows and cached prefixes need a KV cache, got none")
            return
        flat = kv_cache.view(-1, kv_cache.shape[-1])  # [num_blocks * block_size, L + R]
        flat.index_copy_(0, prep.slot_mapping, latent.to(kv_cache.dtype))

    def forward(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        kv_cache: torch.Tensor | None,
        prep: PreparedAttention,
        w_kv_b: torch.Tensor | None,
    ) -> torch.Tensor:
        """q_nope [n, H, nope], q_pe [n, H, rope] (rotated), latent [n, L + R] (this step's,
        already written) and `w_kv_b` [H, nope + v, L] (None: `head_blocks` hold it) ->
        [n, H * v]."""
        num_tokens = q_nope.shape[0]
        out = q_nope.new_empty(num_tokens, self.num_heads, self.v_dim)
        num_decodes = prep.num_decodes
        if num_decodes:
            rows = slice(0, num_decodes)
            if self.absorb_decode:
                out[rows] = self.decode_absorbed(q_nope[rows], q_pe[rows], kv_cache, prep, w_kv_b)
            else:
                for i in range(num_decodes):
                    blocks = prep.decode_block_tables[
                        i, : -(-prep.decode_seq_lens_cpu[i] // prep.block_size)
                    ]
                    context = self._context(kv_cache, blocks, prep.decode_seq_lens_cpu[i])
                    out[i : i + 1] = self.expanded(
                        q_nope[i : i + 1], q_pe[i : i + 1], context, None, w_kv_b
                    )
        for seq in prep.prefills:
            rows = slice(seq.query_start, seq.query_end)
            if seq.block_ids is None:
                context, mask = latent[rows], None  # the chunk is its whole context: causal
            else:
                context = self._context(kv_cache, seq.block_ids, seq.context_len)
                mask = prep.prefill_mask(seq, None)
            out[rows] = self.expanded(q_nope[rows], q_pe[rows], context, mask, w_kv_b)
        return out.view(num_tokens, self.num_heads * self.v_dim)

    def expanded(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        context: torch.Tensor,
        mask: torch.Tensor | None,
        w_kv_b: torch.Tensor | None,
    ) -> torch.Tensor:
        """Queries [q, H, *] over the context's latents [ctx, L + R], up-projected into per-head
        keys and values; `mask` [q, ctx] (None: causal over equal lengths) -> [q, H, v]."""
        heads, nope, latent_dim = self.num_heads, self.nope_dim, self.latent_dim
        context = context.to(q_nope.dtype)
        ctx = context.shape[0]
        blocks = self.head_blocks if context.device.type == "cpu" else None
        if blocks is not None:
            kv = torch.ops.hybridllm.gguf_linear(
                context[:, :latent_dim].float().contiguous(),
                blocks.kv_b,
                blocks.ggml_type,
                blocks.kv_b.shape[0],
                blocks.activations,
            ).to(q_nope.dtype)  # [ctx, H * (nope + v)]
        else:
            kv = F.linear(context[:, :latent_dim], w_kv_b.view(-1, latent_dim))
        kv = kv.view(ctx, heads, -1)
        key = torch.empty(ctx, heads, nope + self.rope_dim, dtype=kv.dtype, device=kv.device)
        key[..., :nope] = kv[..., :nope]
        key[..., nope:] = context[:, None, latent_dim:]  # k_pe is shared by every head
        value = kv[..., nope:]  # [ctx, H, v]
        query = torch.cat((q_nope, q_pe), dim=-1)  # [q, H, nope + rope]
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1),  # [H, q, nope + rope]
            key.transpose(0, 1),
            value.transpose(0, 1),  # [H, ctx, v]
            attn_mask=mask,
            is_causal=mask is None and query.shape[0] > 1,
            scale=self.scale,
        )
        return out.transpose(0, 1)  # [q, H, v]

    def decode_absorbed(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        prep: PreparedAttention,
        w_kv_b: torch.Tensor | None,
    ) -> torch.Tensor:
        """Decode rows [B, H, *] attending over the latent rows themselves -> [B, H, v]."""
        nope, latent_dim = self.nope_dim, self.latent_dim
        batch = q_nope.shape[0]
        blocks = self.head_blocks if kv_cache.device.type == "cpu" else None
        if blocks is not None:
            q_latent = torch.ops.hybridllm.gguf_head_linear(
                q_nope.float().contiguous(),
                blocks.uk_t,
                blocks.ggml_type,
                latent_dim,
                blocks.activations,
            ).to(q_nope.dtype)  # [B, H, L]
        else:
            # [H, B, nope] @ [H, nope, L] -> [H, B, L]: the queries in the latent space
            q_latent = torch.bmm(q_nope.transpose(0, 1), w_kv_b[:, :nope]).transpose(0, 1)
        query = torch.cat((q_latent, q_pe), dim=-1)  # [B, H, L + R]
        if self.native_ops and kv_cache.device.type == "cpu":
            latent_out = torch.ops.hybridllm.mla_decode_attention(
                query.float().contiguous(),
                kv_cache,
                prep.decode_block_tables,
                prep.decode_seq_lens,
                self.scale,
                latent_dim,
            ).to(q_nope.dtype)  # [B, H, L]
        else:
            gathered = kv_cache.index_select(0, prep.decode_block_ids)  # [B * nb, bs, L + R]
            rows = gathered.view(batch, 1, prep.decode_padded_len, -1).to(query.dtype)
            mask = None
            if batch == 1:
                rows = rows[:, :, : prep.decode_seq_lens_cpu[0]]
            else:
                mask = prep.decode_mask(None)  # [B, 1, 1, padded]
            # one KV head shared by all: the heads play the role of query positions
            latent_out = F.scaled_dot_product_attention(
                query[:, None], rows, rows[..., :latent_dim], attn_mask=mask, scale=self.scale
            )[:, 0]  # [B, H, L]
        if blocks is not None:
            return torch.ops.hybridllm.gguf_head_linear(
                latent_out.float().contiguous(),
                blocks.uv,
                blocks.ggml_type,
                self.v_dim,
                blocks.activations,
            ).to(q_nope.dtype)  # [B, H, v]
        # [H, B, L] @ [H, L, v] -> [H, B, v]
        w_uv = w_kv_b[:, nope:]  # [H, v, L]
        return torch.bmm(latent_out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    @staticmethod
    def _context(kv_cache: torch.Tensor, block_ids: torch.Tensor, context_len: int) -> torch.Tensor:
        """A sequence's latents [context_len, L + R] gathered from its blocks."""
        gathered = kv_cache.index_select(0, block_ids)  # [nb, bs, L + R]
        return gathered.view(-1, kv_cache.shape[-1])[:context_len]
