"""Gated DeltaNet, the linear-attention layer of Qwen3-Next and Qwen3.5, with its state."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridllm.layers.cpu_kernels import load_cpu_kernels
from hybridllm.layers.gated_delta_rule import (
    causal_conv1d,
    chunk_gated_delta_rule,
    l2norm,
    recurrent_gated_delta_rule,
)
from hybridllm.layers.linear import Linear
from hybridllm.layers.prepared_attention import PreparedAttention

WeightLoader = Callable[[torch.Tensor], None]


@dataclass(frozen=True)
class DeltaNetShape:
    """A layer's sizes, from an HF text config (qwen3_next, qwen3_5_text, qwen3_5_moe_text)."""

    hidden: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    eps: float

    @classmethod
    def from_hf(cls, hf_config: Any) -> DeltaNetShape:
        shape = cls(
            hidden=hf_config.hidden_size,
            num_k_heads=hf_config.linear_num_key_heads,
            num_v_heads=hf_config.linear_num_value_heads,
            head_k_dim=hf_config.linear_key_head_dim,
            head_v_dim=hf_config.linear_value_head_dim,
            conv_kernel=hf_config.linear_conv_kernel_dim,
            eps=hf_config.rms_norm_eps,
        )
        if shape.num_v_heads % shape.num_k_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(f"Gated DeltaNet: unsupported hidden_act {hf_config.hidden_act!r}")
        return shape

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:  # the conv's channels: q | k | v
        return 2 * self.key_dim + self.value_dim


class DeltaNetState:
    """One layer's per-sequence state, in `num_slots` slots, fp32, updated in place.

    conv [slots, conv_dim, K-1]: each sequence's last K-1 conv inputs; recurrent [slots, Hv,
    Dk, Dv]: the delta rule's memory. Neither grows with the sequence's length.
    """

    def __init__(self, shape: DeltaNetShape, num_slots: int, device: torch.device | str = "cpu"):
        self.conv = torch.zeros(
            num_slots, shape.conv_dim, shape.conv_kernel - 1, dtype=torch.float32, device=device
        )
        self.recurrent = torch.zeros(
            num_slots,
            shape.num_v_heads,
            shape.head_k_dim,
            shape.head_v_dim,
            dtype=torch.float32,
            device=device,
        )

    def nbytes_per_slot(self) -> int:
        return (self.conv[0].numel() + self.recurrent[0].numel()) * 4

    @staticmethod
    def floats_per_slot(shape: DeltaNetShape) -> int:
        """One slot's conv and recurrent state, in fp32 values."""
        conv = shape.conv_dim * (shape.conv_kernel - 1)
        return conv + shape.num_v_heads * shape.head_k_dim * shape.head_v_dim

    @classmethod
    def in_buffer(cls, shape: DeltaNetShape, buffer: torch.Tensor) -> DeltaNetState:
        """The state of `buffer` [num_slots * floats_per_slot] fp32 (a worker's cache tensor for
        this layer): every slot's conv state first, then every slot's recurrent state, so each
        part is one contiguous tensor. Views, no copy."""
        per_slot = cls.floats_per_slot(shape)
        num_slots = buffer.numel() // per_slot
        conv = shape.conv_dim * (shape.conv_kernel - 1)
        state = cls.__new__(cls)
        state.conv = buffer[: num_slots * conv].view(
            num_slots, shape.conv_dim, shape.conv_kernel - 1
        )
        state.recurrent = buffer[num_slots * conv : num_slots * per_slot].view(
            num_slots, shape.num_v_heads, shape.head_k_dim, shape.head_v_dim
        )
        return state


@dataclass(frozen=True)
class DeltaNetBatch:
    """The sequences of one forward: sequence s owns the flattened rows [query_start_loc[s],
    query_start_loc[s+1]), starts from a zero state when fresh[s] (else continues its slot's
    state), and reads and writes state slot slots[s]."""

    query_start_loc: torch.Tensor  # int64 [num_seqs + 1], CPU
    fresh: torch.Tensor  # bool [num_seqs], CPU
    slots: torch.Tensor  # int64 [num_seqs], CPU

    @classmethod
    def build(
        cls, lengths: Sequence[int], fresh: Sequence[bool], slots: Sequence[int]
    ) -> DeltaNetBatch:
        if not len(lengths) == len(fresh) == len(slots):
            raise ValueError("lengths, fresh and slots must have one entry per sequence")
        starts = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        starts[1:] = torch.tensor(list(lengths), dtype=torch.int64).cumsum(0)
        return cls(
            starts,
            torch.tensor(list(fresh), dtype=torch.bool),
            torch.tensor(list(slots), dtype=torch.int64),
        )

    @property
    def num_seqs(self) -> int:
        return self.slots.shape[0]

    @property
    def any_fresh(self) -> bool:
        return bool(self.fresh.any())

    @classmethod
    def of_step(cls, prep: PreparedAttention) -> DeltaNetBatch:
        """The step's sequences as the state group's prepared view sees them: each reads and
        writes the slot in column 0 of its block table, and is fresh when this step starts its
        first token. Built once per step, shared by every linear layer."""
        batch = prep.cache.get("delta_net")
        if batch is None:
            lengths = [1] * prep.num_decodes + [s.query_len for s in prep.prefills]
            # a decode row of context 1 is a one-token prompt's first step
            fresh = [n == 1 for n in prep.decode_seq_lens_cpu] + [
                s.context_len == s.query_len for s in prep.prefills
            ]
            slots = prep.block_tables[:, 0].tolist()
            batch = prep.cache["delta_net"] = cls.build(lengths, fresh, slots)
        return batch


class GatedDeltaNet(nn.Module):
    """in-projections -> causal conv1d + silu on q|k|v -> gated delta rule -> RMSNorm per
    value head gated by silu(z) -> out_proj. Native ops on a CPU (`use_cpu_kernels` and the
    kernels built), else torch: see `_delta_rule` for which form of the rule runs where.

    The projections hold canonical row orders (q heads | k heads | v heads | z heads; b | a):
    Qwen3-Next's fused checkpoints interleave them per key head and the loader reorders.
    """

    def __init__(
        self,
        hf_config: Any,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        use_cpu_kernels: bool = True,
    ):
        super().__init__()
        self.shape = s = DeltaNetShape.from_hf(hf_config)
        self.fused_checkpoint = getattr(hf_config, "model_type", "") == "qwen3_next"
        device = torch.device(device)
        self.in_proj_qkvz = Linear(s.hidden, (s.conv_dim, s.value_dim), False, dtype, device)
        self.in_proj_ba = Linear(s.hidden, (s.num_v_heads, s.num_v_heads), False, dtype, device)
        self.out_proj = Linear(s.value_dim, s.hidden, False, dtype, device)
        f32 = {"dtype": torch.float32, "device": device}
        # fp32 like the state: the conv's taps [conv_dim, K], the decay's parameters [Hv], and
        # the gated norm's weight [Dv] (shared by every value head)
        self.conv_weight = nn.Parameter(torch.empty(s.conv_dim, s.conv_kernel, **f32), False)
        self.A_log = nn.Parameter(torch.empty(s.num_v_heads, **f32), False)
        self.dt_bias = nn.Parameter(torch.empty(s.num_v_heads, **f32), False)
        self.norm_weight = nn.Parameter(torch.empty(s.head_v_dim, **f32), False)
        self.use_cpu_kernels = use_cpu_kernels
        self.kv_group = 0  # the state group's index among the KV cache groups (the model sets it)

    def weight_loaders(self, prefix: str) -> dict[str, WeightLoader]:
        """HF name -> loader: Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a; Qwen3-Next
        also its checkpoint's fused in_proj_qkvz (or a GGUF file's in_proj_qkv and in_proj_z:
        `fused_names`) and fused in_proj_ba; conv1d.weight [C, 1, K]."""
        # here, not at the top: the model files that import this module import models.base
        from hybridllm.models.base import copy_loader, linear_loaders

        loaders = linear_loaders(prefix, self.in_proj_qkvz, ("in_proj_qkv", "in_proj_z"))
        if self.fused_checkpoint:
            loaders[f"{prefix}in_proj_qkvz.weight"] = self._fused_loader(self.in_proj_qkvz, "qkvz")
            loaders[f"{prefix}in_proj_ba.weight"] = self._fused_loader(self.in_proj_ba, "ba")
        else:
            loaders.update(linear_loaders(prefix, self.in_proj_ba, ("in_proj_b", "in_proj_a")))
        loaders.update(linear_loaders(prefix, self.out_proj, "out_proj"))
        conv = self.conv_weight
        loaders[f"{prefix}conv1d.weight"] = copy_loader(conv.view(-1, 1, conv.shape[1]), "conv1d")
        for name, param in (("A_log", self.A_log), ("dt_bias", self.dt_bias)):
            loaders[f"{prefix}{name}"] = copy_loader(param, name)
        loaders[f"{prefix}norm.weight"] = copy_loader(self.norm_weight, "norm.weight")
        return loaders

    def fused_names(self, prefix: str) -> dict[str, set[str]]:
        """A fused checkpoint tensor -> the split names it stands for (one way or the other
        loads the rows; the model counts either as complete)."""
        if not self.fused_checkpoint:
            return {}
        split = {f"{prefix}in_proj_qkv.weight", f"{prefix}in_proj_z.weight"}
        return {f"{prefix}in_proj_qkvz.weight": split}

    def _fused_loader(self, linear: Linear, kind: str) -> WeightLoader:
        """Qwen3-Next stores, per key head, [q | k | its value heads' v | their z] (qkvz) or
        [their b | their a] (ba); load it as the canonical shards."""
        s = self.shape
        group = s.num_v_heads // s.num_k_heads
        if kind == "qkvz":
            sizes = [s.head_k_dim, s.head_k_dim, group * s.head_v_dim, group * s.head_v_dim]
        else:
            sizes = [group, group]

        def load(loaded: torch.Tensor) -> None:
            if tuple(loaded.shape) != (linear.out_features, s.hidden):
                raise ValueError(f"in_proj_{kind}: expected {(linear.out_features, s.hidden)}")
            parts = loaded.reshape(s.num_k_heads, sum(sizes), s.hidden).split(sizes, dim=1)
            parts = [p.reshape(-1, s.hidden) for p in parts]  # each [heads * size, hidden]
            if kind == "qkvz":
                parts = [torch.cat(parts[:3]), parts[3]]
            for shard, part in enumerate(parts):
                linear.load_shard("weight", shard, part, f"in_proj_{kind}")

        return load

    def native(self, x: torch.Tensor) -> bool:
        return self.use_cpu_kernels and x.device.type == "cpu" and load_cpu_kernels()

    def forward(
        self, hidden_states: torch.Tensor, batch: DeltaNetBatch, state: DeltaNetState
    ) -> torch.Tensor:
        """hidden_states [T, hidden] of batch's sequences, flattened -> [T, hidden]; each
        sequence's state slot is read and then updated in place."""
        s = self.shape
        qkvz = self.in_proj_qkvz(hidden_states)  # [T, conv_dim + value_dim]
        qkv, z = qkvz.float().split([s.conv_dim, s.value_dim], dim=-1)
        b, a = self.in_proj_ba(hidden_states).float().chunk(2, dim=-1)  # [T, Hv] each
        beta = b.sigmoid()
        g = -self.A_log.exp() * F.softplus(a + self.dt_bias)  # [T, Hv] log decay, <= 0
        native = self.native(hidden_states)
        if native:
            qkv = torch.ops.hybridllm.gdn_conv1d(
                qkv.contiguous(),
                state.conv,
                self.conv_weight,
                batch.query_start_loc,
                batch.fresh,
                batch.slots,
            )
        else:
            starts = batch.query_start_loc.tolist()
            qkv = causal_conv1d(
                qkv,
                state.conv,
                self.conv_weight,
                starts,
                batch.fresh.tolist(),
                batch.slots.tolist(),
            )
        core = self._delta_rule(qkv, g, beta.contiguous(), batch, state, native)  # [T, Hv, Dv]
        # RMSNorm over each head's Dv, then the output gate silu(z)
        z = z.reshape(-1, s.num_v_heads, s.head_v_dim)
        normed = core * torch.rsqrt(core.pow(2).mean(-1, keepdim=True) + s.eps)
        gated = normed * self.norm_weight * F.silu(z)
        return self.out_proj(gated.reshape(-1, s.value_dim).to(hidden_states.dtype))

    def _delta_rule(
        self,
        qkv: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        batch: DeltaNetBatch,
        state: DeltaNetState,
        native: bool,
    ) -> torch.Tensor:
        """qkv [T, conv_dim] (conv output), g, beta [T, Hv] -> [T, Hv, Dv] fp32.

        Natively every sequence takes the recurrent form, token by token in one call: on one
        core it beat the torch chunked form 1.8x for a 512-token prefill at Qwen3-Next's sizes
        (125 vs 228 ms; the per-head state, 64 KiB, stays in cache, and the flops per token are
        about the same), and 7.7x for a decode step of 8 rows (1.9 vs 14.7 ms); since the state
        goes through a run of tokens in 16-column blocks (8 KiB, in L1), a 2,048-token chunk
        of 32 prompts takes 62 instead of 185 ms on 2 cores. In
        torch, sequences of one token take the recurrent step together, longer ones the
        chunked form (matrix products instead of a Python loop over tokens)."""
        s = self.shape
        if batch.any_fresh:  # the conv has its own fresh flag; decode steps have none fresh
            state.recurrent[batch.slots[batch.fresh]] = 0.0
        if native:
            return torch.ops.hybridllm.gdn_recurrent(
                qkv, g, beta, state.recurrent, batch.query_start_loc, batch.slots, s.num_k_heads
            )
        starts = batch.query_start_loc.tolist()
        lengths = [end - start for start, end in zip(starts, starts[1:])]
        out = torch.empty(qkv.shape[0], s.num_v_heads, s.head_v_dim, device=qkv.device)
        single = [i for i, n in enumerate(lengths) if n == 1]
        if single:
            rows, slots = torch.tensor([starts[i] for i in single]), batch.slots[single]
            q, k, v = self._heads(qkv[rows])
            rec = state.recurrent[slots]  # [B, Hv, Dk, Dv] gathered, then written back
            out[rows] = recurrent_gated_delta_rule(q, k, v, g[rows], beta[rows], rec)
            state.recurrent[slots] = rec
        for i, n in enumerate(lengths):
            if n > 1:
                span = slice(starts[i], starts[i + 1])
                q, k, v = self._heads(qkv[span])
                # a view of the slot: updated in place
                rec = state.recurrent[int(batch.slots[i])]
                out[span] = chunk_gated_delta_rule(q, k, v, g[span], beta[span], rec)
        return out

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [T, conv_dim] -> q, k [T, Hv, Dk] (l2-normalized, q scaled by Dk^-0.5, each key
        head repeated for its Hv/Hk value heads) and v [T, Hv, Dv]."""
        s = self.shape
        q, k, v = qkv.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        group = s.num_v_heads // s.num_k_heads
        q, k = (
            l2norm(x.reshape(-1, s.num_k_heads, s.head_k_dim)).repeat_interleave(group, dim=1)
            for x in (q, k)
        )
        return q * s.head_k_dim**-0.5, k, v.reshape(-1, s.num_v_heads, s.head_v_dim)
