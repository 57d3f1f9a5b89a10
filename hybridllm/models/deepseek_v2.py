"""DeepSeek-V2/V3 family (DeepSeek-V2/V3/R1, Kimi-K2, GLM-4.7-Flash): multi-head latent
attention and DeepSeek's routed experts with shared ones, after `first_k_dense_replace` dense
layers.

MTP / NextN layers that checkpoints carry after the last decoder layer
(`model.layers.{num_hidden_layers}.*`) are outside every stage's range: the last stage loads
them only as speculative decoding's drafter (models/mtp.py, method "mtp").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hybridllm.config import KernelConfig
from hybridllm.layers.cpu_kernels import cpu_kernels_enabled, load_cpu_kernels
from hybridllm.layers.gguf_linear import ACTIVATIONS
from hybridllm.layers.linear import Linear
from hybridllm.layers.mla_attention import LatentAttention
from hybridllm.layers.moe_routing import GroupLimitedRouting
from hybridllm.layers.norm import RMSNorm
from hybridllm.layers.prepared_attention import PreparedAttention
from hybridllm.layers.rotary_embedding import (
    RotaryAngles,
    RotaryEmbedding,
    rope_parameters,
    yarn_mscale,
)
from hybridllm.models.base import WeightLoader, copy_loader, linear_loaders
from hybridllm.models.moe import MoeDecoderLayer, MoeForCausalLM, MoeSpec, expert_count
from hybridllm.plan.moe_size import deepseek_dense_layers

if TYPE_CHECKING:
    from hybridllm.distributed.parallel_groups import TPGroup

# model types routed as DeepSeek-V3 is: sigmoid scores, a choice bias, top-two group scores
V3_ROUTED = ("deepseek_v3", "kimi_k2", "glm4_moe_lite", "glm4_moe")


def deepseek_moe_spec(hf_config: Any) -> MoeSpec:
    """The expert block of a DeepSeek-V2/V3-routed config (also GLM-4.5's)."""
    model_type = getattr(hf_config, "model_type", "")
    v3 = model_type in V3_ROUTED
    groups = int(getattr(hf_config, "n_group", None) or 1)
    topk_groups = int(getattr(hf_config, "topk_group", None) or groups)
    if not v3 and getattr(hf_config, "topk_method", "greedy") == "greedy":
        groups = topk_groups = 1
    width = int(hf_config.moe_intermediate_size)
    return MoeSpec(
        num_experts=expert_count(hf_config, 0),
        top_k=int(hf_config.num_experts_per_tok),
        intermediate_size=width,
        # DeepSeek-V2's router never renormalises (its norm_topk_prob is not read)
        renormalize=v3 and bool(getattr(hf_config, "norm_topk_prob", False)),
        shared_intermediate_size=width * int(getattr(hf_config, "n_shared_experts", 0) or 0),
        dense_layers=deepseek_dense_layers(hf_config),
        scoring="sigmoid" if v3 else "softmax",
        grouping=GroupLimitedRouting(
            num_groups=groups,
            topk_groups=topk_groups,
            group_score="top2_sum" if v3 else "max",
            scaling_factor=float(getattr(hf_config, "routed_scaling_factor", 1.0) or 1.0),
            correction_bias=v3,
        ),
        shared_gate=False,
        shared_name="shared_experts",
    )


def mla_softmax_scale(hf_config: Any) -> float:
    """1/sqrt(qk_head_dim), times YaRN's mscale(factor, mscale_all_dim) squared."""
    scale = (hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(hf_config)
    mscale_all_dim = params.get("mscale_all_dim")
    if params["rope_type"] != "default" and mscale_all_dim:
        scale *= yarn_mscale(float(params["factor"]), float(mscale_all_dim)) ** 2
    return scale


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., R] pairs (x0, x1), (x2, x3), ... -> [x0, x2, ..., x1, x3, ...] (a new tensor): the
    rotate-half layout, in which the same rotation applies. q and k both get it, so their
    products (all attention sees) are unchanged."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLAttention(nn.Module):
    """DeepSeek's multi-head latent attention: queries through an optional low rank
    (`q_a_proj` -> RMSNorm -> `q_b_proj`, else `q_proj`), one shared compressed key-value
    (`kv_a_proj_with_mqa` -> RMSNorm over its latent part; the rest is the rotated key part
    every head shares), cached as such and up-projected by `kv_b_proj` (layers/mla_attention.py)."""

    def __init__(
        self,
        hf_config: Any,
        layer_idx: int,
        head_dim: int,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        dtype: torch.dtype,
        device: torch.device,
        tp_group: TPGroup | None = None,
    ):
        super().__init__()
        c = hf_config
        hidden, eps = c.hidden_size, c.rms_norm_eps
        self.num_heads = heads = c.num_attention_heads
        self.nope_dim, self.rope_dim = c.qk_nope_head_dim, c.qk_rope_head_dim
        self.v_dim, self.latent_dim = c.v_head_dim, c.kv_lora_rank
        self.q_lora_rank = getattr(c, "q_lora_rank", None)
        bias = bool(getattr(c, "attention_bias", False))
        q_width = heads * (self.nope_dim + self.rope_dim)
        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        if self.q_lora_rank:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias, dtype, device)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps, dtype, device)
            self.q_b_proj = Linear(self.q_lora_rank, q_width, False, dtype, device)
        else:
            self.q_proj = Linear(hidden, q_width, False, dtype, device)
        latent_width = self.latent_dim + self.rope_dim
        self.kv_a_proj_with_mqa = Linear(hidden, latent_width, bias, dtype, device)
        self.kv_a_layernorm = RMSNorm(self.latent_dim, eps, dtype, device)
        # floats: the absorbed decode multiplies by its per-head blocks [H, nope + v, L]
        kv_b = torch.empty(heads * (self.nope_dim + self.v_dim), self.latent_dim, dtype=dtype)
        self.kv_b_proj = nn.Parameter(kv_b.to(device), requires_grad=False)
        self.o_proj = Linear(heads * self.v_dim, hidden, bias, dtype, device)
        # DeepSeek-V2 always pairs its rotary dimensions; V3-style configs say so
        self.interleaved = bool(getattr(c, "rope_interleave", True))
        self.attn = LatentAttention(
            heads,
            self.nope_dim,
            self.rope_dim,
            self.v_dim,
            self.latent_dim,
            mla_softmax_scale(c),
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary: RotaryAngles,
        kv_cache: torch.Tensor | None,
        prep: PreparedAttention,
    ) -> torch.Tensor:
        n = hidden_states.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(n, self.num_heads, self.nope_dim + self.rope_dim)
        kv_a = self.kv_a_proj_with_mqa(hidden_states)  # [n, L + R]
        latent_dim = self.latent_dim
        latent = torch.empty_like(kv_a)  # [n, L + R]: what the cache holds
        latent[:, :latent_dim] = self.kv_a_layernorm(kv_a[:, :latent_dim].contiguous())
        q_pe, k_pe = q[..., self.nope_dim :], kv_a[:, latent_dim:]
        if self.interleaved:
            q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
        latent[:, latent_dim:] = k_pe
        rotary.rotate_(q_pe)  # [n, H, R], in place (a view of q when not interleaved)
        rotary.rotate_(latent[:, None, latent_dim:])  # [n, 1, R]
        self.attn.write(kv_cache, latent, prep)
        w_kv_b = None  # dropped: the attention holds it as blocks (`use_head_blocks`)
        if self.kv_b_proj.numel():
            w_kv_b = self.kv_b_proj.view(self.num_heads, -1, latent_dim)  # [H, nope + v, L]
        out = self.attn.forward(q[..., : self.nope_dim], q_pe, latent, kv_cache, prep, w_kv_b)
        return self.o_proj(out)

    def use_head_blocks(self, activations: int) -> None:
        """Keep `kv_b_proj` only as the attention's Q8_0 blocks (a quarter of its fp32 bytes:
        4 GB less for DeepSeek-V3's 61 layers)."""
        self.attn.use_head_blocks(
            self.kv_b_proj.view(self.num_heads, -1, self.latent_dim), activations
        )
        empty = torch.empty(0, dtype=self.kv_b_proj.dtype, device=self.kv_b_proj.device)
        self.kv_b_proj = nn.Parameter(empty, requires_grad=False)

    def blocks_fit(self) -> bool:
        """Whether the absorbed decode's per-head rows (nope and latent wide) are whole
        32-weight blocks."""
        return self.nope_dim % 32 == 0 and self.latent_dim % 32 == 0

    def weight_loaders(self, prefix: str) -> dict[str, WeightLoader]:
        if self.q_proj is not None:
            loaders = linear_loaders(prefix, self.q_proj, "q_proj")
        else:
            loaders = linear_loaders(prefix, self.q_a_proj, "q_a_proj")
            loaders.update(linear_loaders(prefix, self.q_b_proj, "q_b_proj"))
            name = f"{prefix}q_a_layernorm.weight"
            loaders[name] = copy_loader(self.q_a_layernorm.weight, name)
        loaders.update(linear_loaders(prefix, self.kv_a_proj_with_mqa, "kv_a_proj_with_mqa"))
        name = f"{prefix}kv_a_layernorm.weight"
        loaders[name] = copy_loader(self.kv_a_layernorm.weight, name)
        name = f"{prefix}kv_b_proj.weight"
        loaders[name] = copy_loader(self.kv_b_proj, name)
        loaders.update(linear_loaders(prefix, self.o_proj, "o_proj"))
        return loaders


class DeepseekV2DecoderLayer(MoeDecoderLayer):
    attention_class = MLAttention
    moe_spec = staticmethod(deepseek_moe_spec)


class DeepseekV2ForCausalLM(MoeForCausalLM):
    """A DeepSeek-V2/V3 stage. Its KV cache holds each token's latent (`kv_lora_rank +
    qk_rope_head_dim` values per layer); pipeline stages split it as any model's."""

    decoder_layer_class = DeepseekV2DecoderLayer
    supports_mtp = True  # method "mtp" drafts with the checkpoint's MTP layer (models/mtp.py)

    def _rotary_embedding(
        self, hf_config: Any, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> RotaryEmbedding:
        return RotaryEmbedding(
            hf_config.qk_rope_head_dim, rope_parameters(hf_config), dtype, device
        )

    def _check_config(self, hf_config: Any) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if not isinstance(getattr(hf_config, name, None), int):
                raise ValueError(f"{type(self).__name__}: config needs an integer {name}")
        if hf_config.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {hf_config.qk_rope_head_dim}")

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """One latent row per token: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]."""
        c = self.hf_config
        return (num_blocks, block_size, c.kv_lora_rank + c.qk_rope_head_dim)

    @torch.no_grad()
    def process_weights_after_loading(self, kernels: KernelConfig | None = None) -> None:
        """As the base's; on a CPU with the kernels, MLA decode attends through the native op
        and, where the linears hold blocks, absorbs through Q8_0 blocks (see LatentAttention)."""
        if self._weights_processed:
            return
        super().process_weights_after_loading(kernels)
        kernels = KernelConfig.from_env() if kernels is None else kernels
        native = (
            self.device.type == "cpu"
            and cpu_kernels_enabled(kernels.cpu_kernels)
            and load_cpu_kernels()
            and hasattr(torch.ops.hybridllm, "mla_decode_attention")
        )
        head_blocks = (
            self.device.type == "cpu"
            and cpu_kernels_enabled(kernels.cpu_kernels)
            and load_cpu_kernels()
            and hasattr(torch.ops.hybridllm, "gguf_head_linear")
        )
        for module in self.modules():
            if isinstance(module, MLAttention):
                module.attn.native_ops = native
                # a model computing from blocks (GGUF, --quantization) absorbs from Q8_0 too
                if (
                    head_blocks
                    and module.kv_a_proj_with_mqa.qweight is not None
                    and module.blocks_fit()
                ):
                    module.use_head_blocks(ACTIVATIONS[kernels.gguf_activations])


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3/R1 and Kimi-K2: the V2 layers with V3's routing (read from model_type)."""


class Glm4MoeLiteForCausalLM(DeepseekV2ForCausalLM):
    """GLM-4.7-Flash: DeepSeek-V3's attention and routing under GLM's names."""
