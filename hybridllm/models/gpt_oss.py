"""gpt-oss (`GptOssForCausalLM`): attention with a learned sink logit per head, layers
alternating a sliding window and full attention, q/k/v/o biases and YaRN RoPE; every MLP a
mixture of experts with a biased router (top-k, then a softmax over the chosen) and biased
experts computing the clamped `swigluoai` gate.

Checkpoints keep each expert stack transposed with gate and up interleaved: float stacks
`experts.gate_up_proj` [E, H, 2I] (gate at even columns) and `experts.down_proj` [E, I, H]; MXFP4
stacks arrive as blocks of output rows, [E * 2I, H] (gate at even rows) and [E * H, I]. The
loaders put them in `FusedMoE`'s order: [E, gate rows | up rows, H] and [E, H, I].

GGUF files (llama.cpp's `gpt-oss`) hold separate stacks in that order already: gate and up
[E, I, H] as `experts.gate_proj` / `experts.up_proj` (loaded as every MoE's GGUF stacks are),
down [E, H, I] as `experts.down_proj_gguf` (HF's float down_proj is its transpose, of the same
shape when H == I), and the gate and up biases [E, I] apart (`experts.gate_proj_bias`,
`experts.up_proj_bias`; together they give what `experts.gate_up_proj_bias` gives).
"""

from __future__ import annotations

from typing import Any

import torch

from hybridllm.layers.mlp import ExpertActivation
from hybridllm.loader.mxfp4_blocks import deinterleave_rows
from hybridllm.loader.quantized_tensor import QuantizedTensor
from hybridllm.models.base import WeightLoader, copy_loader
from hybridllm.models.llama import LlamaAttention
from hybridllm.models.moe import MoeDecoderLayer, MoeForCausalLM, MoeSpec, SparseMoeBlock


def deinterleave(stack: torch.Tensor, dim: int) -> torch.Tensor:
    """Even then odd entries of `dim`: interleaved gate/up -> gate | up."""
    index = torch.arange(stack.shape[dim], device=stack.device)
    order = torch.cat((index[0::2], index[1::2]))
    return stack.index_select(dim, order)


class GptOssAttention(LlamaAttention):
    """Llama's attention with a sink logit per head (`self_attn.sinks`)."""

    def paged_attention_options(self, hf_config: Any, head_dim: int) -> dict[str, Any]:
        return {"has_sinks": True}

    def weight_loaders(self, prefix: str) -> dict[str, WeightLoader]:
        loaders = super().weight_loaders(prefix)
        loaders[f"{prefix}sinks"] = copy_loader(self.attn.sinks, f"{prefix}sinks")
        return loaders


class GptOssDecoderLayer(MoeDecoderLayer):
    attention_class = GptOssAttention

    @staticmethod
    def moe_spec(hf_config: Any) -> MoeSpec:
        # top-k of the logits, then a softmax over those k: the softmax over all, renormalised
        return MoeSpec(
            num_experts=hf_config.num_local_experts,
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.intermediate_size,
            renormalize=True,
            router_bias=True,
            expert_bias=True,
            activation=ExpertActivation(
                "swigluoai",
                alpha=float(getattr(hf_config, "swiglu_alpha", 1.702)),
                limit=float(getattr(hf_config, "swiglu_limit", 7.0)),
            ),
        )

    def native_form(self, activations: int) -> None:
        return None  # sinks: not the native decode op's attention

    def mlp_weight_loaders(self, prefix: str) -> dict[str, WeightLoader]:
        loaders = super().mlp_weight_loaders(prefix)
        block = self.mlp
        if not isinstance(block, SparseMoeBlock):
            return loaders
        experts, num = block.experts, block.spec.num_experts
        gate_up, down = f"{prefix}experts.gate_up_proj.weight", f"{prefix}experts.down_proj.weight"
        fused_order_down = loaders[down]  # SparseMoeBlock's: [E, H, I]

        def load_gate_up(loaded: torch.Tensor | QuantizedTensor) -> None:
            if isinstance(loaded, QuantizedTensor):
                experts.w13.load(deinterleave_rows(loaded, num), gate_up)
            else:  # [E, H, 2I] -> [E, 2I, H], gate rows then up rows
                experts.w13.load(deinterleave(loaded.transpose(1, 2), 1), gate_up)

        def load_down(loaded: torch.Tensor | QuantizedTensor) -> None:
            if isinstance(loaded, QuantizedTensor):
                experts.w2.load(loaded, down)
            else:  # [E, I, H] -> [E, H, I]
                experts.w2.load(loaded.transpose(1, 2), down)

        def load_gate_up_bias(loaded: torch.Tensor) -> None:
            copy_loader(experts.w13_bias, f"{prefix}experts.gate_up_proj_bias")(
                deinterleave(loaded, 1)
            )

        for load in (load_gate_up, load_down):
            load.accepts_quantized = True  # type: ignore[attr-defined]  # MXFP4 stays blocks
        loaders[gate_up], loaders[down] = load_gate_up, load_down
        loaders[f"{prefix}experts.gate_up_proj_bias"] = load_gate_up_bias
        loaders[f"{prefix}experts.down_proj_bias"] = copy_loader(
            experts.w2_bias, f"{prefix}experts.down_proj_bias"
        )
        # a GGUF file's: the down stack in FusedMoE's order, the gate and up biases apart
        loaders[f"{prefix}experts.down_proj_gguf.weight"] = fused_order_down
        for part, name in enumerate(("gate_proj_bias", "up_proj_bias")):
            loaders[f"{prefix}experts.{name}"] = self._bias_part_loader(
                part, f"{prefix}experts.{name}"
            )
        return loaders

    def _bias_part_loader(self, part: int, name: str) -> WeightLoader:
        """Gate (part 0) or up (1) biases [E, I] into their half of the experts' [E, 2I]."""
        experts, width = self.mlp.experts, self.mlp.spec.intermediate_size

        def load(loaded: torch.Tensor) -> None:
            copy_loader(experts.w13_bias[:, part * width : (part + 1) * width], name)(loaded)

        return load


class GptOssForCausalLM(MoeForCausalLM):
    """Checkpoint names `mlp.router.*` read as the MoE block's `mlp.gate.*`."""

    decoder_layer_class = GptOssDecoderLayer

    def _attention_options(self, hf_config: Any) -> tuple[bool, bool, bool]:
        bias = bool(getattr(hf_config, "attention_bias", True))
        return bias, bias, False

    def _build_weight_loaders(self, tied: bool) -> tuple[dict[str, WeightLoader], set[str]]:
        loaders, optional = super()._build_weight_loaders(tied)
        for layer_idx, layer in zip(range(self.start_layer, self.end_layer), self.layers):
            if not isinstance(layer.mlp, SparseMoeBlock):
                continue
            experts, num = f"model.layers.{layer_idx}.mlp.experts.", layer.mlp.spec.num_experts
            # a GGUF file's down stack stands for every expert's down_proj, and the gate_up
            # bias for the gate and up biases apart (the names a GGUF file gives)
            down = {f"{experts}{e}.down_proj.weight" for e in range(num)}
            parts = {f"{experts}gate_proj_bias", f"{experts}up_proj_bias"}
            self._covers[f"{experts}down_proj_gguf.weight"] = down
            self._covers[f"{experts}gate_up_proj_bias"] = parts
            optional |= {f"{experts}down_proj_gguf.weight", f"{experts}gate_up_proj_bias"}
        return loaders, optional

    def normalize_weight_name(self, name: str) -> str:
        return super().normalize_weight_name(name.replace(".mlp.router.", ".mlp.gate."))
