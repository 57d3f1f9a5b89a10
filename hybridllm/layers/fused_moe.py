"""The routed experts of an MoE layer: top-k routing, tokens grouped by expert, weighted sum back."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridllm.layers.expert_weights import StackedExpertWeight
from hybridllm.layers.gguf_linear import default_activations
from hybridllm.layers.moe_routing import (
    SCORING_FUNCTIONS,
    GroupLimitedRouting,
    group_by_expert,
    select_experts,
    select_experts_grouped,
)


class FusedMoE(nn.Module):
    """E SiLU-gated experts: `down_e(silu(gate_e(x)) * up_e(x))`, each token through its top-k.

    `w13` stacks every expert's gate and up rows [E, 2I, H], `w2` its down rows [E, H, I]
    (floats, or GGUF blocks computed by the native op). A step groups its (token, slot) pairs
    by expert and runs each selected expert once over all its tokens, so only the selected
    experts' bytes are read: a decode token reads top_k of E experts.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        dtype: torch.dtype,
        device: torch.device,
        scoring: str = "softmax",
        hidden_act: str = "silu",
        grouping: GroupLimitedRouting | None = None,
    ):
        """`grouping`: DeepSeek's group-limited routing, choice bias and scaling (None: plain
        top-k); with its `correction_bias` the module holds the [E] bias, loaded like a weight."""
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"MoE experts support hidden_act='silu' only, got {hidden_act!r}")
        if scoring not in SCORING_FUNCTIONS:
            raise ValueError(f"MoE scoring must be one of {SCORING_FUNCTIONS}, got {scoring!r}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in [1, {num_experts}]")
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize
        self.scoring = scoring
        self.grouping = grouping
        self.correction_bias = None
        if grouping is not None:
            grouping.check(num_experts, top_k)
            if grouping.correction_bias:
                bias = torch.zeros(num_experts, dtype=torch.float32, device=device)
                self.correction_bias = nn.Parameter(bias, requires_grad=False)
        self.w13 = StackedExpertWeight(
            num_experts, (intermediate_size, intermediate_size), hidden_size, dtype, device
        )
        self.w2 = StackedExpertWeight(num_experts, (hidden_size,), intermediate_size, dtype, device)
        self.native = False  # CPU: the compiled hybridllm::silu_and_mul and fused_moe
        # fused_moe's `activations` (as Linear's: the engine config's, set after loading)
        self.activations = default_activations()

    def finish_loading(self) -> None:
        self.w13.finish_loading()
        self.w2.finish_loading()

    def use_native_op(self) -> None:
        """Use the compiled SiLU-and-mul and, for blocks, the whole-block op.

        Call only when `load_cpu_kernels()` is True."""
        self.native = True

    def use_f32_kernel(self) -> None:
        """fp32 CPU experts through the native op's GEMM (where torch's BLAS is slower)."""
        self.w13.use_f32_kernel()
        self.w2.use_f32_kernel()

    def _silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.native and gate_up.is_contiguous():
            return torch.ops.hybridllm.silu_and_mul(gate_up)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return F.silu(gate).mul_(up)

    def select(
        self, router_logits: torch.Tensor, native: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts: (weights [n, k] float32, ids [n, k] int64); `native`: plain
        top-k through the compiled op."""
        if self.grouping is not None:
            return select_experts_grouped(
                router_logits,
                self.top_k,
                self.scoring,
                self.renormalize,
                self.grouping,
                self.correction_bias,
            )
        if native:
            return torch.ops.hybridllm.route_experts(
                router_logits, self.top_k, self.scoring == "sigmoid", self.renormalize
            )
        return select_experts(router_logits, self.top_k, self.scoring, self.renormalize)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden], router_logits [num_tokens, E] -> [num_tokens, hidden]."""
        w13, w2 = self.w13.qweight, self.w2.qweight
        native = self.native and w13 is not None and w2 is not None
        weights, expert_ids = self.select(router_logits, native)  # [n, k] fp32, [n, k] int64
        if native:
            # the whole block in one native call: no per-expert Python
            out = torch.ops.hybridllm.fused_moe(
                x.float(),
                weights,
                expert_ids,
                w13,
                self.w13.ggml_type,
                w2,
                self.w2.ggml_type,
                self.activations,
            )
            return out.to(x.dtype)  # [n, hidden]
        groups = group_by_expert(expert_ids, self.num_experts)
        rows = x[groups.token_ids]  # [n * k, hidden], grouped by expert
        out = torch.empty_like(rows)  # [n * k, hidden]
        for expert in groups.active:
            start, end = groups.offsets[expert], groups.offsets[expert + 1]
            gate_up = self.w13.matmul(expert, rows[start:end])  # [count, 2 * I]
            out[start:end] = self.w2.matmul(expert, self._silu_and_mul(gate_up))
        # back in (token, slot) order [n, k, hidden], then each token's weighted sum in fp32
        # (index_select + bmm: index_add_ took 80 ms for 60 rows on torch 2.13's CPU build)
        by_slot = out.index_select(0, groups.inverse).view(x.shape[0], self.top_k, -1).float()
        return torch.bmm(weights.unsqueeze(1), by_slot).squeeze(1).to(x.dtype)  # [n, hidden]
