"""How a stage's decoder layers run a step: streamed to an accelerator, natively, or op by op.

Every architecture hands its layers to a `LayerExecution` and calls `run` for the step. Four
paths, chosen per step:

- a weight streamer (worker/weight_streamer.py) computes steps of many tokens on an accelerator;
- a CPU step of decode rows only, every layer native with its MLP or expert block: one
  `hybridllm::DecodeStack` call runs all the layers (one per run of consecutive layers of the
  same KV cache group, each given its group's block tables);
- such a step otherwise: each layer with a native form in one `hybridllm::decode_layer` call (its
  other feed-forward block after it in Python), the rest through their forward;
- any other step: each layer's forward, op by op.

Layers take and return (hidden_states, residual), whose sum is the hidden state. Each layer
reads the block tables of its KV cache group (its attention's `kv_group`; one group unless the
model has sliding-window or linear-attention layers).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridllm.layers.attention import PagedAttention
from hybridllm.layers.attention_metadata import AttentionMetadata
from hybridllm.layers.gated_delta_net import GatedDeltaNet
from hybridllm.layers.prepared_attention import PreparedAttention
from hybridllm.layers.rotary_embedding import RotaryAngles
from hybridllm.models.native_decode import NativeLayer


class LayerExecution:
    """Runs `layers` over a step by the fastest path the step and the layers allow."""

    def __init__(self, layers: nn.ModuleList):
        self.layers = layers
        # computes many-token steps on an accelerator (attach_weight_streamer); None: never
        self.weight_streamer: Any = None
        # each layer's native decode form, looked up once (enable_native_decode): read through
        # nn.Module attributes every step they cost ~10 us a layer at batch 1 (SmolLM2)
        self.native_forms: list[NativeLayer | None] = [None] * len(layers)
        self.any_native = False
        # each layer's KV cache group (0 for layers without paged attention, e.g. MLA's)
        self.layer_groups = [kv_group_of(layer) for layer in layers]
        self.single_group = not any(self.layer_groups)
        # torch.classes.hybridllm.DecodeStack of every layer, when all decode natively; with
        # several KV cache groups (start, end, group, stack) per run of same-group layers
        self.stack: Any = None
        self.stacks: list[tuple[int, int, int, Any]] = []

    def attach_weight_streamer(self, streamer: Any) -> None:
        """Let `streamer` compute the steps it `wants` (None: every step stays here)."""
        self.weight_streamer = streamer

    def enable_native_decode(self, activations: int) -> None:
        """Let CPU decode steps run each layer with a native form (its `native_form(activations)`,
        None or no such method: it has none) as one native call, and all of them in one
        `DecodeStack` call when every layer's op takes its MLP or the stack its expert block.
        Call once, after loading: the forms hold the layers' final weights."""
        self.native_forms = [
            None if getattr(layer, "native_form", None) is None else layer.native_form(activations)
            for layer in self.layers
        ]
        self.any_native = any(form is not None for form in self.native_forms)
        if len(self.layers) > 0 and all(
            form is not None and (form.mlp is None or form.experts is not None)
            for form in self.native_forms
        ):
            for start, end, group in group_runs(self.layer_groups):
                stack = torch.classes.hybridllm.DecodeStack()
                for form in self.native_forms[start:end]:
                    stack.add_layer(*form.weights, *form.attention)
                    if form.experts is not None:
                        stack.add_moe(*form.experts)
                self.stacks.append((start, end, group, stack))
            self.stack = self.stacks[0][3] if len(self.stacks) == 1 else None

    def run(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryAngles | None,
        kv_caches: list[torch.Tensor],
        prep: PreparedAttention,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layers over one step: [n, hidden] (hidden_states, residual) in and out.

        `rotary`: the step's angles (None: the model has no rotary embedding); `positions` and
        `attn_metadata` are what a weight streamer recomputes them and the attention from.
        """
        streamer = self.weight_streamer
        if streamer is not None and streamer.wants(attn_metadata, kv_caches):
            # Many tokens: the layers' weights go to the accelerator and compute there.
            return streamer.run(
                self.layers, kv_caches, hidden_states, residual, positions, attn_metadata
            )
        # a CPU step of decode rows only: eligible layers in one native call each
        native = (
            self.any_native
            and rotary.native
            and bool(kv_caches)
            and prep.num_decodes == hidden_states.shape[0] > 0
            and hidden_states.dtype == torch.float32
        )
        if native and self.stack is not None and self.single_group:
            # every layer native with its MLP: all of them in one call
            return self.stack.forward(
                hidden_states,
                residual,
                rotary.cos,
                rotary.sin_signed,
                kv_caches,
                prep.slot_mapping,
                prep.decode_block_tables,
                prep.decode_seq_lens,
            )
        if native and self.stacks:
            # one call per run of layers that read the same group's block tables
            for start, end, group, stack in self.stacks:
                group_prep = prep.for_group(group)
                hidden_states, residual = stack.forward(
                    hidden_states,
                    residual,
                    rotary.cos,
                    rotary.sin_signed,
                    kv_caches[start:end],
                    group_prep.slot_mapping,
                    group_prep.decode_block_tables,
                    group_prep.decode_seq_lens,
                )
            return hidden_states, residual
        groups = self.layer_groups
        for i, layer in enumerate(self.layers):
            kv_cache = kv_caches[i] if kv_caches else None
            layer_prep = prep if self.single_group else prep.for_group(groups[i])
            form = self.native_forms[i] if native else None
            if form is not None:
                hidden_states, residual = decode_layer(
                    form, hidden_states, residual, rotary, kv_cache, layer_prep
                )
            else:
                hidden_states, residual = layer(
                    hidden_states, residual, rotary, kv_cache, layer_prep
                )
        return hidden_states, residual


def kv_group_of(layer: nn.Module) -> int:
    """The KV cache group whose block tables `layer`'s attention (or linear attention's state
    slots) reads."""
    for module in layer.modules():
        if isinstance(module, (PagedAttention, GatedDeltaNet)):
            return module.kv_group
    return 0


def group_runs(layer_groups: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, group) of each run of consecutive layers in the same group."""
    runs: list[tuple[int, int, int]] = []
    for i, group in enumerate(layer_groups):
        if runs and runs[-1][2] == group:
            runs[-1] = (runs[-1][0], i + 1, group)
        else:
            runs.append((i, i + 1, group))
    return runs


def decode_layer(
    form: NativeLayer,
    hidden_states: torch.Tensor,
    residual: torch.Tensor | None,
    rotary: RotaryAngles,
    kv_cache: torch.Tensor,
    prep: PreparedAttention,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's forward for a step of decode rows only, fp32: the native op, then the
    feed-forward block when the op did not take it."""
    out, residual = torch.ops.hybridllm.decode_layer.default(
        hidden_states,
        residual,
        *form.weights,
        rotary.cos,
        rotary.sin_signed,
        kv_cache,
        prep.slot_mapping,
        prep.decode_block_tables,
        prep.decode_seq_lens,
        *form.attention,
    )
    return (out, residual) if form.mlp is None else (form.mlp(out), residual)
