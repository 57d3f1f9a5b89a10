"""Streaming safetensors writer: the header first (from shapes), then one tensor at a time.

`safetensors.torch.save_file` wants every tensor in memory at once; a converted 7B model would
need 28 GB of RAM for that. Knowing each tensor's shape and dtype up front lets us write the
header, then stream the data, holding one tensor at a time.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

_DTYPE_NAMES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
}
_HEADER_ALIGNMENT = 8  # safetensors pads the JSON header so tensor data starts 8-byte aligned


def write_safetensors(
    path: str,
    specs: list[tuple[str, tuple[int, ...], torch.dtype]],
    tensors: Iterable[tuple[str, torch.Tensor]],
) -> None:
    """Write `tensors` (yielded in `specs` order, matching its names/shapes/dtypes) to `path`."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": _DTYPE_NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % _HEADER_ALIGNMENT)
    # One writer thread: tensor i goes to disk while the caller produces tensor i + 1 (both
    # numpy decoding and file writes release the GIL).
    with open(path, "wb") as f, ThreadPoolExecutor(1, thread_name_prefix="st-writer") as pool:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        expected = iter(specs)
        pending: Future | None = None
        for name, tensor in tensors:
            spec_name, shape, dtype = next(expected)
            if (name, tuple(tensor.shape), tensor.dtype) != (spec_name, shape, dtype):
                raise ValueError(
                    f"tensor {name} {tuple(tensor.shape)} {tensor.dtype} does not match the "
                    f"header entry {spec_name} {shape} {dtype}"
                )
            # uint8 view of the tensor's memory: written without a copy (little-endian host).
            data = tensor.contiguous().view(-1).view(torch.uint8).numpy().data
            if pending is not None:
                pending.result()
            pending = pool.submit(f.write, data)
        if pending is not None:
            pending.result()
        if next(expected, None) is not None:
            raise ValueError(f"{path}: fewer tensors written than the header declares")
