"""Quantization at load: a checkpoint's float linears turned into GGUF blocks, cached on disk.

CPU workers compute GGUF blocks with the native op at a fraction of the bytes of fp32 weights.
`--quantization q8_0|q4_0|q4_1` gives Hugging Face folders (and a GGUF's float tensors) the same
kernels: each decoder-layer linear is quantized into that type, the LM head into Q8_0 (its rows
pick the next token: llama.cpp keeps it at 6-8 bits too); embeddings, norms and MoE routers stay
float. MoE experts (per-expert tensors, or stacks [E, rows, cols] quantized as their E * rows
rows) take the chosen type too: the fused MoE op reads their blocks. Blocks are written to
`$HYBRIDLLM_CACHE_DIR/quantized/`, one `.npy` per tensor in a folder keyed by the weight files'
paths, sizes and modification times, so the next load memory-maps them instead of quantizing
again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType

from hybridllm import progress
from hybridllm.loader.gguf_cache import cache_root
from hybridllm.loader.quantized_tensor import QuantizedTensor

logger = logging.getLogger(__name__)

# --quantization values that quantize at load, and their block types
ONLOAD_TYPES = {
    "q8_0": GGMLQuantizationType.Q8_0,
    "q4_0": GGMLQuantizationType.Q4_0,
    "q4_1": GGMLQuantizationType.Q4_1,
}
HEAD_TYPE = GGMLQuantizationType.Q8_0
BLOCK = 32  # values a block of these types covers along a row
# Bump when the quantization or layout changes: old entries then stop matching.
CACHE_FORMAT_VERSION = 1
# gguf's numpy quantizers ran 25-60 M parameters/s on one core here (Q8_0 slowest).
_QUANTIZE_ESTIMATE = "20-40 s"

# Which loaded weights to quantize: "linear", "head", or None (keep as loaded).
QuantizeRole = Callable[[str], "str | None"]


def block_type_for(quantization: str, role: str) -> GGMLQuantizationType:
    return HEAD_TYPE if role == "head" else ONLOAD_TYPES[quantization]


def bytes_per_param(ggml_type: GGMLQuantizationType) -> float:
    block, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    return type_size / block


def checkpoint_key(weight_files: Iterable[str]) -> str:
    """A digest of the weight files' absolute paths, sizes and modification times."""
    entries = []
    for path in sorted(os.path.abspath(p) for p in weight_files):
        stat = os.stat(path)
        entries.append([path, stat.st_size, stat.st_mtime_ns])
    text = json.dumps([CACHE_FORMAT_VERSION, entries])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class QuantizedWeightCache:
    """One checkpoint's quantized tensors on disk: `<root>/quantized/<key>/<name>.<type>.npy`."""

    def __init__(self, key: str, root: str | None = None):
        self.folder = Path(root or cache_root()) / "quantized" / key

    def path(self, name: str, ggml_type: GGMLQuantizationType) -> Path:
        # the checkpoint names the tensor: keep its name readable but never a path
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:120]
        digest = hashlib.sha256(name.encode()).hexdigest()[:12]
        return self.folder / f"{safe}.{digest}.{ggml_type.name}.npy"

    def get(self, name: str, ggml_type: GGMLQuantizationType, weight: torch.Tensor) -> np.ndarray:
        """The blocks [rows, bytes] of `weight` [rows, cols]: from the cache, else quantized now
        and stored (written to a temporary file and renamed, so readers never see half)."""
        path = self.path(name, ggml_type)
        rows, cols = weight.shape
        expected = (rows, cols // BLOCK * gguf.GGML_QUANT_SIZES[ggml_type][1])
        if path.exists():
            try:
                raw = np.load(path, mmap_mode="r")
                if raw.shape == expected and raw.dtype == np.uint8:
                    return raw
            except (OSError, ValueError):
                pass
            logger.warning("quantized cache entry %s is damaged; quantizing again", path)
        raw = gguf.quants.quantize(weight.detach().float().numpy(), ggml_type)
        self.folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.save(f, raw)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return raw


def quantize_weights(
    weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]],
    role: QuantizeRole,
    quantization: str,
    cache: QuantizedWeightCache,
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """`weights` with each float weight that `role` names, and whose rows are whole blocks,
    replaced by its blocks: a 2-D [rows, cols] one, or a stack of experts [E, rows, cols] as
    blocks of its E * rows rows (GGUF blocks and everything else pass through)."""
    started: float | None = None  # when the first tensor missing from the cache came
    count = params = 0
    for name, tensor in weights:
        kind = role(name)
        if (
            kind is None
            or not isinstance(tensor, torch.Tensor)
            or not tensor.is_floating_point()
            or tensor.dim() not in (2, 3)
            or tensor.shape[-1] % BLOCK
        ):
            yield name, tensor
            continue
        if tensor.dim() == 3:  # experts stacked [E, rows, cols]: their rows one after another
            tensor = tensor.reshape(-1, tensor.shape[-1])
        ggml_type = block_type_for(quantization, kind)
        if not cache.path(name, ggml_type).exists():
            if started is None:  # a first load: say why it takes longer than the next ones
                started = time.monotonic()
                progress.logger.info(
                    "quantizing the float linears into %s blocks (once per checkpoint; about "
                    "%s per billion parameters), cached in %s...",
                    quantization,
                    _QUANTIZE_ESTIMATE,
                    cache.folder,
                )
            count += 1
            params += tensor.numel()
        raw = cache.get(name, ggml_type, tensor)
        yield name, QuantizedTensor(raw, ggml_type, (tensor.shape[0], tensor.shape[1]))
    if started is not None:
        elapsed = progress.format_seconds(time.monotonic() - started)
        progress.logger.info(
            "quantized %d tensors (%.0f M parameters) while loading, in %s",
            count,
            params / 1e6,
            elapsed,
        )
