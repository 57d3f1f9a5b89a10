"""What speculative decoding's draft model holds on the host: it runs in the engine's process
on the CPU (worker/draft_runner.py), beside the plan's own CPU workers, so the plan takes it out
of the host budget."""

from __future__ import annotations

from dataclasses import dataclass

from hybridllm.config import EngineConfig, SpeculativeConfig
from hybridllm.plan.model_size import model_size


@dataclass(frozen=True)
class DraftMemory:
    """The draft model's bytes on the host."""

    model: str
    weight_bytes: int
    kv_cache_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_cache_bytes


def draft_max_seqs(spec: SpeculativeConfig, max_num_seqs: int) -> int:
    """Sequences whose KV the draft keeps: it drafts only for batches below
    disable_by_batch_size (LLMEngine sizes its runner so)."""
    return min(spec.disable_by_batch_size or max_num_seqs, max_num_seqs)


def draft_memory(spec: SpeculativeConfig, max_num_seqs: int) -> DraftMemory | None:
    """The draft's weights (as its CPU worker keeps them: GGUF blocks where kept) and its KV
    cache (`draft_max_seqs` full contexts plus the drafts); None without a draft model."""
    draft: EngineConfig | None = spec.draft_config
    if spec.method != "draft_model" or draft is None:
        return None
    mc = draft.model_config
    size = model_size(mc.hf_config, mc.dtype, mc.cpu_blocks, draft.cpu_kv_cache_dtype).cpu_view()
    block = draft.cache_config.block_size
    max_len = draft.scheduler_config.max_model_len + spec.num_speculative_tokens
    tokens = draft_max_seqs(spec, max_num_seqs) * -(-max_len // block) * block
    kv = tokens * size.kv_bytes_per_token(size.full_attention_layers(0, size.num_layers))
    return DraftMemory(str(spec.model), size.total_bytes, kv)
