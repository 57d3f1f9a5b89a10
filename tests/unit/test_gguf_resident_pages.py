"""Reading a GGUF file's blocks leaves none of its mapped pages resident: each tensor's pages are
dropped once its consumer has copied it, and a view kept past that still reads the right bytes."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from hybridllm.loader.gguf_kernel_types import GGUF_KERNEL_TYPES
from hybridllm.loader.gguf_source import GGUFSource
from hybridllm.loader.model_source import own_all
from hybridllm.loader.quantized_tensor import QuantizedTensor
from tests.gguf_memory_helpers import write_random_llama_gguf

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status")


def _rss_file() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile in /proc/self/status")


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # about 26 MB: 2 layers of a 1024-wide Llama, Q4_K with Q6_K v/down and embedding
    path = tmp_path_factory.mktemp("gguf") / "small-q4_k_m-like.gguf"
    return write_random_llama_gguf(
        path, hidden=1024, layers=2, intermediate=4096, vocab=8192, heads=16, kv_heads=4
    )


def test_iterating_blocks_keeps_no_mapped_pages(model_file: Path) -> None:
    source = GGUFSource(str(model_file), use_cache=False)
    before = _rss_file()
    kept, peak = [], 0
    for _, tensor in source.iter_weights(own_all, GGUF_KERNEL_TYPES):
        assert isinstance(tensor, QuantizedTensor) or tensor.dim() == 1
        if isinstance(tensor, QuantizedTensor):
            kept.append(tensor.copy())  # what a layer keeps
        peak = max(peak, _rss_file() - before)
    file_bytes = model_file.stat().st_size
    assert sum(t.raw.nbytes for t in kept) > 0.95 * file_bytes
    # without dropping them every page read stays mapped: the whole file (+ the header's)
    assert _rss_file() - before < 0.1 * file_bytes
    # one tensor's pages at a time at most (the largest: the 8192-row Q6_K embedding, 7 MB)
    assert peak < 0.3 * file_bytes


def test_a_view_kept_after_its_pages_are_dropped_reads_the_file(model_file: Path) -> None:
    source = GGUFSource(str(model_file), use_cache=False)
    views = {
        name: tensor
        for name, tensor in source.iter_weights(own_all, GGUF_KERNEL_TYPES)
        if isinstance(tensor, QuantizedTensor)
    }
    reader = gguf.GGUFReader(str(model_file))
    for t in reader.tensors:
        if t.name == "blk.1.ffn_down.weight":
            want = np.asarray(t.data).reshape(
                views["model.layers.1.mlp.down_proj.weight"].raw.shape
            )
    np.testing.assert_array_equal(views["model.layers.1.mlp.down_proj.weight"].raw, want)
