"""Per-step attention inputs derived once from AttentionMetadata and shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridllm.layers.attention_metadata import AttentionMetadata


@dataclass
class PrefillSequence:
    """One prefill (or chunked-prefill) sequence of the batch."""

    index: int  # position of the sequence in the batch
    query_start: int  # its first row in the flattened tokens
    query_end: int
    context_len: int  # tokens it attends to: cached prefix + this chunk
    # [num_context_blocks] ids of the blocks holding its context; None when the chunk is the
    # whole context (no cached prefix), so attention reads the fresh k/v and skips the gather
    block_ids: torch.Tensor | None

    @property
    def query_len(self) -> int:
        return self.query_end - self.query_start


@dataclass
class PreparedAttention:
    """What every attention layer of one step needs, computed once per model forward.

    Masks are built lazily per sliding window and cached here (this object lives one step).
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_size: int
    num_decodes: int
    decode_seq_lens_cpu: list[int]
    decode_seq_lens: torch.Tensor | None  # [num_decodes] on device
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_num_blocks] int32
    # [num_decodes * decode_blocks] block ids, row-major: sequence, then block
    decode_block_ids: torch.Tensor | None
    decode_padded_len: int  # decode_blocks * block_size
    prefills: list[PrefillSequence]
    reads_cache: bool  # any decode row or cached prefix: attention must read the KV cache
    _masks: dict = field(default_factory=dict)

    def decode_mask(self, sliding_window: int | None) -> torch.Tensor:
        """[num_decodes, 1, 1, padded_len] bool: True where a decode row may attend."""
        key = ("decode", sliding_window)
        mask = self._masks.get(key)
        if mask is None:
            lens = self.decode_seq_lens[:, None]  # [B, 1]
            key_pos = torch.arange(self.decode_padded_len, device=lens.device)[None, :]  # [1, L]
            mask = key_pos < lens
            if sliding_window is not None:
                mask &= key_pos >= lens - sliding_window
            mask = mask[:, None, None, :]
            self._masks[key] = mask
        return mask

    def prefill_mask(self, seq: PrefillSequence, sliding_window: int | None) -> torch.Tensor | None:
        """[query_len, context_len] bool causal mask offset by the cached prefix.

        Query row i sits at absolute position context_len - query_len + i and sees keys at
        positions <= its own (and, with a sliding window, > its own - window). None means
        plain causal attention over the chunk alone (SDPA's is_causal).
        """
        if seq.block_ids is None and sliding_window is None:
            return None
        key = (seq.index, sliding_window)
        mask = self._masks.get(key)
        if mask is None:
            device = self.slot_mapping.device
            first = seq.context_len - seq.query_len
            query_pos = torch.arange(first, seq.context_len, device=device)[:, None]
            key_pos = torch.arange(seq.context_len, device=device)[None, :]
            mask = key_pos <= query_pos
            if sliding_window is not None:
                mask &= key_pos > query_pos - sliding_window
            self._masks[key] = mask
        return mask


def prepare_attention(meta: AttentionMetadata) -> PreparedAttention:
    """Derive the per-step tensors (block id lists, lengths) from host lists, without syncs."""
    num_decodes = meta.num_decodes
    block_size = meta.block_size
    starts = meta.query_start_loc_cpu
    seq_lens = meta.seq_lens_cpu
    num_seqs = len(seq_lens)
    if len(starts) != num_seqs + 1:
        raise ValueError(
            f"query_start_loc_cpu has {len(starts)} entries, expected num_seqs + 1 = {num_seqs + 1}"
        )

    decode_lens = list(seq_lens[:num_decodes])
    if num_decodes and starts[num_decodes] != num_decodes:
        raise ValueError(
            f"the first {num_decodes} sequences must be decodes with one query token each, "
            f"but they hold {starts[num_decodes]} tokens"
        )
    decode_block_ids = None
    decode_seq_lens = None
    decode_block_tables = None
    padded_len = 0
    if num_decodes:
        num_blocks = -(-max(decode_lens) // block_size)
        padded_len = num_blocks * block_size
        decode_block_ids = meta.block_tables[:num_decodes, :num_blocks].reshape(-1)
        decode_seq_lens = meta.seq_lens[:num_decodes]
        decode_block_tables = meta.block_tables[:num_decodes]

    prefills = []
    for i in range(num_decodes, num_seqs):
        query_len = starts[i + 1] - starts[i]
        context_len = seq_lens[i]
        if context_len < query_len:
            raise ValueError(
                f"sequence {i}: seq_len {context_len} is shorter than its query length {query_len}"
            )
        block_ids = None
        if context_len != query_len:
            block_ids = meta.block_tables[i, : -(-context_len // block_size)]
        prefills.append(PrefillSequence(i, starts[i], starts[i + 1], context_len, block_ids))

    return PreparedAttention(
        slot_mapping=meta.slot_mapping,
        block_size=block_size,
        num_decodes=num_decodes,
        decode_seq_lens_cpu=decode_lens,
        decode_seq_lens=decode_seq_lens,
        decode_block_tables=decode_block_tables,
        decode_block_ids=decode_block_ids,
        decode_padded_len=padded_len,
        prefills=prefills,
        reads_cache=bool(num_decodes) or any(s.block_ids is not None for s in prefills),
    )
