"""What the scheduler tells the workers each step, and what the last stage sends back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request a worker has no state for: first scheduled, or resumed after preemption."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty only when resumed after preemption (recompute)
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]  # the whole block table of each KV cache group
    num_computed_tokens: int  # tokens already in the KV cache (prefix-cache hits)


@dataclass
class CachedRequestData:
    """A request the workers already hold; only what changed since it was last scheduled."""

    req_id: str
    new_token_ids: list[int]  # tokens appended since last scheduled (sampled by the last stage)
    new_block_ids: tuple[list[int], ...]  # blocks appended to each group's block table
    num_computed_tokens: int
    # drafted tokens this step verifies after the last known token (speculative decoding);
    # they are not the request's tokens until the last stage accepts them
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """One step: which requests run and how many tokens each computes.

    Workers keep per-request state (token ids, block table) between steps; requests in
    `finished_req_ids` (finished, aborted or preempted since the last step) are dropped.
    A request samples a token this step iff, after it, its computed tokens reach its
    total known tokens (prompt + output). A request with drafts
    (`scheduled_spec_decode_tokens`) computes them after its last known token and samples
    at each of them too: 1 + len(drafts) rows.
    """

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)
    # speculative decoding: req_id -> the drafts it verifies this step (counted in
    # num_scheduled_tokens); requests without drafts are absent
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # structured outputs: the requests that sample this step under a grammar, and their
    # allowed next tokens (np.ndarray int32 [rows, ceil(vocab / 32)], bit t of a row set =
    # token t allowed), built by the engine from its matchers: one row per request, or
    # 1 + len(drafts) consecutive rows for one with drafts (the mask after each draft)
    structured_req_ids: list[str] = field(default_factory=list)
    grammar_bitmask: Any = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class Logprobs:
    """Top-k logprobs at one position: the chosen token first, then the top ones."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]  # rank of each token in the full distribution (1 = most likely)


@dataclass
class ModelRunnerOutput:
    """Sampled tokens of the requests that finished their prefill or decoded this step."""

    req_ids: list[str] = field(default_factory=list)
    # per request the tokens it gets: one, or with drafts the accepted ones and one more
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    # parallel to req_ids: one entry per sampled token, or None (no logprobs asked)
    logprobs: list[list[Logprobs] | None] = field(default_factory=list)
    # prompt logprobs computed this step: req_id -> one entry per prompt position computed
    # (position i holds the logprob of prompt token i+1; None for the first prompt token)
    prompt_logprobs: dict[str, list[Logprobs | None]] = field(default_factory=dict)
    # requests this step could not serve (their sampling failed): req_id -> why; the
    # scheduler finishes them with an error while the rest of the batch goes on
    failed: dict[str, str] = field(default_factory=dict)
    # speculative decoding's "mtp" method: req_id -> the draft the model's MTP layer made
    # after the request's last sampled token, for the next step to verify
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
