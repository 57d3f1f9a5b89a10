"""Stop strings: find them in newly detokenized text, and hold back text that may start one."""

from __future__ import annotations

from collections.abc import Sequence


def check_stop_strings(
    text: str,
    new_text_len: int,
    stop: Sequence[str],
    include_stop_str_in_output: bool,
) -> tuple[str, int] | None:
    """Look for a stop string that the last `new_text_len` chars of `text` completed.

    Returns `(stop_string, truncate_to)`: the output text becomes `text[:truncate_to]`,
    which ends just before the stop string, or just after it when
    `include_stop_str_in_output`. None when no stop string matched. Only the tail that can
    hold a new match is searched: the new text plus `len(stop) - 1` chars before it (older
    text was already searched). The earliest match wins; on a tie, the longer string.
    """
    if not stop or new_text_len <= 0:
        return None
    best: tuple[int, int, str] | None = None  # (position, -length, stop string)
    for stop_str in stop:
        # A match must end inside the new text, so it starts no earlier than this.
        start = max(0, len(text) - new_text_len - len(stop_str) + 1)
        position = text.find(stop_str, start)
        if position != -1 and (best is None or (position, -len(stop_str)) < best[:2]):
            best = (position, -len(stop_str), stop_str)
    if best is None:
        return None
    position, _, stop_str = best
    truncate_to = position + len(stop_str) if include_stop_str_in_output else position
    return stop_str, truncate_to


def stop_string_holdback(text: str, stop: Sequence[str]) -> int:
    """How many trailing chars of `text` to keep from the stream: they may begin a stop string.

    The longest suffix of `text` that is a proper prefix of some stop string; streaming it
    now could show text that a later token turns into a (never emitted) stop string.
    """
    holdback = 0
    for stop_str in stop:
        for length in range(min(len(stop_str) - 1, len(text)), holdback, -1):
            if text.endswith(stop_str[:length]):
                holdback = length
                break
    return holdback
