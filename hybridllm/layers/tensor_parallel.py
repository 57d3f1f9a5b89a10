"""Tensor-parallel layers: column/row-parallel linears, vocab-parallel embedding and LM head.

Layers are built already sharded (no full weight is ever allocated): each rank holds the
rows or columns `partition(total, tp_weights, align)` gives it, so shards may be unequal (a
GPU rank can take a larger share than a CPU rank). `load_shard` / `load_full` take the full
HF tensor, or the GGUF blocks a CPU rank keeps, and copy or keep this rank's slice. The
builders return the plain single-worker layer when `tp_group` is None, so a single worker runs
exactly the code it always ran.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hybridllm.layers.linear import Linear
from hybridllm.layers.vocab_embedding import LMHead, VocabEmbedding
from hybridllm.loader.quantized_tensor import QuantizedTensor
from hybridllm.partition import partition

if TYPE_CHECKING:
    from hybridllm.distributed.parallel_groups import TPGroup

Range = tuple[int, int]  # [start, end) of a full dimension


def shard_align(total: int, tp_size: int) -> int:
    """Shard granularity for a split dimension (intermediate size, vocabulary): a multiple
    of 64 or 8 when that still leaves a few units per rank to balance, else 1."""
    for align in (64, 8):
        if total % align == 0 and total // align >= 4 * tp_size:
            return align
    return 1


def local_range(total: int, tp_group: TPGroup | None, align: int | None = None) -> Range:
    """This rank's [start, end) of a dimension of `total` units (all of it without TP)."""
    if tp_group is None:
        return 0, total
    return tp_group.shard_range(
        total, shard_align(total, tp_group.size) if align is None else align
    )


@dataclass(frozen=True)
class HeadShard:
    """A rank's query heads [q_start, q_end) and the KV heads [kv_start, kv_end) they use."""

    q_start: int
    q_end: int
    kv_start: int
    kv_end: int

    @property
    def num_heads(self) -> int:
        return self.q_end - self.q_start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_end - self.kv_start

    def q_rows(self, head_dim: int) -> Range:
        return self.q_start * head_dim, self.q_end * head_dim

    def kv_rows(self, head_dim: int) -> Range:
        return self.kv_start * head_dim, self.kv_end * head_dim


def split_attention_heads(
    num_heads: int, num_kv_heads: int, weights: Sequence[float]
) -> list[HeadShard]:
    """Every rank's heads. With at least as many KV heads as ranks, each rank gets whole KV
    groups (its KV heads and their query heads). With fewer, each rank serves query heads of
    one KV head, which it holds a replica of: ranks are assigned to KV heads in contiguous
    runs by cumulative weight, and each KV head's queries are split among its run."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    weights = tuple(weights)
    tp, group = len(weights), num_heads // num_kv_heads
    if num_kv_heads >= tp:
        return [
            HeadShard(s, e, s // group, e // group) for s, e in partition(num_heads, weights, group)
        ]
    total, before, kv_of_rank, prev = sum(weights), 0.0, [], -1
    for r, w in enumerate(weights):
        raw = int(num_kv_heads * (before + w / 2) / total)  # KV head under this rank's midpoint
        before += w
        # nondecreasing, one step at a time, leaving enough ranks for the remaining KV heads
        kv = min(max(raw, prev, num_kv_heads - tp + r), prev + 1)
        kv_of_rank.append(kv)
        prev = kv
    shards = []
    for kv in range(num_kv_heads):
        run = [r for r in range(tp) if kv_of_rank[r] == kv]
        if len(run) > group:
            raise ValueError(
                f"cannot split {num_heads} query heads over {tp} ranks: KV head {kv} would "
                f"serve {len(run)} ranks but has only {group} query heads"
            )
        for s, e in partition(group, tuple(weights[r] for r in run)):
            shards.append(HeadShard(kv * group + s, kv * group + e, kv, kv + 1))
    return shards


def attention_heads(num_heads: int, num_kv_heads: int, tp_group: TPGroup | None) -> HeadShard:
    """This rank's attention heads (all of them without TP)."""
    if tp_group is None:
        return HeadShard(0, num_heads, 0, num_kv_heads)
    return split_attention_heads(num_heads, num_kv_heads, tp_group.weights)[tp_group.rank]


class ColumnParallelLinear(Linear):
    """Output rows split: each stacked projection keeps its own row range (q, k, v or gate,
    up), so the local output is [q_local | k_local | v_local]. No communication."""

    def __init__(
        self,
        in_features: int,
        full_sizes: Sequence[int],
        row_ranges: Sequence[Range],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__(in_features, [e - s for s, e in row_ranges], bias, dtype, device)
        self.full_sizes = tuple(full_sizes)
        self.row_ranges = tuple(row_ranges)

    def load_shard(
        self, kind: str, shard: int, loaded: torch.Tensor | QuantizedTensor, name: str = ""
    ) -> None:
        full = self.full_sizes[shard]
        if loaded.shape[0] != full:
            raise ValueError(
                f"weight {name or kind}: expected {full} rows (full tensor), got {tuple(loaded.shape)}"
            )
        start, end = self.row_ranges[shard]
        rows = loaded.rows(start, end) if isinstance(loaded, QuantizedTensor) else loaded[start:end]
        super().load_shard(kind, shard, rows, name)


class RowParallelLinear(Linear):
    """Input columns split; partial outputs summed by all-reduce. The bias is added by tp
    rank 0 only, so it enters the sum once."""

    def __init__(
        self,
        full_in_features: int,
        in_range: Range,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        tp_group: TPGroup,
    ):
        super().__init__(in_range[1] - in_range[0], out_features, bias, dtype, device)
        self.full_in_features = full_in_features
        self.in_range = in_range
        self.adds_bias = tp_group.rank == 0
        self.communicator = tp_group.communicator

    def load_shard(
        self, kind: str, shard: int, loaded: torch.Tensor | QuantizedTensor, name: str = ""
    ) -> None:
        if kind == "weight":
            if len(loaded.shape) != 2 or loaded.shape[1] != self.full_in_features:
                raise ValueError(
                    f"weight {name or kind}: expected {self.full_in_features} columns "
                    f"(full tensor), got {tuple(loaded.shape)}"
                )
            start, end = self.in_range
            if isinstance(loaded, QuantizedTensor):
                columns = loaded.columns(start, end)  # None unless on block boundaries
                loaded = loaded.dequantize()[:, start:end] if columns is None else columns
            else:
                loaded = loaded[:, start:end]
        super().load_shard(kind, shard, loaded, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [n, out], this rank's share of the sum
        partial = self.local_linear(x, self.bias if self.adds_bias else None)
        return self.communicator.all_reduce(partial)


def column_linear(
    in_features: int,
    full_sizes: Sequence[int],
    row_ranges: Sequence[Range],
    bias: bool,
    dtype: torch.dtype,
    device: torch.device,
    tp_group: TPGroup | None,
) -> Linear:
    """A (stacked) projection whose outputs stay sharded; plain `Linear` without TP."""
    if tp_group is None:
        return Linear(in_features, tuple(full_sizes), bias, dtype, device)
    return ColumnParallelLinear(in_features, full_sizes, row_ranges, bias, dtype, device)


def row_linear(
    full_in_features: int,
    in_range: Range,
    out_features: int,
    bias: bool,
    dtype: torch.dtype,
    device: torch.device,
    tp_group: TPGroup | None,
) -> Linear:
    """A projection from sharded inputs to full (all-reduced) outputs; plain without TP."""
    if tp_group is None:
        return Linear(full_in_features, out_features, bias, dtype, device)
    return RowParallelLinear(
        full_in_features, in_range, out_features, bias, dtype, device, tp_group
    )


def _check_vocab_rows(loaded: torch.Tensor | QuantizedTensor, vocab_size: int, name: str) -> None:
    if loaded.shape[0] != vocab_size:
        raise ValueError(
            f"weight {name}: expected {vocab_size} vocabulary rows (full tensor), "
            f"got {tuple(loaded.shape)}"
        )


class VocabParallelEmbedding(VocabEmbedding):
    """Rows [vocab_start, vocab_end) of the table; ids elsewhere give zeros, and the
    all-reduce fills each row in from the rank that holds it."""

    def __init__(
        self, vocab_size: int, dim: int, dtype: torch.dtype, device: torch.device, tp_group: TPGroup
    ):
        start, end = local_range(vocab_size, tp_group)
        super().__init__(end - start, dim, dtype, device)
        self.vocab_size, self.vocab_start, self.vocab_end = vocab_size, start, end
        self.communicator = tp_group.communicator

    def load_full(self, loaded: torch.Tensor | QuantizedTensor, name: str) -> None:
        _check_vocab_rows(loaded, self.vocab_size, name)
        if isinstance(loaded, QuantizedTensor):
            rows = loaded.rows(self.vocab_start, self.vocab_end)
            self.use_blocks(rows.blocks(), rows.ggml_type, name)
        else:
            self.weight.copy_(loaded[self.vocab_start : self.vocab_end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start  # [n]
        outside = (local < 0) | (local >= self.vocab_end - self.vocab_start)
        hidden = super().forward(local.masked_fill(outside, 0))  # [n, dim]
        hidden.masked_fill_(outside.unsqueeze(-1), 0)
        return self.communicator.all_reduce(hidden)


class ParallelLMHead(LMHead):
    """Vocabulary rows split like the embedding's (a tied head shares its shard); the local
    logits are all-gathered so the sampler sees full [n, vocab] rows."""

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        dtype: torch.dtype,
        device: torch.device,
        tp_group: TPGroup,
        tied_to: VocabParallelEmbedding | None = None,
    ):
        ranges = tp_group.shard_ranges(vocab_size, shard_align(vocab_size, tp_group.size))
        start, end = ranges[tp_group.rank]
        super().__init__(end - start, dim, dtype, device, tied_to)
        self.vocab_size, self.vocab_start, self.vocab_end = vocab_size, start, end
        self.vocab_sizes = [e - s for s, e in ranges]  # every rank's logits width
        self.communicator = tp_group.communicator

    def load_full(self, loaded: torch.Tensor | QuantizedTensor, name: str) -> None:
        if isinstance(loaded, QuantizedTensor):
            self.load_blocks(loaded, name)
            return
        _check_vocab_rows(loaded, self.vocab_size, name)
        self.weight.copy_(loaded[self.vocab_start : self.vocab_end])

    def load_blocks(self, blocks: QuantizedTensor, name: str) -> None:
        """Keep this rank's rows of the full table's GGUF blocks."""
        _check_vocab_rows(blocks, self.vocab_size, name)
        super().load_blocks(blocks.rows(self.vocab_start, self.vocab_end), name)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().forward(hidden_states)  # [n, local vocab] float32
        return self.communicator.all_gather(logits, self.vocab_sizes, dim=-1)  # [n, vocab]


def vocab_embedding(
    vocab_size: int, dim: int, dtype: torch.dtype, device: torch.device, tp_group: TPGroup | None
) -> VocabEmbedding:
    """The token embedding: vocab-parallel under TP, plain otherwise."""
    if tp_group is None:
        return VocabEmbedding(vocab_size, dim, dtype, device)
    return VocabParallelEmbedding(vocab_size, dim, dtype, device, tp_group)


def lm_head(
    vocab_size: int,
    dim: int,
    dtype: torch.dtype,
    device: torch.device,
    tp_group: TPGroup | None,
    tied_to: VocabEmbedding | None = None,
) -> LMHead:
    """The LM head: vocab-parallel with gathered logits under TP, plain otherwise."""
    if tp_group is None:
        return LMHead(vocab_size, dim, dtype, device, tied_to=tied_to)
    return ParallelLMHead(vocab_size, dim, dtype, device, tp_group, tied_to=tied_to)
