"""Stored conversations behind `previous_response_id`: an LRU bounded in entries and bytes."""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_MAX_RESPONSES = 1024
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


class ResponseStore:
    """Response id -> the chat messages a continuation starts from (the request's conversation
    and the reply). In memory, used on the event loop only; the least recently used go first
    when either bound is passed, so a long-idle id eventually becomes unknown (a 400)."""

    def __init__(
        self, max_responses: int = DEFAULT_MAX_RESPONSES, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        if max_responses < 1 or max_bytes < 1:
            raise ValueError(f"bounds must be >= 1, got {max_responses} and {max_bytes}")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[list[dict[str, Any]], int]] = OrderedDict()
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        # Each entry holds its whole conversation, so a chain costs its length squared: the
        # byte bound is what keeps long agent sessions from growing without end.
        size = len(json.dumps(messages))
        if size > self.max_bytes:
            logger.warning(
                "response %s not stored: its conversation (%d bytes) is over the store's "
                "limit of %d bytes",
                response_id,
                size,
                self.max_bytes,
            )
            return
        self._entries[response_id] = (messages, size)
        self.num_bytes += size
        while len(self._entries) > self.max_responses or self.num_bytes > self.max_bytes:
            _, (_, dropped) = self._entries.popitem(last=False)
            self.num_bytes -= dropped

    def get(self, response_id: str) -> list[dict[str, Any]] | None:
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        self._entries.move_to_end(response_id)
        return entry[0]
