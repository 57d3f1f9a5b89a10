"""Mixture-of-experts Llama-family models: the decoder with a sparse expert block as its MLP.

Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE share this; each names its config fields in a `MoeSpec`.
Experts load from a checkpoint's per-expert tensors (`mlp.experts.3.up_proj.weight`),
transformers 5's stacked ones (`mlp.experts.gate_up_proj` [E, 2I, H]) or a GGUF file's
(`ffn_up_exps` -> `mlp.experts.up_proj.weight` [E, I, H]); a stacked tensor stands for the
per-expert names it holds. A stage whose plan keeps the routed experts of its first layers on
the host CPU builds those layers' experts there (`experts_device`) and sends each step's hidden
states across; the router and shared expert stay on the stage's device.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hybridllm.config import KernelConfig
from hybridllm.layers.cpu_kernels import cpu_kernels_enabled
from hybridllm.layers.fused_moe import FusedMoE
from hybridllm.layers.gguf_linear import ACTIVATIONS, own_f32_gemm_preferred, x8_repacking
from hybridllm.layers.linear import Linear
from hybridllm.layers.mlp import ExpertActivation, GatedMLP
from hybridllm.layers.moe_routing import GroupLimitedRouting
from hybridllm.loader.quantized_tensor import QuantizedTensor
from hybridllm.models.base import WeightLoader, copy_loader, linear_loaders
from hybridllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from hybridllm.plan.moe_size import expert_count, qwen_dense_layers

__all__ = ["MoeSpec", "SparseMoeBlock", "expert_count", "qwen_dense_layers"]

if TYPE_CHECKING:
    from hybridllm.distributed.parallel_groups import TPGroup

# transformers 5 keeps stacked experts as parameters without a `.weight` suffix
_STACKED_NO_SUFFIX = re.compile(r"(\.mlp\.experts\.(?:gate_up_proj|down_proj))$")
_PARTS = ("gate_proj", "up_proj", "down_proj")
_EXPERT_LAYER = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.")


@dataclass(frozen=True)
class MoeSpec:
    """An MoE architecture's expert block, read from its config."""

    num_experts: int
    top_k: int
    intermediate_size: int  # one expert's width
    renormalize: bool  # divide the top-k weights by their sum
    shared_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none)
    dense_layers: frozenset[int] = frozenset()  # layers with the dense MLP instead
    scoring: str = "softmax"
    grouping: GroupLimitedRouting | None = None  # DeepSeek's routing (None: plain top-k)
    shared_gate: bool = True  # Qwen2-MoE scales its shared expert by a sigmoid gate
    shared_name: str = "shared_expert"  # the shared expert's checkpoint name
    router_bias: bool = False  # gpt-oss's router adds a bias to its logits
    expert_bias: bool = False  # gpt-oss's experts add biases to gate/up and down
    activation: ExpertActivation | None = None  # None: the config's hidden_act


class SparseMoeBlock(nn.Module):
    """Router, routed experts and an optional shared expert scaled by a sigmoid gate.

    `experts_device` (None: the block's own device) holds and computes the routed experts: the
    host CPU beside a GPU stage. The step's hidden states and router logits cross to it and the
    routed sum comes back, while the shared expert runs on the block's device meanwhile.
    """

    def __init__(
        self,
        spec: MoeSpec,
        hidden_size: int,
        hidden_act: str,
        dtype: torch.dtype,
        device: Any,
        experts_device: torch.device | None = None,
    ):
        super().__init__()
        self.spec = spec
        self.experts_device = experts_device
        # DeepSeek's router scores in fp32 whatever the model's dtype (a bf16 logit can flip
        # which of two close experts a token picks)
        self.router_dtype = torch.float32 if spec.grouping is not None else dtype
        self.gate = Linear(
            hidden_size, spec.num_experts, spec.router_bias, self.router_dtype, device
        )
        self.experts = FusedMoE(
            spec.num_experts,
            spec.top_k,
            hidden_size,
            spec.intermediate_size,
            spec.renormalize,
            dtype,
            device if experts_device is None else experts_device,
            scoring=spec.scoring,
            hidden_act=hidden_act if spec.activation is None else spec.activation,
            grouping=spec.grouping,
            bias=spec.expert_bias,
        )
        self.shared_expert = None
        self.shared_expert_gate = None
        if spec.shared_intermediate_size:
            self.shared_expert = GatedMLP(
                hidden_size, spec.shared_intermediate_size, False, hidden_act, dtype, device
            )
            if spec.shared_gate:
                self.shared_expert_gate = Linear(hidden_size, 1, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x.to(self.router_dtype))  # [n, E]
        if self.experts_device is None:
            out = self.experts(x, logits)  # [n, hidden]
            shared = self._shared(x)
            return out if shared is None else out.add_(shared)
        # Only the step's hidden states [n, hidden] and logits [n, E] cross to the experts'
        # device (a copy off a GPU waits for the router); the shared expert is queued on this
        # device before the experts compute, so a GPU runs it while the host works.
        host_x, host_logits = x.to(self.experts_device), logits.to(self.experts_device)
        shared = self._shared(x)
        out = self.experts(host_x, host_logits).to(x.device)  # [n, hidden]
        return out if shared is None else out.add_(shared)

    def _shared(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared expert's [n, hidden], times its [n, 1] sigmoid gate where it has one
        (None: no shared expert)."""
        if self.shared_expert is None:
            return None
        if self.shared_expert_gate is None:
            return self.shared_expert(x)
        return self.shared_expert(x).mul_(torch.sigmoid(self.shared_expert_gate(x)))

    def stacked_names(self, prefix: str) -> dict[str, set[str]]:
        """Stacked expert tensors -> the per-expert names each stands for."""
        experts, num = f"{prefix}experts.", self.spec.num_experts
        covers = {
            f"{experts}{name}.weight": {f"{experts}{e}.{name}.weight" for e in range(num)}
            for name in _PARTS  # GGUF's stack of one part, or transformers' down_proj
        }
        # transformers 5: [E, 2I, H]
        gate_up = covers[f"{experts}gate_proj.weight"] | covers[f"{experts}up_proj.weight"]
        covers[f"{experts}gate_up_proj.weight"] = gate_up
        return covers

    def weight_loaders(self, prefix: str) -> dict[str, WeightLoader]:
        # the router stays float under on-load quantization (it picks the experts)
        loaders = linear_loaders(prefix, self.gate, "gate", quantizable=False)
        experts = f"{prefix}experts."
        for e in range(self.spec.num_experts):
            for part, name in enumerate(_PARTS):
                full = f"{experts}{e}.{name}.weight"
                loaders[full] = self._expert_loader(name, full, part, e)
        for part, name in enumerate(_PARTS):
            full = f"{experts}{name}.weight"
            loaders[full] = self._expert_loader(name, full, part, None)
        gate_up = f"{experts}gate_up_proj.weight"
        loaders[gate_up] = self._expert_loader("gate_up_proj", gate_up, None, None)
        if self.shared_expert is not None:
            shared = f"{prefix}{self.spec.shared_name}."
            mlp = self.shared_expert
            loaders.update(linear_loaders(shared, mlp.gate_up_proj, ("gate_proj", "up_proj")))
            loaders.update(linear_loaders(shared, mlp.down_proj, "down_proj"))
        if self.shared_expert_gate is not None:
            name = f"{prefix}shared_expert_gate.weight"
            loaders[name] = self._shared_gate_loader(name)
        if self.experts.correction_bias is not None:
            name = f"{prefix}gate.e_score_correction_bias"
            loaders[name] = copy_loader(self.experts.correction_bias, name)
        return loaders

    def _expert_loader(
        self, kind: str, name: str, part: int | None, expert: int | None
    ) -> WeightLoader:
        weight = self.experts.w2 if kind == "down_proj" else self.experts.w13
        part = 0 if kind == "down_proj" else part

        def load(loaded: torch.Tensor | QuantizedTensor) -> None:
            weight.load(loaded, name, part, expert)

        load.accepts_quantized = True  # type: ignore[attr-defined]  # stacks keep GGUF blocks
        # --quantization q8_0|q4_0|q4_1 quantizes experts at load: the fused op reads the blocks
        load.quantize_role = "linear"  # type: ignore[attr-defined]
        return load

    def _shared_gate_loader(self, name: str) -> WeightLoader:
        gate = self.shared_expert_gate

        def load(loaded: torch.Tensor) -> None:
            # [1, hidden]; llama.cpp's ffn_gate_inp_shexp may be the 1-D [hidden]
            gate.load_shard(
                "weight", 0, loaded.reshape(1, -1) if loaded.dim() == 1 else loaded, name
            )

        return load


class MoeDecoderLayer(LlamaDecoderLayer):
    """A Llama-family decoder layer whose MLP is a `SparseMoeBlock` (unless the spec makes it
    dense). Subclasses give the architecture's spec. `experts_device`: where its routed
    experts live when not on the layer's device (the host CPU beside a GPU stage)."""

    def __init__(self, *args: Any, experts_device: torch.device | None = None, **kwargs: Any):
        self._experts_device = experts_device  # read by build_mlp, which the base __init__ calls
        super().__init__(*args, **kwargs)

    @staticmethod
    def moe_spec(hf_config: Any) -> MoeSpec:
        raise NotImplementedError

    def build_mlp(
        self,
        hf_config: Any,
        layer_idx: int,
        dtype: torch.dtype,
        device: torch.device,
        tp_group: TPGroup | None,
    ) -> nn.Module:
        spec = self.moe_spec(hf_config)
        if layer_idx in spec.dense_layers:
            return super().build_mlp(hf_config, layer_idx, dtype, device, tp_group)
        act = getattr(hf_config, "hidden_act", "silu")
        return SparseMoeBlock(spec, hf_config.hidden_size, act, dtype, device, self._experts_device)

    def mlp_weight_loaders(self, prefix: str) -> dict[str, WeightLoader]:
        if isinstance(self.mlp, SparseMoeBlock):
            return self.mlp.weight_loaders(prefix)
        return super().mlp_weight_loaders(prefix)


class MoeForCausalLM(LlamaForCausalLM):
    """An MoE decoder stage. Tensor parallelism is refused: split such a model into pipeline
    stages instead (experts are not sharded yet). `cpu_expert_layers`: the routed experts of the
    stage's first N layers are built, loaded and computed on the host CPU (the plan's
    `StagePlan.cpu_expert_layers`)."""

    supports_tensor_parallel = False
    decoder_layer_class: type[MoeDecoderLayer] = MoeDecoderLayer

    def __init__(
        self,
        hf_config: Any,
        dtype: torch.dtype,
        device: torch.device,
        start_layer: int = 0,
        end_layer: int | None = None,
        tp_group: TPGroup | None = None,
        cpu_expert_layers: int = 0,
    ):
        if tp_group is not None:
            raise ValueError(tensor_parallel_error(type(self).__name__))
        self._check_config(hf_config)
        # read by make_layer, which the base __init__ calls for every layer
        self._cpu_experts_end = start_layer + cpu_expert_layers
        super().__init__(hf_config, dtype, device, start_layer, end_layer)

    def make_layer(
        self,
        layer_idx: int,
        dtype: torch.dtype,
        device: torch.device,
        tp_group: TPGroup | None = None,
    ) -> MoeDecoderLayer:
        head_dim, qkv_bias, o_bias, qk_norm = self._layer_args
        experts = torch.device("cpu") if layer_idx < self._cpu_experts_end else None
        return self.decoder_layer_class(
            self.hf_config, layer_idx, head_dim, qkv_bias, o_bias, qk_norm, dtype, device,
            tp_group, experts_device=experts,
        )  # fmt: skip

    def _check_config(self, hf_config: Any) -> None:
        """Raise for config options this implementation does not support."""

    def _build_weight_loaders(self, tied: bool) -> tuple[dict[str, WeightLoader], set[str]]:
        loaders, optional = super()._build_weight_loaders(tied)
        self._covers: dict[str, set[str]] = {}
        for layer_idx, layer in zip(range(self.start_layer, self.end_layer), self.layers):
            if isinstance(layer.mlp, SparseMoeBlock):
                self._covers.update(layer.mlp.stacked_names(f"model.layers.{layer_idx}.mlp."))
        optional |= set(self._covers)  # a stack is one way to give its per-expert names
        return loaders, optional

    def normalize_weight_name(self, name: str) -> str:
        return _STACKED_NO_SUFFIX.sub(r"\1.weight", name)

    def quantize_role(self, name: str) -> str | None:
        """As the base's on a CPU stage; a GPU stage quantizes only its host experts (the rest
        is bound for the GPU, which computes floats)."""
        role = super().quantize_role(name)
        if role is None or self.device.type == "cpu":
            return role
        match = _EXPERT_LAYER.match(self.normalize_weight_name(name))
        return role if match is not None and int(match.group(1)) < self._cpu_experts_end else None

    @torch.no_grad()
    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]
    ) -> set[str]:
        if self.device.type != "cpu" and self._cpu_experts_end > self.start_layer:
            weights = self._blocks_for_host_experts_only(weights)
        loaded = super().load_weights(weights)
        for name in [n for n in loaded if n in self._covers]:
            loaded |= self._covers[name]
        return loaded

    def _blocks_for_host_experts_only(
        self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]
    ) -> Iterable[tuple[str, torch.Tensor | QuantizedTensor]]:
        """A GPU stage with host experts is given the CPU's GGUF blocks: only those experts
        keep them; every tensor bound for the GPU is decoded."""
        for name, tensor in weights:
            if isinstance(tensor, QuantizedTensor):
                match = _EXPERT_LAYER.match(name)
                if match is None or int(match.group(1)) >= self._cpu_experts_end:
                    tensor = tensor.dequantize()
            yield name, tensor

    @torch.no_grad()
    def process_weights_after_loading(self, kernels: KernelConfig | None = None) -> None:
        """Experts keep or decode their GGUF blocks, then the dense modules' treatment; on a
        CPU with the kernels on (`kernels`, None: the environment's) the experts use the
        compiled SiLU-and-mul and whole-block op (and the native fp32 GEMM where it wins)."""
        if self._weights_processed:
            return
        kernels = KernelConfig.from_env() if kernels is None else kernels
        experts = [m for m in self.modules() if isinstance(m, FusedMoE)]
        for module in experts:
            module.finish_loading()
        # before the base's: the native decode stack it sets up takes the experts' final blocks
        host = [m for m in experts if m.w13.weight.device.type == "cpu"]  # also a GPU stage's
        if host and cpu_kernels_enabled(kernels.cpu_kernels):
            repack = x8_repacking(ACTIVATIONS[kernels.gguf_activations])
            for module in host:
                module.use_native_op()
                if own_f32_gemm_preferred():
                    module.use_f32_kernel()
                if repack:
                    module.w13.repack_for_cpu()
                    module.w2.repack_for_cpu()
            # GGUF files keep routers F32 (llama.cpp's ffn_gate_inp): computed by the native op
            # too, the decode stack runs the whole expert block (models/native_decode.py), where
            # on F.linear each layer's block ran in Python. A Qwen3-30B-A3B-shaped Q2_K file
            # (6 layers, AVX2 Zen 3): batch 1 1.06x, against llama.cpp 0.99x -> 1.17x.
            for block in self.modules():
                router, routed = getattr(block, "gate", None), getattr(block, "experts", None)
                if (
                    isinstance(router, Linear)
                    and router.bias is None
                    and any(routed is m for m in host)
                    and routed.w13.qweight is not None
                ):
                    router.finish_loading()
                    router.use_f32_kernel()
        super().process_weights_after_loading(kernels)


def tensor_parallel_error(architecture: str) -> str:
    return (
        f"{architecture} is a mixture-of-experts model: tensor parallelism is not supported for "
        "it (its experts are not sharded); run it on one worker or split its layers into "
        "pipeline stages (--pipeline-parallel-size / --layer-split)"
    )
