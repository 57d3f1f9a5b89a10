"""`--quantization q8_0|q4_0|q4_1` on an MoE folder quantizes its experts at load too.

The routed experts (per-expert checkpoint tensors, or transformers 5's stacks) become blocks of
the chosen type that the fused MoE op reads; greedy tokens equal the same blocks decoded back
into float experts (the dense linears and head are the same blocks in both runs), and a second
load reads the cached blocks instead of quantizing again.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

from hybridllm import LLM, SamplingParams
from hybridllm.layers.expert_weights import StackedExpertWeight
from hybridllm.loader.onload_quant import QuantizedWeightCache, quantize_weights
from hybridllm.models.moe import SparseMoeBlock
from hybridllm.models.registry import get_model_class
from tests.kernel_helpers import require_cpu_kernels
from tests.moe_helpers import build_tiny_moe_model, make_tiny_moe_model

PROMPTS = [[5, 17, 42, 99, 7, 63, 12, 8, 150, 33], [3, 8, 200]]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
# experts whose widths are whole blocks (the helpers' 40 is not): every expert tensor quantizes
ARCHS = {
    "qwen3_moe": dict(moe_intermediate_size=64),  # top-4 of 6
    "mixtral": dict(intermediate_size=64),  # top-2 of 5, `block_sparse_moe.experts.N.w1` names
}


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    require_cpu_kernels()


@pytest.fixture(scope="module", params=list(ARCHS))
def moe_folder(request, tmp_path_factory):
    arch = request.param
    return arch, make_tiny_moe_model(arch, tmp_path_factory.mktemp(arch), **ARCHS[arch])


def generate(path, quantization: str):
    """Greedy tokens and logprobs of every prompt, and the first sparse layer's experts."""
    llm = LLM(
        str(path),
        dtype="float32",
        quantization=quantization,
        skip_tokenizer_init=True,
        max_model_len=128,
        kv_cache_memory="16MiB",
        use_tqdm=False,
    )
    try:
        layers = llm.llm_engine.executor.workers[0].model_runner.model.layers
        experts = next(
            layer.mlp.experts for layer in layers if isinstance(layer.mlp, SparseMoeBlock)
        )
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
        result = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]
        return result, (experts.w13.ggml_type, experts.w2.ggml_type, experts.native)
    finally:
        llm.shutdown()


def decode_experts_at_load(monkeypatch):
    """From now on every expert stack decodes its blocks into floats when loading finishes."""
    finish = StackedExpertWeight.finish_loading

    def decoding(self):
        self._mixed = True  # as when some blocks came in another type: decode them all
        finish(self)

    monkeypatch.setattr(StackedExpertWeight, "finish_loading", decoding)


def test_experts_quantized_at_load_equal_them_decoded(moe_folder, tmp_path, monkeypatch):
    arch, path = moe_folder
    monkeypatch.setenv("HYBRIDLLM_CACHE_DIR", str(tmp_path / "cache"))
    got, (w13_type, w2_type, native) = generate(path, "q8_0")
    assert (w13_type, w2_type, native) == (Q.Q8_0, Q.Q8_0, True)  # the fused op over blocks
    cfg = build_tiny_moe_model(arch, **ARCHS[arch]).config  # (the config only)
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    names = [p.name for p in (tmp_path / "cache" / "quantized").rglob("*.npy")]
    assert sum(".experts." in n for n in names) == cfg.num_hidden_layers * experts * 3
    assert not any(".gate.weight" in n for n in names)  # the router stays float

    decode_experts_at_load(monkeypatch)
    want, (w13_type, w2_type, _) = generate(path, "q8_0")  # the cached blocks, decoded
    assert Q.Q8_0 not in (w13_type, w2_type)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    for (_, got_lp), (_, want_lp) in zip(got, want):
        for a, b in zip(got_lp, want_lp):
            assert a.keys() == b.keys()
            for token in a:
                assert a[token].logprob == pytest.approx(b[token].logprob, abs=2e-3)


def test_q4_0_experts_and_the_cache_is_reused(moe_folder, tmp_path, monkeypatch):
    _, path = moe_folder
    cache = tmp_path / "cache"
    monkeypatch.setenv("HYBRIDLLM_CACHE_DIR", str(cache))
    first, types = generate(path, "q4_0")
    assert types == (Q.Q4_0, Q.Q4_0, True)
    entries = sorted(p for p in (cache / "quantized").rglob("*.npy") if ".experts." in p.name)
    assert entries and all(p.name.endswith(".Q4_0.npy") for p in entries)
    stamps = {p: p.stat().st_mtime_ns for p in entries}
    second, types = generate(path, "q4_0")
    assert types == (Q.Q4_0, Q.Q4_0, True) and second == first
    assert {p: p.stat().st_mtime_ns for p in entries} == stamps  # read, not written again


def test_stacked_experts_quantize_to_the_per_expert_blocks(tmp_path):
    """transformers 5's stacks ([E, 2I, H] gate_up, [E, H, I] down) quantized at load give the
    blocks the checkpoint's per-expert tensors give."""
    hf = build_tiny_moe_model("qwen3_moe", **ARCHS["qwen3_moe"])
    folder = make_tiny_moe_model("qwen3_moe", tmp_path / "hf", **ARCHS["qwen3_moe"])
    per_expert = load_file(str(folder / "model.safetensors"))
    stacked = hf.state_dict()
    assert any(n.endswith("experts.gate_up_proj") for n in stacked)  # the stacked names

    def loaded(weights, key):
        cls = get_model_class(type(hf).__name__)
        model = cls(hf.config, torch.float32, torch.device("cpu"), 0, None)
        cache = QuantizedWeightCache(key, root=str(tmp_path / "cache"))
        named = ((n, t) for n, t in weights.items() if model.owns_weight(n))
        model.load_weights(quantize_weights(named, model.quantize_role, "q4_1", cache))
        model.process_weights_after_loading()
        return [layer.mlp.experts for layer in model.layers]

    for a, b in zip(loaded(per_expert, "per_expert"), loaded(stacked, "stacked")):
        for wa, wb in ((a.w13, b.w13), (a.w2, b.w2)):
            assert wa.ggml_type == wb.ggml_type == Q.Q4_1
            assert torch.equal(wa.qweight, wb.qweight)


def test_blocks_of_some_experts_only_are_decoded():
    """Experts that came partly as blocks (another part or expert float) compute from floats."""
    import gguf
    import numpy as np

    from hybridllm.loader.quantized_tensor import QuantizedTensor

    torch.manual_seed(0)
    weight = StackedExpertWeight(2, (32, 32), 64, torch.float32, torch.device("cpu"))
    full = torch.randn(2, 64, 64)
    blocks = {}
    for e in range(2):
        for part in range(2):
            rows = full[e, part * 32 : (part + 1) * 32]
            raw = gguf.quants.quantize(rows.numpy(), Q.Q8_0)
            blocks[e, part] = QuantizedTensor(raw, Q.Q8_0, (32, 64))
            decoded = torch.from_numpy(
                np.asarray(gguf.quants.dequantize(raw, Q.Q8_0), dtype=np.float32)
            )
            full[e, part * 32 : (part + 1) * 32] = decoded
    for (e, part), q in blocks.items():
        if (e, part) == (1, 1):
            weight.load(full[1, 32:], "up", part, e)  # a float part
        else:
            weight.load(q, "x", part, e)
    weight.finish_loading()
    assert weight.qweight is None and torch.equal(weight.weight, full)


def test_host_experts_of_a_stage_are_quantized(moe_folder, tmp_path, monkeypatch):
    """--cpu-moe: the host experts beside their stage (the CPU here too) are blocks as well."""
    _, path = moe_folder
    monkeypatch.setenv("HYBRIDLLM_CACHE_DIR", str(tmp_path / "cache"))
    plain, types = generate(path, "q8_0")
    llm = LLM(
        str(path),
        dtype="float32",
        quantization="q8_0",
        cpu_moe=True,
        skip_tokenizer_init=True,
        max_model_len=128,
        kv_cache_memory="16MiB",
        use_tqdm=False,
    )
    try:
        assert llm.llm_engine.config.plan.stages[0].cpu_expert_layers == 3
        layers = llm.llm_engine.executor.workers[0].model_runner.model.layers
        experts = [layer.mlp.experts for layer in layers]
        assert all(e.w13.ggml_type == e.w2.ggml_type == Q.Q8_0 for e in experts)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
        assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs] == plain
    finally:
        llm.shutdown()


def test_a_gpu_stage_quantizes_only_its_host_experts():
    """What goes to the stage's device stays float; its host experts' tensors are quantized
    (built on `meta` here, as there is no GPU: only the weight names are asked)."""
    config = build_tiny_moe_model("qwen2_moe").config
    cls = get_model_class("Qwen2MoeForCausalLM")
    with torch.device("meta"):
        model = cls(config, torch.float32, torch.device("meta"), 0, None, cpu_expert_layers=1)
    role = model.quantize_role
    assert role("model.layers.0.mlp.experts.3.up_proj.weight") == "linear"  # host experts
    assert role("model.layers.0.mlp.experts.gate_up_proj") == "linear"  # a transformers-5 stack
    assert role("model.layers.2.mlp.experts.3.up_proj.weight") is None  # the stage's experts
    assert role("model.layers.0.self_attn.q_proj.weight") is None
    assert role("model.layers.0.mlp.shared_expert.up_proj.weight") is None
    assert role("lm_head.weight") is None
