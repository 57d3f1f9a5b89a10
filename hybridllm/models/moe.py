"""Mixture-of-experts Llama-family models: the decoder with a sparse expert block as its MLP.

Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE share this; each names its config fields in a `MoeSpec`.
Experts load from a checkpoint's per-expert tensors (`mlp.experts.3.up_proj.weight`),
transformers 5's stacked ones (`mlp.experts.gate_up_proj` [E, 2I, H]) or a GGUF file's
(`ffn_up_exps` -> `mlp.experts.up_proj.weight` [E, I, H]); a stacked tensor stands for the
per-expert names it holds.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hybridllm.layers.cpu_kernels import load_cpu_kernels
from hybridllm.layers.fused_moe import FusedMoE
from hybridllm.layers.gguf_linear import own_f32_gemm_preferred
from hybridllm.layers.linear import Linear
from hybridllm.layers.mlp import GatedMLP
from hybridllm.loader.quantized_tensor import QuantizedTensor
from hybridllm.models.base import WeightLoader, linear_loaders
from hybridllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM

if TYPE_CHECKING:
    from hybridllm.distributed.parallel_groups import TPGroup

# transformers 5 keeps stacked experts as parameters without a `.weight` suffix
_STACKED_NO_SUFFIX = re.compile(r"(\.mlp\.experts\.(?:gate_up_proj|down_proj))$")
_PARTS = ("gate_proj", "up_proj", "down_proj")


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


def expert_count(hf_config: Any, default: int) -> int:
    """The number of routed experts: config.json names it `num_experts` or `num_local_experts`
    (transformers 5 saves Qwen3-MoE's under the latter), else the config class's default."""
    for name in ("num_experts", "num_local_experts"):
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


class SparseMoeBlock(nn.Module):
    """Router, routed experts and an optional shared expert scaled by a sigmoid gate."""

    def __init__(
        self, spec: MoeSpec, hidden_size: int, hidden_act: str, dtype: torch.dtype, device: Any
    ):
        super().__init__()
        self.spec = spec
        self.gate = Linear(hidden_size, spec.num_experts, False, dtype, device)  # router
        self.experts = FusedMoE(
            spec.num_experts,
            spec.top_k,
            hidden_size,
            spec.intermediate_size,
            spec.renormalize,
            dtype,
            device,
            scoring=spec.scoring,
            hidden_act=hidden_act,
        )
        self.shared_expert = None
        self.shared_expert_gate = None
        if spec.shared_intermediate_size:
            self.shared_expert = GatedMLP(
                hidden_size, spec.shared_intermediate_size, False, hidden_act, dtype, device
            )
            self.shared_expert_gate = Linear(hidden_size, 1, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))  # [n, hidden]
        if self.shared_expert is not None:
            # [n, 1] sigmoid gate times the shared expert's [n, hidden]
            shared = self.shared_expert(x).mul_(torch.sigmoid(self.shared_expert_gate(x)))
            out = out.add_(shared)
        return out

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
        loaders = linear_loaders(prefix, self.gate, "gate")
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
            shared = f"{prefix}shared_expert."
            mlp = self.shared_expert
            loaders.update(linear_loaders(shared, mlp.gate_up_proj, ("gate_proj", "up_proj")))
            loaders.update(linear_loaders(shared, mlp.down_proj, "down_proj"))
            name = f"{prefix}shared_expert_gate.weight"
            loaders[name] = self._shared_gate_loader(name)
        return loaders

    def _expert_loader(
        self, kind: str, name: str, part: int | None, expert: int | None
    ) -> WeightLoader:
        weight = self.experts.w2 if kind == "down_proj" else self.experts.w13
        part = 0 if kind == "down_proj" else part

        def load(loaded: torch.Tensor | QuantizedTensor) -> None:
            weight.load(loaded, name, part, expert)

        load.accepts_quantized = True  # type: ignore[attr-defined]  # stacks keep GGUF blocks
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
    dense). Subclasses give the architecture's spec."""

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
        return SparseMoeBlock(spec, hf_config.hidden_size, act, dtype, device)

    def mlp_weight_loaders(self, prefix: str) -> dict[str, WeightLoader]:
        if isinstance(self.mlp, SparseMoeBlock):
            return self.mlp.weight_loaders(prefix)
        return super().mlp_weight_loaders(prefix)


class MoeForCausalLM(LlamaForCausalLM):
    """An MoE decoder stage. Tensor parallelism is refused: split such a model into pipeline
    stages instead (experts are not sharded yet)."""

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
    ):
        if tp_group is not None:
            raise ValueError(tensor_parallel_error(type(self).__name__))
        self._check_config(hf_config)
        super().__init__(hf_config, dtype, device, start_layer, end_layer)

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

    @torch.no_grad()
    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]
    ) -> set[str]:
        loaded = super().load_weights(weights)
        for name in [n for n in loaded if n in self._covers]:
            loaded |= self._covers[name]
        return loaded

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        """Experts keep or decode their GGUF blocks, then the dense modules' treatment; on a
        CPU the experts use the compiled SiLU-and-mul (and the native fp32 GEMM where it wins)."""
        if self._weights_processed:
            return
        experts = [m for m in self.modules() if isinstance(m, FusedMoE)]
        for module in experts:
            module.finish_loading()
        super().process_weights_after_loading()
        if self.device.type != "cpu" or not load_cpu_kernels():
            return
        for module in experts:
            module.use_native_op()
            if own_f32_gemm_preferred():
                module.use_f32_kernel()


def tensor_parallel_error(architecture: str) -> str:
    return (
        f"{architecture} is a mixture-of-experts model: tensor parallelism is not supported for "
        "it (its experts are not sharded); run it on one worker or split its layers into "
        "pipeline stages (--pipeline-parallel-size / --layer-split)"
    )
