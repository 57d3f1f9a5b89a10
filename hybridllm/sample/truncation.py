"""Temperature and the truncation filters (top-k, top-p, min-p) that turn logits into probs."""

from __future__ import annotations

import torch

from hybridllm.sample.sampling_metadata import SamplingMetadata


def apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Mask logits below each row's k-th largest; uses topk(max k), not a full-vocab sort.

    Ties with the k-th value are kept, as in HF's TopKLogitsWarper.
    """
    vocab_size = logits.shape[-1]
    max_top_k = min(max_top_k, vocab_size)
    top_values = logits.topk(max_top_k, dim=-1).values  # [num_rows, max_top_k]
    kth = (top_k.clamp(max=max_top_k) - 1).unsqueeze(1)  # [num_rows, 1]
    threshold = top_values.gather(1, kth)  # [num_rows, 1]
    # Rows with top-k disabled (k clamped to max_top_k) must keep everything.
    threshold = torch.where((top_k >= vocab_size).unsqueeze(1), float("-inf"), threshold)
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Top-k then top-p on one descending sort; logits [num_rows, vocab].

    top-p keeps the smallest prefix of the sorted tokens whose mass reaches p (the most
    likely token is always kept, so a tiny p is greedy).
    """
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # [num_rows, vocab]
    vocab_size = logits.shape[-1]
    if top_k is not None:
        positions = torch.arange(vocab_size, device=logits.device).unsqueeze(0)  # [1, vocab]
        sorted_logits.masked_fill_(positions >= top_k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of strictly better tokens
        sorted_logits.masked_fill_(mass_before >= top_p.unsqueeze(1), float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def logits_to_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p; returns probs [num_rows, vocab] (float32)."""
    assert metadata.temperature is not None, "logits_to_probs is for rows that sample"
    logits = logits / metadata.temperature.unsqueeze(1)
    if metadata.top_p is not None:
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
    elif metadata.top_k is not None:
        logits = apply_top_k_only(logits, metadata.top_k, metadata.max_top_k)
    probs = logits.softmax(dim=-1)
    if metadata.min_p is not None:
        # Relative to the row's best token: renormalizing after top-k/p leaves the ratio alone.
        threshold = metadata.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs
