"""Prompt lookup: the tokens that followed the latest earlier occurrence of a request's suffix."""

from __future__ import annotations


class NgramIndex:
    """For each n in [min_n, max_n], where each n-gram of one request's tokens last ended.

    Grown as tokens arrive (each token is indexed once, O(max_n - min_n + 1) per token), so a
    lookup costs the same at any context length. The tokens must only grow by appending, as a
    request's prompt + output do (preemption keeps them).
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        # per n: n-gram -> end (exclusive) of its latest occurrence among the indexed ends
        self._last_end: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_n, max_n + 1)]
        self._num_indexed = 0  # ends below this are in the tables

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix
        of `token_ids` (max_n down to min_n tokens) seen before; [] when none recurs."""
        end = self.lookup(token_ids)
        return [] if end is None or k <= 0 else token_ids[end : end + k]

    def lookup(self, token_ids: list[int]) -> int | None:
        """Where the latest earlier occurrence of the longest recurring suffix of `token_ids`
        (max_n down to min_n tokens) ends, or None."""
        length = len(token_ids)
        # every end but `length` itself: the suffix must not find itself
        for end in range(max(self._num_indexed, self.min_n), length):
            for n, table in enumerate(self._last_end, self.min_n):
                if end >= n:
                    table[tuple(token_ids[end - n : end])] = end
        self._num_indexed = max(self._num_indexed, length)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            end = self._last_end[n - self.min_n].get(tuple(token_ids[length - n :]))
            if end is not None:
                return end
        return None
