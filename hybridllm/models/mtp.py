"""The multi-token-prediction (MTP, "NextN") layer that DeepSeek-V3/R1, Kimi-K2 and GLM-4.5
checkpoints carry after their last decoder layer, run as a drafter for speculative decoding.

At position p it reads the target's final hidden state h_p and the embedding of the token at
p + 1, and predicts the token at p + 2:

    x = eh_proj([enorm(embed(t[p+1])); hnorm(h_p)])     # [n, 2 * hidden] -> [n, hidden]
    y = decoder_layer(x) + its residual                  # the checkpoint's layer N
    logits = shared_head.head(shared_head.norm(y))

`h_p` is the target's hidden state after its final norm (what its LM head reads), as vLLM and
SGLang feed it. The decoder layer has its own attention, so its own KV cache over the same
block tables as the target's: it runs on every row of every step, with the step's positions
and slot mapping.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from hybridllm.layers.attention_metadata import AttentionMetadata
from hybridllm.layers.linear import Linear
from hybridllm.layers.norm import RMSNorm
from hybridllm.layers.tensor_parallel import lm_head, vocab_embedding
from hybridllm.loader.hf_config import HFConfig
from hybridllm.loader.quantized_tensor import QuantizedTensor
from hybridllm.models.base import copy_loader, head_loader, linear_loaders, vocab_loader


def _block_config(hf_config: Any) -> Any:
    """The config of a middle stage holding layer N = num_hidden_layers: two more layers (so
    that the stage has neither the final norm nor the LM head), per-layer lists extended with an
    MoE layer of full attention (DeepSeek's and GLM's MTP layers are)."""
    n = int(hf_config.num_hidden_layers)
    changes: dict[str, Any] = {"num_hidden_layers": n + 2}
    for name, kind in (("mlp_layer_types", "sparse"), ("layer_types", "full_attention")):
        kinds = getattr(hf_config, name, None)
        if isinstance(kinds, list) and len(kinds) == n:
            changes[name] = [*kinds, kind, kind]
    if isinstance(hf_config, HFConfig):  # read-only: a new view of the changed values
        return HFConfig({**hf_config.__getstate__(), **changes})
    config = copy.deepcopy(hf_config)  # a transformers config
    for name, value in changes.items():
        setattr(config, name, value)
    return config


def num_mtp_layers(hf_config: Any) -> int:
    """The MTP layers a config says its checkpoint carries (0: none)."""
    return int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0)


class MultiTokenPredictor(nn.Module):
    """MTP layer `num_hidden_layers` of a checkpoint: its decoder layer is built as a one-layer
    stage of the target's own class (so MoE stacking, MLA and the CPU kernels come with it),
    around it the MTP's norms, projection, embedding and head.

    The checkpoint's `model.layers.{N}.embed_tokens` and `shared_head.head` are read when
    present; without them the MTP shares the target's modules (`embed_tokens`, `lm_head`; a
    last stage without the embedding reads `model.embed_tokens` into a copy).
    """

    def __init__(
        self,
        model_class: type,
        hf_config: Any,
        dtype: torch.dtype,
        device: torch.device,
        **stage_kwargs: Any,
    ) -> None:
        super().__init__()
        n = int(hf_config.num_hidden_layers)
        hidden, vocab, eps = hf_config.hidden_size, hf_config.vocab_size, hf_config.rms_norm_eps
        self.block = model_class(_block_config(hf_config), dtype, device, n, n + 1, **stage_kwargs)
        self.prefix = prefix = f"model.layers.{n}."
        self.enorm = RMSNorm(hidden, eps, dtype, device)
        self.hnorm = RMSNorm(hidden, eps, dtype, device)
        self.eh_proj = Linear(2 * hidden, hidden, False, dtype, device)
        self.shared_norm = RMSNorm(hidden, eps, dtype, device)
        self.embed_tokens = vocab_embedding(vocab, hidden, dtype, device, None)
        self.head = lm_head(vocab, hidden, dtype, device, None, None)
        self._own = {  # the MTP's own tensors: required
            f"{prefix}enorm.weight": copy_loader(self.enorm.weight, f"{prefix}enorm.weight"),
            f"{prefix}hnorm.weight": copy_loader(self.hnorm.weight, f"{prefix}hnorm.weight"),
            f"{prefix}shared_head.norm.weight": copy_loader(
                self.shared_norm.weight, f"{prefix}shared_head.norm.weight"
            ),
            **linear_loaders(prefix, self.eh_proj, "eh_proj", quantizable=False),
        }
        # (the MTP's name, the target's name it falls back to) for the embedding and the head
        self._shared = {
            f"{prefix}embed_tokens.weight": (
                "model.embed_tokens.weight",
                vocab_loader(self.embed_tokens, "embed_tokens"),
            ),
            f"{prefix}shared_head.head.weight": (
                "lm_head.weight",
                head_loader(self.head, "shared_head.head"),
            ),
        }
        self._fallbacks = {target: own for own, (target, _) in self._shared.items()}

    def owns_weight(self, name: str) -> bool:
        """The MTP layer's own tensors (the target's embedding and head come in `load_weights`'
        second pass, only where the MTP has no copies)."""
        if not name.startswith(self.prefix):
            return False
        return name in self._own or name in self._shared or self.block.owns_weight(name)

    def quantize_role(self, name: str) -> str | None:
        """The decoder layer's weights as the target's; the MTP's own stay floats."""
        if name.startswith(self.prefix) and name not in self._own and name not in self._shared:
            return self.block.quantize_role(name)
        return None

    @torch.no_grad()
    def load_weights(
        self,
        weights: Iterable[tuple[str, Any]],
        target_weights: Callable[[set[str]], Iterable[tuple[str, Any]]],
        target: nn.Module | None = None,
    ) -> None:
        """Load the MTP layer from `weights`. Where it has no embedding or head of its own it
        shares `target`'s modules (the same weights, held once), else reads the target's
        tensors of those names from `target_weights(names)`. Raises naming what the checkpoint
        lacks."""
        block_weights, loaded = [], set()
        for name, tensor in weights:
            if name in self._own:
                if isinstance(tensor, QuantizedTensor):  # a GGUF file's: small, kept as floats
                    tensor = tensor.dequantize()
                self._own[name](tensor)
                loaded.add(name)
            elif name in self._shared:
                self._shared[name][1](tensor)
                loaded.add(name)
            else:
                block_weights.append((name, tensor))
        loaded |= self.block.load_weights(block_weights)
        for own, attr, target_attr in (
            (f"{self.prefix}embed_tokens.weight", "embed_tokens", "embed_tokens"),
            (f"{self.prefix}shared_head.head.weight", "head", "lm_head"),
        ):
            module = getattr(target, target_attr, None) if target is not None else None
            if own not in loaded and module is not None:
                setattr(self, attr, module)  # the target's own module, not a copy
                loaded.add(own)
        wanted = {target for own, (target, _) in self._shared.items() if own not in loaded}
        if wanted:
            for name, tensor in target_weights(wanted):
                own = self._fallbacks[name]
                self._shared[own][1](tensor)
                loaded.add(own)
        missing = sorted(
            (set(self._own) | set(self._shared) | self.block.expected_weight_names()) - loaded
        )
        if missing:
            raise ValueError(
                f"the checkpoint's MTP layer is incomplete: missing {missing[:6]} (method 'mtp' "
                "needs the model.layers.{num_hidden_layers}.* tensors)"
            )

    def process_weights_after_loading(self, kernels: Any) -> None:
        self.block.process_weights_after_loading(kernels)

    def forward(
        self,
        next_token_ids: torch.Tensor,
        target_hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """[n] next tokens and [n, hidden] target states -> [n, hidden] MTP states (pre-norm)."""
        embedded = self.enorm(self.embed_tokens(next_token_ids))
        x = self.eh_proj(torch.cat((embedded, self.hnorm(target_hidden)), dim=-1))
        hidden, residual = self.block(
            None, positions, [kv_cache], attn_metadata, hidden_states=x, residual=None
        )
        return hidden + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] MTP states -> [n, vocab] float32 logits."""
        return self.head(self.shared_norm(hidden))
