"""The MTP drafter: the model's own multi-token-prediction layer drafts the next token."""

from __future__ import annotations

from collections.abc import Mapping

from hybridllm.engine.request import Request
from hybridllm.engine.scheduler_output import ModelRunnerOutput
from hybridllm.spec_decode.drafter import Drafter


class MtpDrafter(Drafter):
    """vLLM's "mtp" method. The last stage runs the checkpoint's MTP layer after every step
    (worker/model_runner.py) and returns, per request that sampled, the token it predicts after
    the request's last kept one; this drafter hands that draft to the next step. The layer's
    cost is paid each step whether a draft is verified or not, so drafts are priced as free and
    the acceptance guard alone decides who verifies."""

    def __init__(self, config) -> None:
        super().__init__(config)
        # req_id -> (the request's token count the draft follows, the draft)
        self._drafts: dict[str, tuple[int, list[int]]] = {}

    def observe(self, output: ModelRunnerOutput | None, requests: Mapping[str, Request]) -> None:
        """Keep the drafts of a finished step for the requests still running."""
        for req_id in [r for r in self._drafts if r not in requests]:
            del self._drafts[req_id]
        if output is None:
            return
        for req_id, drafts in output.draft_token_ids.items():
            request = requests.get(req_id)
            if request is not None:
                self._drafts[req_id] = (request.num_tokens, drafts)

    def draft(self, batch: list[tuple[Request, int]]) -> list[list[int]]:
        result = []
        for request, k in batch:
            made = self._drafts.get(request.request_id)
            # a draft follows exactly the tokens it was made after
            fresh = made is not None and made[0] == request.num_tokens
            result.append(list(made[1][:k]) if fresh else [])
        return result
