"""The native whole-layer decode (`hybridllm::decode_layer`) equals the per-op path bit for bit.

Both run the same kernels in the same order; the native op (and DecodeStack, which runs every
layer's op in one call from Python) only removes Python between them, so
greedy tokens and every logprob must be identical, for single streams and batches, with qkv
biases (Qwen2), sliding windows (Mistral), Qwen3's q/k norms, MoE layers (attention native, the
expert block after it; the stack runs a block without a shared expert itself) and layers it does
not take (OLMoE's attention).
"""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as Q

from hybridllm import LLM, SamplingParams, envs
from tests.gguf_helpers import tiny_hf_model, write_gguf
from tests.kernel_helpers import require_cpu_kernels

PROMPTS = [[5, 17, 42, 99, 7, 63, 12], [3, 8], [100, 101, 102, 103]]
LINEAR_TYPES = {
    "self_attn.q_proj.weight": Q.Q4_1,
    "self_attn.k_proj.weight": Q.Q4_1,
    "self_attn.v_proj.weight": Q.Q4_1,
    "self_attn.o_proj.weight": Q.Q8_0,
    "mlp.gate_proj.weight": Q.Q8_0,
    "mlp.up_proj.weight": Q.Q8_0,
    "mlp.down_proj.weight": Q.Q4_0,
}


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    require_cpu_kernels()


# q, k and v (and gate and up) in different block types, as Q4_K_M files often have v: the
# fused projections hold a tensor of blocks a shard
MIXED_TYPES = {
    **LINEAR_TYPES,
    "self_attn.v_proj.weight": Q.Q8_0,
    "mlp.gate_proj.weight": Q.Q4_0,
}


def llama_gguf_file(directory, linear_types: dict) -> str:
    model = tiny_hf_model("llama", seed=5)
    quantize = {
        f"model.layers.{i}.{name}": qtype
        for i in range(model.config.num_hidden_layers)
        for name, qtype in linear_types.items()
    }
    return str(write_gguf(directory / "m.gguf", model, quantize=quantize))


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory):
    return llama_gguf_file(tmp_path_factory.mktemp("g"), LINEAR_TYPES)


def run(
    path: str, native: bool | None, sharded: list | None = None, **engine_kwargs
) -> tuple[list, list[bool], bool]:
    """(tokens and logprobs of each output, whether each layer took the native op, and whether
    one DecodeStack call ran them all) of an engine with `native_decode_layer=native`;
    `sharded` gets, a layer, whether its qkv and gate/up hold a tensor of blocks a shard."""
    llm = LLM(
        path,
        skip_tokenizer_init=True,
        use_tqdm=False,
        native_decode_layer=native,
        **engine_kwargs,
    )
    try:
        model = llm.llm_engine.executor.workers[0].model_runner.model
        used = [form is not None for form in model.execution.native_forms]
        if sharded is not None:
            sharded += [
                (
                    bool(layer.self_attn.qkv_proj.shard_blocks),
                    bool(layer.mlp.gate_up_proj.shard_blocks),
                )
                for layer in model.layers
            ]
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        single = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params)
        results = [
            (
                o.outputs[0].token_ids,
                [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs],
            )
            for o in outs + single
        ]
        return results, used, model.execution.stack is not None
    finally:
        llm.shutdown()


def test_gguf_llama_native_equals_per_op(llama_gguf):
    native, used, stacked = run(llama_gguf, True)
    per_op, unused, unstacked = run(llama_gguf, False)
    assert all(used) and not any(unused)
    assert stacked and not unstacked
    assert native == per_op
    assert all(len(tokens) == 16 for tokens, _ in native)


def test_the_environment_is_the_default(llama_gguf, monkeypatch):
    # HYBRIDLLM_NATIVE_DECODE_LAYER decides only where the engine is not told
    monkeypatch.setenv(envs.NATIVE_DECODE_LAYER.name, "0")
    _, unused, unstacked = run(llama_gguf, None)
    _, used, stacked = run(llama_gguf, True)
    assert not any(unused) and not unstacked
    assert all(used) and stacked


def test_mixed_block_types_native_equals_per_op(tmp_path):
    path = llama_gguf_file(tmp_path, MIXED_TYPES)
    sharded: list = []
    native, used, stacked = run(path, True, sharded)
    per_op, _, _ = run(path, False)
    assert sharded == [(True, True)] * len(used)
    assert all(used) and stacked
    assert native == per_op


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "qwen3"])
def test_fp32_folders_native_equals_per_op(arch, tmp_path):
    # fp32 linears take the native path where they are read as F32 blocks (CPUs whose BLAS
    # lacks AVX-512 kernels); elsewhere the layers keep the per-op path and this still holds
    from hybridllm.layers.gguf_linear import own_f32_gemm_preferred
    from tests.model_helpers import make_tiny_model

    path = str(make_tiny_model(arch, tmp_path / arch))  # mistral: a window of 12
    native, used, stacked = run(path, True)
    per_op, _, _ = run(path, False)
    assert native == per_op
    assert all(u == own_f32_gemm_preferred() for u in used)
    assert stacked == own_f32_gemm_preferred()


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "olmoe"])
def test_moe_layers_native_attention_equals_per_op(arch, tmp_path):
    # the op takes attention (Qwen3's q/k norms included) and returns the expert block's input;
    # OLMoE's own attention keeps the per-op path
    from hybridllm.layers.gguf_linear import own_f32_gemm_preferred
    from tests.moe_helpers import make_tiny_moe_model

    path = str(make_tiny_moe_model(arch, tmp_path / arch))
    native, used, stacked = run(path, True)
    per_op, _, _ = run(path, False)
    assert native == per_op
    # one native call a layer, the expert block after it: these experts' 40-wide down rows are
    # no whole F32 blocks for fused_moe (the GGUF test below has the stack run them)
    assert not stacked
    expected = [own_f32_gemm_preferred() and arch != "olmoe"] * len(used)
    if arch == "qwen2_moe":
        expected[1] = False  # its dense MLP is 72 wide: down_proj's rows are not whole blocks
    assert used == expected


@pytest.mark.parametrize("fmt", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda f: f.name)
def test_gguf_moe_stack_with_x8_experts_equals_per_op(fmt, tmp_path):
    # Qwen3-MoE from GGUF, K-quant experts on the int8 path: their blocks are repacked in x8
    # groups and the stack runs routing and experts; the per-layer path the same

    from hybridllm.layers.gguf_linear import (
        INT8_ACTIVATIONS,
        X8_TYPES,
        own_f32_gemm_preferred,
        x8_source_types,
    )
    from tests.moe_helpers import build_tiny_moe_model, write_moe_gguf

    model = build_tiny_moe_model(
        "qwen3_moe", hidden_size=256, moe_intermediate_size=256, intermediate_size=256
    )  # whole 256-weight super-blocks
    kinds = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
    path = str(write_moe_gguf(tmp_path / "q3.gguf", model, dict.fromkeys(kinds, fmt)))
    llm = LLM(path, skip_tokenizer_init=True, use_tqdm=False, gguf_activations="int8")
    try:
        layers = llm.llm_engine.executor.workers[0].model_runner.model.layers
        expected = X8_TYPES[int(fmt)] if int(fmt) in x8_source_types() else int(fmt)
        experts = [layer.mlp.experts for layer in layers]
        assert all(e.w13.ggml_type == expected for e in experts)
        assert (
            {e.activations for e in experts}
            == {e.w2.activations for e in experts}
            == {INT8_ACTIVATIONS}
        )
    finally:
        llm.shutdown()
    native, used, stacked = run(path, True, gguf_activations="int8")
    per_op, _, unstacked = run(path, False, gguf_activations="int8")
    assert native == per_op and not unstacked
    assert stacked == own_f32_gemm_preferred() == all(used)


def test_gguf_moe_with_an_f32_router_runs_in_the_stack(tmp_path):
    # as llama.cpp writes MoE files: every linear of blocks but the router (ffn_gate_inp, F32);
    # the native op computes the router too, so the stack runs every layer on any CPU (on
    # F.linear the expert blocks ran in Python where the native fp32 GEMM is not preferred)
    from tests.moe_helpers import build_tiny_moe_model, write_moe_gguf

    model = build_tiny_moe_model(
        "qwen3_moe", hidden_size=256, moe_intermediate_size=256, intermediate_size=256
    )
    kinds = dict.fromkeys(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), Q.Q4_K)
    kinds.update(dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output"), Q.Q8_0))
    path = str(write_moe_gguf(tmp_path / "q3.gguf", model, kinds))
    native, used, stacked = run(path, True, gguf_activations="int8")
    per_op, _, unstacked = run(path, False, gguf_activations="int8")
    assert all(used) and stacked and not unstacked
    assert native == per_op


def test_decode_stack_checks_its_inputs():
    import torch

    stack = torch.classes.hybridllm.DecodeStack()
    h = torch.zeros(1, 8)
    with pytest.raises(RuntimeError, match="0 layers but 1 KV caches"):
        stack.forward(h, None, h, h, [h], h, h, h)
    with pytest.raises(RuntimeError, match="no layers"):
        stack.forward(h, None, h, h, [], h, h, h)
    with pytest.raises(RuntimeError, match="add_moe follows the add_layer"):
        stack.add_moe(h, 0, 1, False, True, h, 0, h, 0)
    assert stack.size() == 0
