"""Per-step attention inputs derived once from AttentionMetadata and shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
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
class VarlenPrefill:
    """Every prefill sequence of a step as one variable-length attention call: queries are the
    step's rows from the first prefill on; keys either the same rows (`kv_slots` None: no
    sequence has a cached prefix) or each sequence's context gathered from the cache."""

    cu_seqlens_q: torch.Tensor  # [num_prefills + 1] int32, query row offsets
    cu_seqlens_k: torch.Tensor  # [num_prefills + 1] int32, key row offsets
    max_query_len: int
    max_key_len: int
    # [cu_seqlens_k[-1]] int64 cache slots of each sequence's keys, from the first one its
    # window lets a query see (the keys end where its queries end: causal, aligned bottom-right)
    kv_slots: torch.Tensor | None


@dataclass
class PreparedAttention:
    """What every attention layer of one step needs, computed once per model forward.

    Masks and varlen offsets are built lazily per sliding window and cached here, and other
    layers' per-step inputs (linear attention's batch) in `cache` (this object lives one step).
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
    block_tables: torch.Tensor | None = None  # [num_seqs, max_num_blocks] int32, every sequence
    # KV cache groups 1.. (sliding-window layers): the same step over their own block tables
    other_groups: tuple[PreparedAttention, ...] = ()
    _masks: dict = field(default_factory=dict)
    cache: dict = field(default_factory=dict)

    def for_group(self, group: int) -> PreparedAttention:
        """What the layers of KV cache group `group` read (0: this one)."""
        return self if group == 0 else self.other_groups[group - 1]

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

    def varlen_prefill(self, sliding_window: int | None) -> VarlenPrefill:
        """The prefills' offsets (and key slots) for one varlen attention call; built once per
        step and window, on the host, with one copy to the device each."""
        seqs = self.prefills
        reads_cache = any(s.block_ids is not None for s in seqs)
        key = ("varlen", sliding_window if reads_cache else None)
        varlen = self._masks.get(key)
        if varlen is not None:
            return varlen
        device = self.slot_mapping.device
        q_lens = [s.query_len for s in seqs]
        cu_q = _to_device(_offsets(q_lens), device)
        if not reads_cache:
            varlen = VarlenPrefill(cu_q, cu_q, max(q_lens), max(q_lens), None)
        else:
            # a query at position p sees keys in (p - window, p]: the chunk's first query
            # bounds the keys its sequence needs
            key_starts = [
                0
                if sliding_window is None
                else max(0, s.context_len - s.query_len - sliding_window + 1)
                for s in seqs
            ]
            k_lens = [s.context_len - k0 for s, k0 in zip(seqs, key_starts)]
            seq_of_key = np.repeat(np.array([s.index for s in seqs], dtype=np.int64), k_lens)
            pos = np.concatenate([np.arange(k0, s.context_len) for s, k0 in zip(seqs, key_starts)])
            seq_t = _to_device(seq_of_key, device)
            pos_t = _to_device(pos.astype(np.int64), device)
            blocks = self.block_tables[seq_t, pos_t // self.block_size].long()
            slots = blocks * self.block_size + pos_t % self.block_size  # [sum k_lens]
            cu_k = _to_device(_offsets(k_lens), device)
            varlen = VarlenPrefill(cu_q, cu_k, max(q_lens), max(k_lens), slots)
        self._masks[key] = varlen
        return varlen


def _offsets(lengths: list[int]) -> np.ndarray:
    """[0, l0, l0 + l1, ...] as int32."""
    out = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=out[1:])
    return out


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device`; to a GPU from pinned memory without waiting for queued work."""
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def prepare_attention(meta: AttentionMetadata) -> PreparedAttention:
    """Derive the per-step tensors (block id lists, lengths) from host lists, without syncs;
    for every KV cache group of the step (`PreparedAttention.for_group`)."""
    prep = _prepare_group(meta)
    if meta.other_groups:
        prep.other_groups = tuple(_prepare_group(m) for m in meta.other_groups)
    return prep


def _prepare_group(meta: AttentionMetadata) -> PreparedAttention:
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
        block_tables=meta.block_tables,
    )
