"""A GGUF MoE file's quantized experts, computed from their blocks, equal the file dequantized at load."""

from __future__ import annotations

import math

import pytest
from gguf import GGMLQuantizationType as Q

from hybridllm import LLM, SamplingParams
from hybridllm.loader import open_model_source
from hybridllm.loader.block_sizes import gguf_block_sizes
from tests.kernel_helpers import require_cpu_kernels
from tests.moe_helpers import build_tiny_moe_model, write_moe_gguf

DENSE_KINDS = ("ffn_gate", "ffn_up", "ffn_down")
MOE_KINDS = DENSE_KINDS + tuple(
    f"{k}_{s}" for s in ("exps", "shexp") for k in ("ffn_gate", "ffn_up", "ffn_down")
)
PROMPTS = [[5, 17, 42, 99, 7, 63, 12, 8, 150, 33, 21, 9, 77, 4, 19, 250, 61, 3], [3, 8]]
MAX_TOKENS = 16
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)

CASES = {
    # Q4_K_M-like: K-quant gate/up, Q6_K down (random blocks), a Q8_0 shared expert, and a
    # dense layer (layer 1 has no router: mlp_only_layers)
    "qwen2_moe-q4_k": (
        "qwen2_moe",
        dict(hidden_size=256, head_dim=64, intermediate_size=256, moe_intermediate_size=256,
             shared_expert_intermediate_size=256),
        {"ffn_gate_exps": Q.Q4_K, "ffn_up_exps": Q.Q4_K, "ffn_down_exps": Q.Q6_K,
         "ffn_gate_shexp": Q.Q8_0, "ffn_up_shexp": Q.Q8_0, "ffn_down_shexp": Q.Q8_0,
         "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_1, "ffn_down": Q.Q4_1},
    ),
    # Mixtral (a `llama` file with experts): Q8_0 gate/up, Q4_0 down, Q5_K nowhere near
    "mixtral-q8_0": (
        "mixtral",
        dict(intermediate_size=64),
        {"ffn_gate_exps": Q.Q8_0, "ffn_up_exps": Q.Q8_0, "ffn_down_exps": Q.Q4_0,
         "attn_q": Q.Q8_0, "attn_k": Q.Q8_0, "attn_v": Q.Q8_0},
    ),
}  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    require_cpu_kernels()


def _generate(path: str, quantization: str):
    llm = LLM(
        path,
        dtype="float32",
        quantization=quantization,
        skip_tokenizer_init=True,
        max_model_len=128,
        kv_cache_memory="16MiB",
        use_tqdm=False,
    )
    try:
        layers = llm.llm_engine.executor.workers[0].model_runner.model.layers
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
        return layers, [o.outputs[0] for o in outs]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("case", CASES)
def test_quantized_experts_equal_their_dequantized_self(case, tmp_path):
    arch, overrides, quantize = CASES[case]
    model = build_tiny_moe_model(arch, **overrides)
    path = str(write_moe_gguf(tmp_path / f"{case}.gguf", model, quantize=quantize))
    layers, auto = _generate(path, "auto")
    experts = layers[0].mlp.experts
    assert experts.w13.ggml_type == quantize["ffn_gate_exps"]
    assert experts.w2.ggml_type == quantize["ffn_down_exps"]
    assert experts.w13.weight.numel() == 0  # no float copy held beside the blocks
    if arch == "qwen2_moe":
        assert layers[0].mlp.shared_expert.down_proj.ggml_type == Q.Q8_0
        assert layers[1].mlp.down_proj.ggml_type == Q.Q4_1  # the dense layer
    layers, none = _generate(path, "none")
    assert layers[0].mlp.experts.w13.qweight is None or layers[0].mlp.experts.w13.ggml_type == Q.F32
    for a, b in zip(auto, none):
        assert len(a.token_ids) == MAX_TOKENS and a.token_ids == b.token_ids
        for a_top, b_top in zip(a.logprobs, b.logprobs):
            assert a_top.keys() == b_top.keys()
            for token in a_top:
                assert abs(a_top[token].logprob - b_top[token].logprob) < 1e-3


def test_planner_counts_the_expert_blocks_a_cpu_worker_keeps(tmp_path):
    # routed and shared experts are sized as blocks (a Q4_K_M MoE file was sized as fp32, 3-7x
    # its RAM); an expert stack whose gate and up differ in type is dequantized at load
    arch, overrides, quantize = CASES["qwen2_moe-q4_k"]
    mixed = dict(quantize, ffn_up_exps=Q.Q5_K)  # gate Q4_K, up Q5_K: decoded to floats
    for types, kept_kinds in (
        (quantize, {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"}),
        (mixed, {"ffn_down_exps"}),
    ):
        model = build_tiny_moe_model(arch, **overrides)
        path = write_moe_gguf(tmp_path / f"{len(kept_kinds)}.gguf", model, quantize=types)
        source = open_model_source(str(path))
        blocks = gguf_block_sizes(source, source.hf_config.num_hidden_layers)
        assert blocks is not None
        infos = source.tensor_infos()
        kinds = {n: n.split(".")[2] for n in infos if n.startswith("blk.") and n.endswith("weight")}
        matmuls = {k for k in kinds.values() if k.startswith(("attn_q", "attn_k", "attn_v"))}
        matmuls |= {"attn_output"} | set(MOE_KINDS)
        kept_kinds = kept_kinds | {k for k in MOE_KINDS if "shexp" in k or k in DENSE_KINDS}
        every = [n for n, k in kinds.items() if k in matmuls]
        kept = [n for n in every if kinds[n] in kept_kinds]
        assert blocks.total_params == sum(math.prod(infos[n].shape) for n in every)
        assert blocks.kept_bytes == sum(infos[n].nbytes for n in kept)
        assert blocks.kept_params == sum(math.prod(infos[n].shape) for n in kept)
