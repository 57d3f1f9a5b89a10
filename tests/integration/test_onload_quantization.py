"""`--quantization q8_0|q4_0|q4_1`: a Hugging Face folder quantized at load runs as its GGUF twin.

The twin is the same model written as a GGUF file with the same block types (gguf's quantizer
is the one the loader uses, and permuting q/k rows commutes with row-wise blocks), so both load
the same blocks into the same kernels: greedy tokens and logprobs must be equal, not close.
"""

from __future__ import annotations

import math
import os

import pytest
from gguf import GGMLQuantizationType as Q

from hybridllm import LLM, SamplingParams
from hybridllm.loader import open_model_source
from hybridllm.loader.block_sizes import cpu_block_sizes
from hybridllm.loader.onload_quant import QuantizedWeightCache
from tests.gguf_helpers import tiny_hf_model, write_gguf
from tests.kernel_helpers import require_cpu_kernels

PROMPTS = [[5, 17, 42, 99, 7, 63, 12], [3, 8, 200]]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    require_cpu_kernels()


@pytest.fixture(scope="module")
def model():
    return tiny_hf_model("llama", seed=3)


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    model.save_pretrained(path)
    return str(path)


def twin(model, qtype: Q, path) -> str:
    """The model as a GGUF whose decoder linears are `qtype` and LM head Q8_0."""
    quantize = {"lm_head.weight": Q.Q8_0}
    for i in range(model.config.num_hidden_layers):
        for name in LINEARS:
            part = "self_attn" if name in LINEARS[:4] else "mlp"
            quantize[f"model.layers.{i}.{part}.{name}.weight"] = qtype
    return str(write_gguf(path, model, quantize=quantize))


def generate(path: str, quantization: str) -> list:
    llm = LLM(path, quantization=quantization, skip_tokenizer_init=True, use_tqdm=False)
    try:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("quantization", ["q8_0", "q4_0", "q4_1"])
def test_folder_quantized_at_load_equals_its_gguf_twin(
    quantization, model, folder, tmp_path, monkeypatch
):
    monkeypatch.setenv("HYBRIDLLM_CACHE_DIR", str(tmp_path / "cache"))
    gguf_path = twin(model, Q[quantization.upper()], tmp_path / "twin.gguf")
    want = generate(gguf_path, "auto")
    got = generate(folder, quantization)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    for (_, got_lp), (_, want_lp) in zip(got, want):
        for a, b in zip(got_lp, want_lp):
            assert {t: p.logprob for t, p in a.items()} == {t: p.logprob for t, p in b.items()}
    # and it is not the float model: the blocks changed the logprobs
    floats = generate(folder, "auto")
    assert any(f[1] != g[1] for f, g in zip(floats, got))


def test_cache_is_reused_and_a_damaged_entry_is_rebuilt(model, folder, tmp_path, monkeypatch):
    cache_dir = tmp_path / "cache"
    monkeypatch.setenv("HYBRIDLLM_CACHE_DIR", str(cache_dir))
    first = generate(folder, "q4_1")
    entries = sorted((cache_dir / "quantized").rglob("*.npy"))
    # 7 linears in each of 2 layers, and the head
    assert len(entries) == 2 * 7 + 1
    stamps = {p: p.stat().st_mtime_ns for p in entries}
    assert generate(folder, "q4_1") == first
    assert {p: p.stat().st_mtime_ns for p in entries} == stamps  # read, not written again
    damaged = entries[0]
    damaged.write_bytes(b"not an array")
    assert generate(folder, "q4_1") == first
    assert damaged.stat().st_size > 100  # quantized again and stored


def test_cache_entries_stay_inside_their_folder(tmp_path):
    cache = QuantizedWeightCache("key", root=str(tmp_path))
    path = cache.path("../../etc/passwd/model.layers.0.weight", Q.Q8_0)
    assert path.parent == tmp_path / "quantized" / "key"
    assert os.sep not in path.name


def test_plan_counts_the_quantized_bytes(model, folder):
    source = open_model_source(folder)
    config = source.hf_config
    sizes = cpu_block_sizes(source, config, "q4_0", lambda: True)
    params = sum(
        p.numel()
        for name, p in model.named_parameters()
        if name.startswith("model.layers.") and name.endswith("proj.weight")
    )
    assert sizes.kept_params == sizes.total_params == params
    assert sizes.kept_bytes == math.ceil(params * 18 / 32)
    assert sizes.lm_head_bytes == config.vocab_size * config.hidden_size * 34 // 32
    assert cpu_block_sizes(source, config, "none", lambda: True) is None
    assert cpu_block_sizes(source, config, "auto", lambda: True) is None  # a float folder: floats


def test_moe_router_stays_float_and_experts_are_quantized(tmp_path, monkeypatch):
    # Qwen2-MoE: attention, the shared expert, the dense layer's MLP and the routed experts
    # are quantized; the router (it picks the experts) is not
    from tests.moe_helpers import make_tiny_moe_model

    monkeypatch.setenv("HYBRIDLLM_CACHE_DIR", str(tmp_path / "cache"))
    path = make_tiny_moe_model("qwen2_moe", tmp_path / "moe")
    tokens = generate(str(path), "q8_0")
    assert [len(t) for t, _ in tokens] == [12, 12]
    names = {p.name.split(".weight.")[0] for p in (tmp_path / "cache").rglob("*.npy")}
    assert "model.layers.0.self_attn.q_proj" in names
    assert "model.layers.0.mlp.shared_expert.gate_proj" in names
    assert "model.layers.1.mlp.gate_proj" in names  # mlp_only_layers=[1]: a dense MLP
    assert "model.layers.1.mlp.down_proj" not in names  # 72 columns: not whole blocks
    assert not any(".mlp.gate." in n or n.endswith(".mlp.gate") for n in names)
    assert "model.layers.0.mlp.experts.6.gate_proj" in names  # 96 columns
    assert "model.layers.0.mlp.experts.6.up_proj" in names
    assert not any(n.endswith(".down_proj") and ".experts." in n for n in names)  # 40 columns
