"""Shared machinery of the causal LMs: a stage's layer range, the HF weight map, loading."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hybridllm.config import KernelConfig
from hybridllm.engine.kv_cache_groups import sliding_window_for_layer  # noqa: F401 (re-exported)
from hybridllm.layers.attention import PagedAttention
from hybridllm.layers.cpu_kernels import cpu_kernels_enabled
from hybridllm.layers.expert_weights import StackedExpertWeight
from hybridllm.layers.fused_moe import FusedMoE
from hybridllm.layers.gguf_linear import ACTIVATIONS, own_f32_gemm_preferred, x8_repacking
from hybridllm.layers.linear import Linear, cpu_bf16_packing_supported
from hybridllm.layers.mlp import GatedMLP
from hybridllm.layers.norm import RMSNorm
from hybridllm.layers.rotary_embedding import RotaryEmbedding
from hybridllm.layers.vocab_embedding import LMHead, VocabEmbedding
from hybridllm.loader.quantized_tensor import QuantizedTensor

if TYPE_CHECKING:
    from hybridllm.distributed.parallel_groups import TPGroup
    from hybridllm.models.execution import LayerExecution

WeightLoader = Callable[[torch.Tensor], None]

_LAYER_INDEX = re.compile(r"^model\.(?:decoder\.)?layers\.(\d+)\.")
# buffers some checkpoints carry that the model recomputes
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# modules that compute from GGUF blocks with the native op, which takes their `activations`
_BLOCK_MODULES = (Linear, LMHead, StackedExpertWeight, FusedMoE)


def copy_loader(param: torch.Tensor, name: str) -> WeightLoader:
    """A loader that copies a same-shaped tensor into `param` (converting dtype)."""

    def load(loaded: torch.Tensor) -> None:
        if loaded.shape != param.shape:
            raise ValueError(
                f"weight {name}: expected shape {tuple(param.shape)}, got {tuple(loaded.shape)}"
            )
        param.copy_(loaded)

    return load


def vocab_loader(module: nn.Module, name: str) -> WeightLoader:
    """A loader for an embedding table or LM head; a vocab-parallel one keeps its rows (of
    floats or GGUF blocks), a plain embedding GGUF blocks it is given."""
    load_full = getattr(module, "load_full", None)
    if load_full is not None:

        def load_rows(loaded: torch.Tensor | QuantizedTensor) -> None:
            load_full(loaded, name)

        load_rows.accepts_quantized = True  # type: ignore[attr-defined]
        return load_rows
    float_loader = copy_loader(module.weight, name)
    if type(module) is not VocabEmbedding:
        return float_loader

    def load(loaded: torch.Tensor | QuantizedTensor) -> None:
        if isinstance(loaded, QuantizedTensor):
            module.use_blocks(loaded.blocks(), loaded.ggml_type, name)
        else:
            float_loader(loaded)

    load.accepts_quantized = True  # type: ignore[attr-defined]
    return load


def head_loader(head: nn.Module, name: str, embedding: nn.Module | None = None) -> WeightLoader:
    """The loader of the LM head's weight `name`, which also fills a tied `embedding`.

    The head keeps GGUF blocks (a vocab-parallel one its rows of them) and projects from
    them; a tied embedding looks its rows up in the same blocks.
    """
    float_loader = vocab_loader(head if embedding is None else embedding, name)

    def load(loaded: torch.Tensor | QuantizedTensor) -> None:
        if not isinstance(loaded, QuantizedTensor):
            float_loader(loaded)
            return
        head.load_blocks(loaded, name)
        if embedding is not None:
            embedding.use_blocks(head.qweight, head.ggml_type, name)

    load.accepts_quantized = True  # type: ignore[attr-defined]
    load.quantize_role = "head"  # type: ignore[attr-defined]  # see loader/onload_quant.py
    return load


def shard_loader(
    linear: Linear, kind: str, shard: int, name: str, quantizable: bool = True
) -> WeightLoader:
    """A loader that copies the HF tensor `name` into its rows of a fused Linear.

    `quantizable`: whether `--quantization q8_0|q4_0|q4_1` may turn its float weight into blocks.
    """

    def load(loaded: torch.Tensor | QuantizedTensor) -> None:
        linear.load_shard(kind, shard, loaded, name)

    load.accepts_quantized = True  # type: ignore[attr-defined]  # Linear keeps GGUF blocks
    if kind == "weight" and quantizable:
        load.quantize_role = "linear"  # type: ignore[attr-defined]
    return load


def linear_loaders(
    prefix: str, linear: Linear, hf_names: tuple[str, ...] | str, quantizable: bool = True
) -> dict[str, WeightLoader]:
    """Loaders for the HF projections `hf_names` stacked (in order) into `linear`."""
    names = (hf_names,) if isinstance(hf_names, str) else hf_names
    loaders = {}
    for shard, hf_name in enumerate(names):
        for kind in ("weight", "bias") if linear.bias is not None else ("weight",):
            name = f"{prefix}{hf_name}.{kind}"
            loaders[name] = shard_loader(linear, kind, shard, name, quantizable)
    return loaders


class CausalLMBase(nn.Module):
    """A decoder-only LM restricted to layers [start_layer, end_layer) of the full model.

    The first stage holds the embedding, the last the final norm and LM head. Subclasses
    build their modules, then call `_set_weight_loaders` with HF name -> loader for
    exactly the weights this stage needs, and hand their decoder layers to a `LayerExecution`
    (`self.execution`), whose `run` computes them each step. With a `tp_group` the modules are
    built sharded (this rank's heads, columns and vocabulary rows); `num_kv_heads` is then the
    local count, and `load_weights` still takes full HF tensors.
    """

    def __init__(
        self,
        hf_config: Any,
        dtype: torch.dtype,
        device: torch.device,
        start_layer: int,
        end_layer: int | None,
        num_kv_heads: int,
        head_dim: int,
        tp_group: TPGroup | None = None,
    ):
        super().__init__()
        num_layers = hf_config.num_hidden_layers
        end_layer = num_layers if end_layer is None else end_layer
        if not 0 <= start_layer < end_layer <= num_layers:
            raise ValueError(
                f"layer range [{start_layer}, {end_layer}) is not a non-empty part of "
                f"the model's {num_layers} layers"
            )
        self.hf_config = hf_config
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_layers = num_layers
        self.start_layer = start_layer
        self.end_layer = end_layer
        self.num_layers_in_stage = end_layer - start_layer
        self.is_first_stage = start_layer == 0
        self.is_last_stage = end_layer == num_layers
        self.num_kv_heads = num_kv_heads  # this rank's KV heads (its KV cache holds these)
        self.head_dim = head_dim
        self.tp_group = tp_group
        self.lm_head: nn.Module | None = None
        # how the decoder layers run a step: subclasses set it once their layers exist
        self.execution: LayerExecution
        self._weight_loaders: dict[str, WeightLoader] = {}
        self._optional_weights: set[str] = set()
        self._weights_processed = False

    def _set_weight_loaders(
        self, loaders: dict[str, WeightLoader], optional: Iterable[str] = ()
    ) -> None:
        """Register the stage's weights; `optional` ones may be absent (tied lm_head)."""
        self._weight_loaders = loaders
        self._optional_weights = set(optional)

    def normalize_weight_name(self, name: str) -> str:
        """Map a checkpoint name to the canonical HF name this model registers."""
        return name

    def owns_weight(self, name: str) -> bool:
        """Whether this stage needs the HF weight `name` (the loader skips the rest)."""
        return self.normalize_weight_name(name) in self._weight_loaders

    def quantize_role(self, name: str) -> str | None:
        """How `--quantization q8_0|q4_0|q4_1` treats the HF weight `name`: "linear" (the
        chosen type), "head" (Q8_0) or None (kept as loaded)."""
        loader = self._weight_loaders.get(self.normalize_weight_name(name))
        return getattr(loader, "quantize_role", None)

    def expected_weight_names(self) -> set[str]:
        """Canonical names load_weights must see for this stage to be complete."""
        return set(self._weight_loaders) - self._optional_weights

    @torch.no_grad()
    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]
    ) -> set[str]:
        """Copy HF-named tensors into this stage; returns the canonical names loaded.

        Tensors of other stages and recomputed buffers are skipped; an unknown tensor of
        one of this stage's layers raises (it means the config and checkpoint disagree).
        """
        if self._weights_processed:
            raise ValueError("load_weights after process_weights_after_loading is not supported")
        loaded = set()
        for name, tensor in weights:
            canonical = self.normalize_weight_name(name)
            loader = self._weight_loaders.get(canonical)
            if loader is None:
                self._check_skippable(canonical)
                continue
            if isinstance(tensor, QuantizedTensor) and not getattr(
                loader, "accepts_quantized", False
            ):
                tensor = tensor.dequantize()  # embeddings, norms: float weights only
            loader(tensor)
            loaded.add(canonical)
        return loaded

    @torch.no_grad()
    def process_weights_after_loading(self, kernels: KernelConfig | None = None) -> None:
        """Call once after load_weights, with the engine's kernel settings (None: the
        environment's, for models built outside an engine).

        Linears keep or decode GGUF blocks and compute from them with the settings' activations;
        with the CPU kernels on (and built), CPU norms switch to the compiled op, fp32 CPU
        linears to the native GEMM where torch's BLAS lacks AVX-512 kernels, K-quant blocks to
        the x8 layout under int8 activations, and decode steps run each layer with a native form
        as one native call (`native_decode_layer`; models/execution.py); with them off,
        attention computes in torch too. bf16 on CPU repacks every float linear for oneDNN.

        Decode on CPU is bound by reading weights; oneDNN's blocked bf16 layout reads them
        about twice as fast as F.linear does; the packing is skipped for other dtypes and devices.
        """
        if self._weights_processed:
            return
        self._weights_processed = True
        kernels = KernelConfig.from_env() if kernels is None else kernels
        activations = ACTIVATIONS[kernels.gguf_activations]
        kernels_on = cpu_kernels_enabled(kernels.cpu_kernels)
        native_ops = self.device.type == "cpu" and kernels_on
        for module in self.modules():
            if isinstance(module, _BLOCK_MODULES):
                module.activations = activations
            if isinstance(module, Linear):
                module.finish_loading()
            elif isinstance(module, (RMSNorm, GatedMLP, RotaryEmbedding)) and native_ops:
                module.use_native_op()
            elif isinstance(module, PagedAttention) and not kernels_on:
                # built with the native ops wherever they are loadable
                module.use_torch_ops()
        if native_ops and own_f32_gemm_preferred():
            for module in self.modules():
                if isinstance(module, (Linear, LMHead)):
                    module.use_f32_kernel()
        if native_ops and x8_repacking(activations):
            for module in self.modules():
                if isinstance(module, (Linear, LMHead)):
                    module.repack_for_cpu()
        if (
            self.device.type == "cpu"
            and self.dtype == torch.bfloat16
            and cpu_bf16_packing_supported()
        ):
            for module in self.modules():
                if isinstance(module, (Linear, LMHead)):
                    module.pack_for_cpu()
        # last: the native decode forms hold the layers' final weights
        if native_ops and kernels.native_decode_layer:
            self.execution.enable_native_decode(activations)

    def _check_skippable(self, name: str) -> None:
        if name.endswith(_IGNORED_SUFFIXES):
            return
        match = _LAYER_INDEX.match(name)
        if match and self.start_layer <= int(match.group(1)) < self.end_layer:
            raise ValueError(
                f"unexpected weight {name!r} for {type(self).__name__}: the config does not "
                "describe this tensor (e.g. a bias the config says is absent)"
            )

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's paged KV cache."""
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[n, hidden] final hidden states -> [n, vocab] float32 logits (last stage only)."""
        if self.lm_head is None:
            raise ValueError(
                f"compute_logits needs the last stage; this one holds layers "
                f"[{self.start_layer}, {self.end_layer}) of {self.num_layers}"
            )
        return self.lm_head(hidden_states)
