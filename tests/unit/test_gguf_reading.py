"""Our GGUF header parser and dequantization against the reference `gguf` package."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from hybridllm.loader.gguf_dequant import decoded_dtype, dequantize
from hybridllm.loader.gguf_file import GGUFFile
from hybridllm.loader.gguf_mapping import rope_row_order
from tests.gguf_helpers import llama_cpp_permute, tiny_hf_model, write_gguf

Q = gguf.GGMLQuantizationType


def test_header_matches_gguf_reader(tmp_path):
    path = write_gguf(
        tmp_path / "m.gguf",
        tiny_hf_model("llama"),
        quantize={
            "model.layers.0.mlp.up_proj.weight": Q.Q4_1,
        },
    )
    ours = GGUFFile(str(path))
    reference = gguf.GGUFReader(str(path))
    for key, field in reference.fields.items():
        if key.startswith("GGUF."):
            continue
        assert ours.metadata[key] == field.contents(), key
    assert list(ours.tensors) == [t.name for t in reference.tensors]
    for t in reference.tensors:
        info = ours.tensors[t.name]
        assert info.ggml_type == t.tensor_type
        assert info.shape == tuple(int(n) for n in reversed(t.shape))  # torch order
        assert info.nbytes == t.n_bytes
        assert np.array_equal(ours.raw_rows(info).reshape(-1), t.data.reshape(-1).view(np.uint8))


@pytest.mark.parametrize(
    "qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0], ids=lambda q: q.name
)
def test_dequantize_matches_gguf(qtype):
    rng = np.random.default_rng(0)
    values = rng.standard_normal((24, 512)).astype(np.float32)
    values[3] = 0.0  # an all-zero row: zero scales
    packed = gguf.quants.quantize(values, qtype)
    raw = np.ascontiguousarray(packed).view(np.uint8).reshape(24, -1)  # [rows, bytes_per_row]
    ours = dequantize(raw, qtype, (24, 512))
    reference = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))
    assert ours.dtype == decoded_dtype(qtype) and ours.shape == (24, 512)
    assert torch.equal(ours.float(), reference)  # bit-identical, not just close


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_embedding_rows_from_blocks_match_gguf(qtype):
    # an embedding kept in GGUF blocks decodes only the rows it looks up
    from hybridllm.layers.vocab_embedding import VocabEmbedding

    rng = np.random.default_rng(1)
    values = rng.standard_normal((24, 96)).astype(np.float32)
    values[5] = 0.0
    raw = np.ascontiguousarray(gguf.quants.quantize(values, qtype)).view(np.uint8)
    reference = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))
    blocks = torch.from_numpy(raw.reshape(24, -1))
    embedding = VocabEmbedding(24, 96, torch.float32, torch.device("cpu"))
    embedding.use_blocks(blocks, int(qtype), "t")
    rows = torch.tensor([7, 5, 0, 23, 7])
    assert torch.equal(embedding(rows), reference[rows])  # bit-identical
    assert embedding.weight.numel() == 0  # no float table kept
    with pytest.raises(ValueError, match=r"weight t: expected blocks .* for a \[24, 64\] table"):
        VocabEmbedding(24, 64, torch.float32, torch.device("cpu")).use_blocks(blocks, qtype, "t")
    with pytest.raises(ValueError, match="weight t: expected blocks"):
        VocabEmbedding(23, 96, torch.float32, torch.device("cpu")).use_blocks(blocks, qtype, "t")


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_dequantize_k_quants_from_random_blocks(qtype):
    # gguf cannot quantize K formats in Python; any bytes are valid blocks (scales may be NaN).
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(0).integers(0, 256, (8, 2 * type_size), dtype=np.uint8)
    ours = dequantize(raw, qtype, (8, 2 * block_size))
    reference = gguf.quants.dequantize(raw, qtype)
    assert ours.dtype == torch.float32
    assert np.array_equal(ours.numpy(), reference, equal_nan=True)


def test_rope_row_order_inverts_llama_cpp_permutation():
    w = np.arange(24 * 3).reshape(24, 3)
    for num_heads in (1, 2, 6):
        assert np.array_equal(llama_cpp_permute(w, num_heads)[rope_row_order(24, num_heads)], w)


def test_quantized_gguf_round_trip(tmp_path):
    # q/k quantized: the row permutation is undone on the packed rows, before decoding.
    from hybridllm.loader import GGUFSource

    model = tiny_hf_model("llama")
    quantize = {
        "model.layers.0.self_attn.q_proj.weight": Q.Q4_1,
        "model.layers.0.self_attn.k_proj.weight": Q.Q8_0,
        "model.layers.1.mlp.down_proj.weight": Q.Q4_0,
    }
    path = write_gguf(tmp_path / "m.gguf", model, quantize=quantize)
    ours = dict(GGUFSource(str(path), use_cache=False).iter_weights())
    reference = model.state_dict()
    for name, tensor in reference.items():
        if name in quantize:  # lossy: close to the original, as 4/8-bit values are
            assert not torch.equal(ours[name], tensor)
            assert torch.allclose(ours[name], tensor, atol=0.2 * tensor.abs().max().item()), name
            assert (
                torch.corrcoef(torch.stack([ours[name].flatten(), tensor.flatten()]))[0, 1] > 0.98
            )
        else:
            assert torch.equal(ours[name], tensor), name
