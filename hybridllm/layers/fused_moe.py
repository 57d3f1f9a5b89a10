"""The routed experts of an MoE layer: top-k routing, tokens grouped by expert, weighted sum back."""

from __future__ import annotations

import torch
from torch import nn

from hybridllm.layers.expert_weights import StackedExpertWeight
from hybridllm.layers.gguf_linear import default_activations
from hybridllm.layers.mlp import ExpertActivation
from hybridllm.layers.moe_routing import (
    SCORING_FUNCTIONS,
    GroupLimitedRouting,
    group_by_expert,
    select_experts,
    select_experts_grouped,
)

# hybridllm::fused_moe's `act` codes (fused_moe_cpu.cpp's ExpertAct), by ExpertActivation name.
NATIVE_ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu_tanh": 1, "swigluoai": 2}


class FusedMoE(nn.Module):
    """E gated experts: `down_e(act(gate_e(x), up_e(x)))`, each token through its top-k.

    `act` is SiLU-and-mul, or gpt-oss's clamped form (`ExpertActivation`); with `bias` each
    expert adds its own gate/up bias [E, 2I] and down bias [E, H] (gpt-oss).

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
        hidden_act: str | ExpertActivation = "silu",
        grouping: GroupLimitedRouting | None = None,
        bias: bool = False,
    ):
        """`grouping`: DeepSeek's group-limited routing, choice bias and scaling (None: plain
        top-k); with its `correction_bias` the module holds the [E] bias, loaded like a weight."""
        super().__init__()
        self.activation = (
            hidden_act if isinstance(hidden_act, ExpertActivation) else ExpertActivation(hidden_act)
        )
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
                # not `bias`: that names the experts' own biases' flag below
                correction = torch.zeros(num_experts, dtype=torch.float32, device=device)
                self.correction_bias = nn.Parameter(correction, requires_grad=False)
        self.w13 = StackedExpertWeight(
            num_experts, (intermediate_size, intermediate_size), hidden_size, dtype, device
        )
        self.w2 = StackedExpertWeight(num_experts, (hidden_size,), intermediate_size, dtype, device)
        self.w13_bias = self.w2_bias = None
        if bias:
            # [E, 2I] in w13's row order (gate | up), [E, H]
            zeros = torch.zeros(num_experts, 2 * intermediate_size, dtype=dtype, device=device)
            self.w13_bias = nn.Parameter(zeros, requires_grad=False)
            zeros = torch.zeros(num_experts, hidden_size, dtype=dtype, device=device)
            self.w2_bias = nn.Parameter(zeros, requires_grad=False)
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

    @property
    def plain(self) -> bool:
        """SiLU-and-mul without biases: what the native decode stack's layers compute (the
        fused_moe op itself computes every activation, with or without biases)."""
        return self.activation.name == "silu" and self.w13_bias is None

    def _native_activation(self) -> tuple[int, float, float]:
        """fused_moe's activation code, alpha and limit (NATIVE_ACTIVATIONS)."""
        act = self.activation
        return NATIVE_ACTIVATIONS[act.name], float(act.alpha), float(act.limit)

    def _native_bias(self, bias: torch.Tensor | None) -> torch.Tensor | None:
        # float32 for the op: the loaded parameter itself when it is (a copy a call otherwise,
        # [E, 2I] + [E, H] values: small beside the experts' blocks a step reads)
        return None if bias is None else bias.detach().float().contiguous()

    def _act_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.native and self.activation.name == "silu" and gate_up.is_contiguous():
            return torch.ops.hybridllm.silu_and_mul(gate_up)
        return self.activation(gate_up)

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
            act, alpha, limit = self._native_activation()
            out = torch.ops.hybridllm.fused_moe(
                x.float(),
                weights,
                expert_ids,
                w13,
                self.w13.ggml_type,
                w2,
                self.w2.ggml_type,
                self.activations,
                self._native_bias(self.w13_bias),
                self._native_bias(self.w2_bias),
                act,
                alpha,
                limit,
            )
            return out.to(x.dtype)  # [n, hidden]
        groups = group_by_expert(expert_ids, self.num_experts)
        rows = x[groups.token_ids]  # [n * k, hidden], grouped by expert
        out = torch.empty_like(rows)  # [n * k, hidden]
        for expert in groups.active:
            start, end = groups.offsets[expert], groups.offsets[expert + 1]
            gate_up = self.w13.matmul(expert, rows[start:end])  # [count, 2 * I]
            if self.w13_bias is not None:
                gate_up += self.w13_bias[expert]
            out[start:end] = self.w2.matmul(expert, self._act_and_mul(gate_up))
            if self.w2_bias is not None:
                out[start:end] += self.w2_bias[expert]
        # back in (token, slot) order [n, k, hidden], then each token's weighted sum in fp32
        # (index_select + bmm: index_add_ took 80 ms for 60 rows on torch 2.13's CPU build)
        by_slot = out.index_select(0, groups.inverse).view(x.shape[0], self.top_k, -1).float()
        return torch.bmm(weights.unsqueeze(1), by_slot).squeeze(1).to(x.dtype)  # [n, hidden]
