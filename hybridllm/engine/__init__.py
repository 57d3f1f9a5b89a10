"""Engine core: request state, paged KV block manager, scheduler, LLMEngine (no torch import)."""
