"""A grammar-compile child process: compiles what it is sent and says how it went.

Run as `python -m hybridllm.structured.compile_child` by `IsolatedCompiler`. Frames on
stdin/stdout are a 4-byte big-endian length and a payload: the first frame from the parent
pickles (hf_tokenizer, vocab_size, eos_token_ids); every later one, both ways, is JSON. A
grammar that crashes the compiler kills this process only.
"""

from __future__ import annotations

import json
import pickle
import struct
import sys
import time
from typing import Any, BinaryIO

from hybridllm.structured.compile_threads import run_on_big_stack

_HEADER = struct.Struct(">I")


def write_frame(stream: BinaryIO, payload: bytes) -> None:
    data = memoryview(_HEADER.pack(len(payload)) + payload)
    while data:  # an unbuffered pipe may take part of it
        data = data[stream.write(data) :]
    stream.flush()


def read_frame(stream: BinaryIO) -> bytes | None:
    """The next frame's payload, or None at end of stream."""
    header = _read_exactly(stream, _HEADER.size)
    return None if header is None else _read_exactly(stream, _HEADER.unpack(header)[0])


def _read_exactly(stream: BinaryIO, size: int) -> bytes | None:
    parts, left = [], size
    while left:
        part = stream.read(left)
        if not part:
            return None
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def params_from_key(kind: str, spec: str) -> Any:
    """The StructuredOutputsParams whose `key` is (kind, spec)."""
    from hybridllm.structured.params import StructuredOutputsParams

    if kind == "choice":
        return StructuredOutputsParams(choice=json.loads(spec))
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    return StructuredOutputsParams(**{kind: spec})


def _compile_one(job: dict, tokenizer: Any) -> dict:
    from hybridllm.structured.backend import compile_grammar

    start = time.monotonic()
    try:
        run_on_big_stack(
            lambda: compile_grammar(params_from_key(job["kind"], job["spec"]), tokenizer)
        )
    except ValueError as exc:  # GrammarError and the params' own checks
        return {"ok": False, "error": str(exc)}
    return {"ok": True, "seconds": time.monotonic() - start}


def main() -> None:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write into the frame stream
    first = read_frame(stdin)
    if first is None:
        return
    from hybridllm.structured.backend import make_tokenizer

    hf_tokenizer, vocab_size, eos_token_ids = pickle.loads(first)
    tokenizer = make_tokenizer(hf_tokenizer, vocab_size, eos_token_ids)
    write_frame(stdout, b'{"ready": true}')
    while (frame := read_frame(stdin)) is not None:
        write_frame(stdout, json.dumps(_compile_one(json.loads(frame), tokenizer)).encode())


if __name__ == "__main__":
    main()
