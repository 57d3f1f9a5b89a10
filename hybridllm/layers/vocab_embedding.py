"""Token embedding and LM head (which may share the embedding's weight when tied)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridllm.layers.linear import pack_linear_weight, packed_linear


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(vocab_size, dim, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)  # [num_tokens, dim]


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits; `tied_to` shares an embedding's weight."""

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        dtype: torch.dtype,
        device: torch.device,
        tied_to: VocabEmbedding | None = None,
    ):
        super().__init__()
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(
                torch.empty(vocab_size, dim, dtype=dtype, device=device), requires_grad=False
            )
        self.tied = tied_to is not None
        self.packed_weight: torch.Tensor | None = None

    def pack_for_cpu(self) -> None:
        """Use oneDNN's prepacked bf16 layout; a tied head packs a copy (the embedding
        still needs the plain table), an untied one drops its plain weight."""
        if self.packed_weight is None:
            self.packed_weight = pack_linear_weight(self.weight)
            if not self.tied:
                self.weight = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # [n, dim] -> [n, vocab] float32 (the sampler works in fp32)
        if self.packed_weight is not None:
            return packed_linear(hidden_states, self.packed_weight, None).float()
        return F.linear(hidden_states, self.weight).float()
