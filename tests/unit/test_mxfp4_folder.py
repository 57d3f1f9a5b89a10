"""Hugging Face folders in gpt-oss's MXFP4 layout (loader/mxfp4_blocks.py): `X_blocks` +
`X_scales` pairs load as one GGUF MXFP4 QuantizedTensor `X` whose decoding equals transformers'
`convert_moe_packed_tensors`, across shards, and as floats where blocks are not kept."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from safetensors.torch import save_file

from hybridllm.loader import open_model_source
from hybridllm.loader.mxfp4_blocks import deinterleave_rows, repack_mxfp4
from hybridllm.loader.quantized_tensor import QuantizedTensor

transformers_mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")

E, INTER, HIDDEN = 3, 64, 96  # gate_up [3, 128, 3, 16], down [3, 96, 2, 16]
PREFIX = "model.layers.0.mlp.experts."


def packed(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random HF MXFP4 blocks [E, rows, cols / 32, 16] and scales [E, rows, cols / 32]: every
    code, exponents 2^-10 .. 2^5 around the bias (127)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (E, rows, cols // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(117, 133, (E, rows, cols // 32), dtype=torch.uint8, generator=g)
    return blocks, scales


def reference(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """transformers' decoding [E, cols, rows] (x @ W layout), back to rows of outputs."""
    out = transformers_mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    return out.transpose(1, 2)  # [E, rows, cols]


@pytest.fixture
def folder(tmp_path):
    gate_up = packed(2 * INTER, HIDDEN, 1)
    down = packed(HIDDEN, INTER, 2)
    config = {
        "model_type": "gpt_oss",
        "architectures": ["GptOssForCausalLM"],
        "quantization_config": {"quant_method": "mxfp4"},
        # what HFConfig requires of every gpt_oss config (the test reads no layer)
        "hidden_size": HIDDEN,
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
        "vocab_size": 32,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    # two shards, each pair's scales in the other shard than its blocks
    first = {
        PREFIX + "gate_up_proj_blocks": gate_up[0],
        PREFIX + "down_proj_scales": down[1],
        PREFIX + "gate_up_proj_bias": torch.randn(E, 2 * INTER),
    }
    second = {PREFIX + "gate_up_proj_scales": gate_up[1], PREFIX + "down_proj_blocks": down[0]}
    save_file(first, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(second, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {name: "model-00001-of-00002.safetensors" for name in first}
    weight_map.update({name: "model-00002-of-00002.safetensors" for name in second})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tmp_path, gate_up, down


def test_pairs_load_as_mxfp4_blocks_equal_to_transformers(folder):
    path, gate_up, down = folder
    source = open_model_source(str(path))
    assert sorted(source.weight_names()) == sorted(
        PREFIX + n for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj")
    )
    weights = dict(source.iter_weights(quantized_types={int(Q.MXFP4)}))
    assert set(weights) == set(source.weight_names())
    for name, (blocks, scales), rows, cols in (
        ("gate_up_proj", gate_up, 2 * INTER, HIDDEN),
        ("down_proj", down, HIDDEN, INTER),
    ):
        qt = weights[PREFIX + name]
        assert isinstance(qt, QuantizedTensor)
        assert qt.ggml_type == Q.MXFP4 and qt.shape == (E * rows, cols)
        assert qt.raw.shape == (E * rows, cols // 32 * 17)
        want = reference(blocks, scales).reshape(E * rows, cols)
        # gguf's reference decoding of the repacked blocks, and the loader's
        got = torch.from_numpy(dequantize(qt.raw, Q.MXFP4).reshape(E * rows, cols))
        assert torch.equal(got, want)
        assert torch.equal(qt.dequantize(), want)
    assert isinstance(weights[PREFIX + "gate_up_proj_bias"], torch.Tensor)


def test_pairs_load_as_floats_where_blocks_are_not_kept(folder):
    path, gate_up, _ = folder
    source = open_model_source(str(path))
    owned = PREFIX + "gate_up_proj"
    weights = dict(source.iter_weights(lambda name: name == owned))
    assert list(weights) == [owned]
    assert torch.equal(weights[owned], reference(*gate_up))  # [E, rows, cols] float32


def test_deinterleave_rows_puts_each_experts_gate_rows_first(folder):
    _, (blocks, scales), _ = folder
    qt = repack_mxfp4("gate_up", blocks.numpy(), scales.numpy())
    split = deinterleave_rows(qt, E)
    assert split.shape == qt.shape and split.ggml_type == Q.MXFP4
    fused = reference(blocks, scales)  # [E, 2I, H]: rows gate 0, up 0, gate 1, ...
    want = torch.cat((fused[:, 0::2], fused[:, 1::2]), dim=1).reshape(E * 2 * INTER, HIDDEN)
    assert torch.equal(split.dequantize(), want)
    with pytest.raises(ValueError):
        deinterleave_rows(qt, 5)


def test_mismatched_scales_raise_naming_the_weight():
    from hybridllm.loader.model_source import ModelLoadError

    blocks = np.zeros((2, 4, 3, 16), dtype=np.uint8)
    with pytest.raises(ModelLoadError, match="experts.down_proj"):
        repack_mxfp4("experts.down_proj", blocks, np.zeros((2, 4, 2), dtype=np.uint8))
