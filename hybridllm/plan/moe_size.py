"""Sizes of a mixture-of-experts model's MLP blocks (router, routed and shared experts) from its HF config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# model_type -> (expert-count default of the config class, config field of one expert's width)
_MOE_TYPES = {
    "mixtral": (8, "intermediate_size"),
    "olmoe": (64, "intermediate_size"),
    "qwen2_moe": (60, "moe_intermediate_size"),
    "qwen3_moe": (128, "moe_intermediate_size"),
    "deepseek_v2": (64, "moe_intermediate_size"),
    "deepseek_v3": (256, "moe_intermediate_size"),
    "kimi_k2": (384, "moe_intermediate_size"),
    "glm4_moe_lite": (64, "moe_intermediate_size"),
    "glm4_moe": (128, "moe_intermediate_size"),
    "gpt_oss": (128, "intermediate_size"),
    "minimax_m2": (256, "intermediate_size"),
    "qwen3_next": (512, "moe_intermediate_size"),
    "qwen3_5_moe_text": (256, "moe_intermediate_size"),
}
# Qwen-style blocks: a sigmoid-gated shared expert of `shared_expert_intermediate_size`
_QWEN_SHARED = ("qwen2_moe", "qwen3_next", "qwen3_5_moe_text")
# DeepSeek-style blocks: `n_shared_experts` ungated shared experts, leading dense layers
DEEPSEEK_STYLE = ("deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe_lite", "glm4_moe")


def expert_count(hf_config: Any, default: int) -> int:
    """The number of routed experts: config.json names it `num_experts` or `num_local_experts`
    (transformers 5 saves Qwen3-MoE's under the latter), else the config class's default."""
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(hf_config, name, None)
        if value is not None:
            return int(value)
    return default


def qwen_dense_layers(hf_config: Any) -> frozenset[int]:
    """Qwen-MoE's dense layers: `mlp_only_layers`, and all but every `decoder_sparse_step`-th."""
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    only = set(getattr(hf_config, "mlp_only_layers", None) or ())
    layers = range(hf_config.num_hidden_layers)
    return frozenset(i for i in layers if i in only or (i + 1) % step != 0)


def deepseek_dense_layers(hf_config: Any) -> frozenset[int]:
    """DeepSeek-style dense layers: `mlp_layer_types` where the config lists them, else the
    first `first_k_dense_replace`."""
    types = getattr(hf_config, "mlp_layer_types", None)
    if types is not None:
        return frozenset(i for i, kind in enumerate(types) if kind == "dense")
    return frozenset(range(int(getattr(hf_config, "first_k_dense_replace", 0) or 0)))


@dataclass(frozen=True)
class MoeSize:
    """Matmul parameters of an MoE model's MLPs; every other part is sized as a Llama layer's.

    A sparse layer's MLP is a router [E, hidden], E routed experts (gate, up, down of
    `expert_intermediate` columns) and an optional shared expert with its [1, hidden] gate; a
    dense layer's is one gated MLP of `dense_intermediate` columns.
    """

    num_experts: int
    top_k: int
    hidden_size: int
    expert_intermediate: int
    shared_intermediate: int  # 0: no shared expert
    dense_intermediate: int
    sparse_layers: frozenset[int]
    shared_gate: bool = True  # Qwen2-MoE's [1, hidden] sigmoid gate on the shared expert

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in [1, {self.num_experts}]")

    @property
    def expert_params(self) -> int:
        """gate + up + down of one routed expert."""
        return 3 * self.hidden_size * self.expert_intermediate

    @property
    def routed_params(self) -> int:
        """Every routed expert of one sparse layer."""
        return self.num_experts * self.expert_params

    @property
    def sparse_fixed_params(self) -> int:
        """A sparse layer's MLP outside the routed experts: the router and the shared expert."""
        shared = 3 * self.hidden_size * self.shared_intermediate
        shared_gate = self.hidden_size if self.shared_intermediate and self.shared_gate else 0
        return self.hidden_size * self.num_experts + shared + shared_gate

    @property
    def dense_params(self) -> int:
        return 3 * self.hidden_size * self.dense_intermediate

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers

    def mlp_params(self, layer: int, routed: bool = True) -> int:
        """MLP matmul parameters of `layer` (its routed experts left out unless `routed`)."""
        if not self.is_sparse(layer):
            return self.dense_params
        return self.sparse_fixed_params + (self.routed_params if routed else 0)

    def active_mlp_params(self, layer: int) -> int:
        """MLP parameters one token multiplies by: top_k experts, router and shared expert."""
        if not self.is_sparse(layer):
            return self.dense_params
        return self.sparse_fixed_params + self.top_k * self.expert_params

    def active_experts(self, num_tokens: int) -> float:
        """Expected distinct experts a step of `num_tokens` tokens reads in one sparse layer.

        Each token picks top_k of E experts; with routing spread evenly an expert is missed by
        one token with probability 1 - k/E, by all B tokens with (1 - k/E)^B.
        """
        e, k = self.num_experts, self.top_k
        return e * (1.0 - (1.0 - k / e) ** max(0, num_tokens))

    @property
    def activation_width(self) -> int:
        """Widest MLP intermediate per token (the workspace a step's activations need)."""
        sparse = self.top_k * self.expert_intermediate + self.shared_intermediate
        return max(sparse, self.dense_intermediate)  # a bound: dense layers may be absent


def moe_size(hf_config: Any) -> MoeSize | None:
    """The MoE sizes of a Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3, GLM-4.5,
    gpt-oss, MiniMax-M2, Qwen3-Next or Qwen3.5-MoE config; None for dense models."""
    model_type = getattr(hf_config, "model_type", "") or ""
    if model_type not in _MOE_TYPES:
        return None
    default, width = _MOE_TYPES[model_type]
    num_layers = hf_config.num_hidden_layers
    dense: frozenset[int] = frozenset()
    if model_type in ("qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe_text"):
        dense = qwen_dense_layers(hf_config)
    shared = 0
    if model_type in _QWEN_SHARED:
        shared = int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0)
    deepseek = model_type in DEEPSEEK_STYLE
    if deepseek:
        dense = deepseek_dense_layers(hf_config)
        shared = int(getattr(hf_config, width)) * int(
            getattr(hf_config, "n_shared_experts", 0) or 0
        )
    return MoeSize(
        num_experts=expert_count(hf_config, default),
        top_k=int(hf_config.num_experts_per_tok),
        hidden_size=hf_config.hidden_size,
        expert_intermediate=int(getattr(hf_config, width)),
        shared_intermediate=shared,
        dense_intermediate=int(getattr(hf_config, "intermediate_size", 0) or 0),
        sparse_layers=frozenset(range(num_layers)) - dense,
        shared_gate=not deepseek,
    )
