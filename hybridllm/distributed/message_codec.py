"""How a message becomes bytes: pickle 5 with out-of-band buffers, laid out in a ring chunk."""

from __future__ import annotations

import pickle
import struct
from typing import Any

import zmq

INLINE = 0  # the chunk holds the message
ON_SOCKET = 1  # the message did not fit a chunk: it is on the reader's zmq socket
_HEADER = struct.Struct("<BI")  # kind, number of parts (pickle stream, then out-of-band buffers)
_LENGTH = struct.Struct("<Q")

Part = bytes | memoryview


def encode(obj: Any) -> list[Part]:
    """[pickle stream, *out-of-band buffers]; the buffers are zero-copy views of obj's memory
    (numpy arrays, PickleBuffer), so obj must not change until they are copied or sent."""
    buffers: list[pickle.PickleBuffer] = []
    stream = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return [stream, *(b.raw() for b in buffers)]


def nbytes(part: Part) -> int:
    return part.nbytes if isinstance(part, memoryview) else len(part)


def inline_size(parts: list[Part]) -> int:
    """Bytes `write_inline` needs: header, one length per part, the parts."""
    return _HEADER.size + _LENGTH.size * len(parts) + sum(nbytes(p) for p in parts)


def write_inline(chunk: memoryview, parts: list[Part]) -> None:
    """Lay out [kind, n][len_0 .. len_{n-1}][part_0 .. part_{n-1}] at the chunk's start."""
    _HEADER.pack_into(chunk, 0, INLINE, len(parts))
    offset = _HEADER.size
    for part in parts:
        _LENGTH.pack_into(chunk, offset, nbytes(part))
        offset += _LENGTH.size
    for part in parts:
        chunk[offset : offset + nbytes(part)] = part
        offset += nbytes(part)


def write_on_socket_marker(chunk: memoryview) -> None:
    _HEADER.pack_into(chunk, 0, ON_SOCKET, 0)


def chunk_kind(chunk: memoryview) -> int:
    return chunk[0]


def read_inline(chunk: memoryview) -> Any:
    """Unpickle a chunk written by `write_inline`, copying out everything it references
    (the writer reuses the chunk once the reader releases it)."""
    _, n_parts = _HEADER.unpack_from(chunk, 0)
    lengths = struct.unpack_from(f"<{n_parts}Q", chunk, _HEADER.size)
    offset = _HEADER.size + _LENGTH.size * n_parts
    stream = slice(offset, offset + lengths[0])
    offset = stream.stop
    buffers = []
    for length in lengths[1:]:
        buffers.append(bytearray(chunk[offset : offset + length]))  # writable, like the original
        offset += length
    with chunk[stream] as pickled:
        return pickle.loads(pickled, buffers=buffers)


def decode_frames(frames: list[zmq.Frame]) -> Any:
    """Unpickle [stream, *buffers] frames; arrays keep pointing into the frames (no copy)."""
    return pickle.loads(frames[0].buffer, buffers=[f.buffer for f in frames[1:]])
