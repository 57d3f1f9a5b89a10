"""Per-step attention inputs built by the model runner and read by every attention layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Describes one flattened batch of tokens against the paged KV cache of one KV cache
    group (the first; `other_groups` holds the rest).

    The runner orders sequences so the first `num_decodes` have query length 1
    (pure decode), followed by prefill chunks of any length.
    """

    num_decodes: int
    num_decode_tokens: int  # == num_decodes
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32: context length including this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32, padded with 0
    query_start_loc_cpu: list[int]  # host copies: avoid device syncs in per-seq loops
    seq_lens_cpu: list[int]
    max_seq_len: int
    block_size: int
    # the same step as seen by KV cache groups 1.. (sliding-window layers): the same sequences
    # and lengths, their own slot_mapping and block_tables; empty with one group
    other_groups: tuple[AttentionMetadata, ...] = field(default=())

    @property
    def num_groups(self) -> int:
        return 1 + len(self.other_groups)

    def for_group(self, group: int) -> AttentionMetadata:
        """KV cache group `group`'s view of the step (0: this one)."""
        return self if group == 0 else self.other_groups[group - 1]
