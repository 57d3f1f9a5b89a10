"""Reasoning parsers: a reply's <think>...</think> block as `reasoning_content`, whole or streamed."""

from __future__ import annotations

from dataclasses import dataclass

REASONING_PARSERS = ("qwen3", "deepseek_r1")
THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    """`starts_thinking`: the reply is reasoning from its first token (DeepSeek-R1's template
    opens the <think> block in the prompt, so the reply may lack the start tag); otherwise
    (Qwen3) only a reply that opens with <think> has reasoning, as with thinking switched off
    the model answers directly."""

    name: str
    starts_thinking: bool

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole reply; None where there is none."""
        body = text.lstrip()
        opened = body.startswith(THINK_START)
        if opened:
            body = body[len(THINK_START) :]
        elif not self.starts_thinking:
            return None, text
        reasoning, closed, content = body.partition(THINK_END)
        if not closed:  # cut off (length) while still thinking: everything is reasoning
            return reasoning or None, None
        return reasoning or None, content.lstrip() or None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.starts_thinking)


class ReasoningStream:
    """Splits streamed text into (reasoning, content) deltas, holding back what could still be
    a partial tag so that no tag text ever reaches the client."""

    def __init__(self, starts_thinking: bool) -> None:
        self._state = "start"  # start -> thinking -> content
        self._starts_thinking = starts_thinking
        self._buffer = ""
        self._content_started = False

    def feed(self, text: str) -> tuple[str, str]:
        self._buffer += text
        reasoning = content = ""
        if self._state == "start":
            head = self._buffer.lstrip()
            if THINK_START.startswith(head) and len(head) < len(THINK_START):
                return "", ""  # whitespace or a partial start tag: undecided yet
            if head.startswith(THINK_START):
                self._buffer = head[len(THINK_START) :]
                self._state = "thinking"
            elif self._starts_thinking:
                self._state = "thinking"
            else:
                self._state = "content"
        if self._state == "thinking":
            end = self._buffer.find(THINK_END)
            if end < 0:
                keep = _held_prefix(self._buffer, THINK_END)
                reasoning = self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return reasoning, ""
            reasoning = self._buffer[:end]
            self._buffer = self._buffer[end + len(THINK_END) :]
            self._state = "content"
        if self._state == "content":
            content, self._buffer = self._buffer, ""
            if not self._content_started:  # as parse(): no leading newline after </think>
                content = content.lstrip()
                self._content_started = bool(content)
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The end of the reply: held-back text goes where it was heading."""
        text, self._buffer = self._buffer, ""
        if self._state == "thinking" or (self._state == "start" and self._starts_thinking):
            return text, ""
        return "", text if self._content_started else text.lstrip()


def _held_prefix(text: str, tag: str) -> int:
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name == "qwen3":
        return ReasoningParser(name, starts_thinking=False)
    if name == "deepseek_r1":
        return ReasoningParser(name, starts_thinking=True)
    raise ValueError(
        f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {name!r}"
    )
