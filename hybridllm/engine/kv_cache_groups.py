"""KV cache groups: a model's layers partitioned by attention kind, each with its own blocks.

Full-attention and sliding-window layers page their keys and values in blocks of tokens. Linear
attention layers (Gated DeltaNet) keep a fixed-size state per sequence instead: their group's
"block" is one state slot, and a request holds exactly one from its first step to its end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One group of layers that share block tables: full attention (`sliding_window` None),
    a sliding window of `sliding_window` tokens, or linear attention's state slots (`is_state`)."""

    sliding_window: int | None
    layers: tuple[int, ...]  # global decoder layer indices, ascending
    is_state: bool = False

    @property
    def is_sliding(self) -> bool:
        return self.sliding_window is not None

    @property
    def is_full(self) -> bool:
        return self.sliding_window is None and not self.is_state

    def blocks_per_request(self, block_size: int, chunk: int, num_tokens: int) -> int:
        """Most blocks one request of `num_tokens` tokens holds while computing chunks of at
        most `chunk` tokens: all of them under full attention; under a window W the blocks of
        positions [p - W + 1, p + chunk) for a chunk starting at p, plus one where they straddle."""
        if self.is_state:
            return 1
        full = cdiv(num_tokens, block_size)
        if self.sliding_window is None:
            return full
        span = self.sliding_window - 1 + min(chunk, num_tokens)
        return min(full, cdiv(span, block_size) + 1)


def sliding_window_for_layer(hf_config: Any, layer_idx: int) -> int | None:
    """The layer's sliding attention window, or None for full attention.

    transformers 5 names each layer's kind in `layer_types`; Qwen2-style configs keep a
    `sliding_window` value that only applies when `use_sliding_window` is set.
    """
    window = getattr(hf_config, "sliding_window", None)
    if not window or getattr(hf_config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None and layer_types[layer_idx] != "sliding_attention":
        return None
    return int(window)


def is_linear_attention_layer(hf_config: Any, layer_idx: int) -> bool:
    """Whether the layer is linear attention (Qwen3-Next's Gated DeltaNet): a state, no KV."""
    layer_types = getattr(hf_config, "layer_types", None)
    return layer_types is not None and layer_types[layer_idx] == "linear_attention"


def kv_cache_groups(hf_config: Any) -> list[KVCacheGroupSpec]:
    """The model's groups: full attention first (if any layer has it), then one group per
    distinct window, smallest first, then linear attention's state group. Every worker and the
    scheduler derive the same list."""
    by_window: dict[int | None, list[int]] = {}
    linear = []
    for i in range(hf_config.num_hidden_layers):
        if is_linear_attention_layer(hf_config, i):
            linear.append(i)
        else:
            by_window.setdefault(sliding_window_for_layer(hf_config, i), []).append(i)
    order = sorted(by_window, key=lambda w: -1 if w is None else w)
    groups = [KVCacheGroupSpec(w, tuple(by_window[w])) for w in order]
    if linear:
        groups.append(KVCacheGroupSpec(None, tuple(linear), is_state=True))
    return groups


def kv_cache_group_of_layer(hf_config: Any, layer_idx: int) -> int:
    """Index, in `kv_cache_groups(hf_config)`, of the group holding layer `layer_idx`."""
    for g, spec in enumerate(kv_cache_groups(hf_config)):
        if layer_idx in spec.layers:
            return g
    raise ValueError(f"layer {layer_idx} is not one of the model's layers")
