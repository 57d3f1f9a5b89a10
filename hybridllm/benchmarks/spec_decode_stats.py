"""Speculative decoding's counters over a benchmark run: acceptance rate, mean accepted length."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_COUNTERS = {
    "num_drafts": "spec_decode_num_drafts",
    "num_draft_tokens": "spec_decode_num_draft_tokens",
    "num_accepted_tokens": "spec_decode_num_accepted_tokens",
}


@dataclass(frozen=True)
class SpecDecodeStats:
    """Verify steps with drafts, drafted tokens, and accepted ones (vLLM's three counters)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 without drafts)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify step yields on average: the accepted drafts and the one sampled."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def since(self, before: SpecDecodeStats) -> SpecDecodeStats:
        """The counts between `before` and this later snapshot."""
        return SpecDecodeStats(
            self.num_drafts - before.num_drafts,
            self.num_draft_tokens - before.num_draft_tokens,
            self.num_accepted_tokens - before.num_accepted_tokens,
        )

    def as_dict(self) -> dict[str, float]:
        return {
            "spec_num_drafts": self.num_drafts,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_acceptance_rate": self.acceptance_rate,
            "spec_mean_accepted_length": self.mean_accepted_length,
        }

    def report(self) -> str:
        return (
            f"Speculative decoding: {self.num_draft_tokens} drafted tokens, acceptance rate "
            f"{self.acceptance_rate:.1%}, mean accepted length {self.mean_accepted_length:.2f} "
            f"over {self.num_drafts} verify steps"
        )

    @classmethod
    def of_engine(cls, llm: Any) -> SpecDecodeStats:
        """The counters of an in-process `LLM`'s engine."""
        stats = llm.llm_engine.get_stats()
        return cls(
            stats.spec_num_steps, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens
        )

    @classmethod
    def of_prometheus(cls, text: str) -> SpecDecodeStats | None:
        """The counters in a server's /metrics text; None when it has none of them."""
        values = {}
        for field, name in _COUNTERS.items():
            match = re.search(rf"^hybridllm:{name}(?:_total)?(?:{{}})? ([0-9.e+]+)$", text, re.M)
            if match is None:
                return None
            values[field] = int(float(match.group(1)))
        return cls(**values)
