"""GGUF linears computed from their blocks (quantization="auto") match the dequantized model."""

from __future__ import annotations

import math

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from hybridllm import LLM, SamplingParams
from hybridllm.layers.cpu_kernels import load_cpu_kernels
from hybridllm.layers.gguf_linear import gguf_block_sizes
from hybridllm.loader import default_model_path, open_model_source
from hybridllm.loader.gguf_dequant import dequantize
from hybridllm.loader.gguf_file import GGUFFile
from hybridllm.loader.hf_folder import HFFolderSource
from tests.gguf_helpers import tiny_hf_model, write_gguf

pytestmark = pytest.mark.skipif(not load_cpu_kernels(), reason="native CPU kernels unavailable")

# q and k share one type, v another: each keeps its blocks and runs on its own. gate's type
# has a kernel, up's (Q5_0) not: the fused gate/up matmul falls back to float weights.
LAYER_TYPES = {
    "self_attn.q_proj.weight": Q.Q4_1,
    "self_attn.k_proj.weight": Q.Q4_1,
    "self_attn.v_proj.weight": Q.Q8_0,
    "self_attn.o_proj.weight": Q.Q4_0,
    "mlp.gate_proj.weight": Q.Q4_1,
    "mlp.up_proj.weight": Q.Q5_0,
    "mlp.down_proj.weight": Q.Q8_0,
}


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def gguf_path(request, tmp_path_factory):
    tied = request.param
    model = tiny_hf_model("llama", tie_word_embeddings=tied)
    quantize = {"model.embed_tokens.weight": Q.Q8_0}
    if not tied:
        quantize["lm_head.weight"] = Q.Q4_1
    for i in range(model.config.num_hidden_layers):
        quantize.update({f"model.layers.{i}.{k}": v for k, v in LAYER_TYPES.items()})
    return write_gguf(tmp_path_factory.mktemp("gguf") / "q.gguf", model, quantize=quantize)


def _generate(llm: LLM) -> list:
    prompts = [{"prompt_token_ids": [5, 17, 42, 99, 7, 63, 12]}, {"prompt_token_ids": [3, 8]}]
    params = SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, logprobs=3, prompt_logprobs=3
    )
    return llm.generate(prompts, params)


def _assert_same_generation(ours: list, ref: list, prompt_logprobs: bool = False) -> None:
    """The same tokens, and logprobs (and prompt logprobs) equal up to float rounding."""
    for a_out, b_out in zip(ours, ref):
        assert a_out.outputs[0].token_ids == b_out.outputs[0].token_ids
        pairs = list(zip(a_out.outputs[0].logprobs, b_out.outputs[0].logprobs))
        if prompt_logprobs:
            pairs += list(zip(a_out.prompt_logprobs[1:], b_out.prompt_logprobs[1:]))
        for a, b in pairs:
            for tid in a.keys() & b.keys():
                assert abs(a[tid].logprob - b[tid].logprob) < 1e-4


def test_blocks_kept_where_a_kernel_reads_them(gguf_path):
    llm = LLM(str(gguf_path), dtype="float32", use_tqdm=False, max_model_len=128)
    try:
        model = llm.llm_engine.executor.workers[0].model_runner.model
        layer = model.layers[0]
        qkv = layer.self_attn.qkv_proj  # q/k Q4_1 beside v Q8_0: a shard's blocks each
        assert qkv.qweight is None and qkv.weight.numel() == 0
        types = [(t, rows) for _, t, rows in qkv.shard_blocks]
        assert types == list(zip((Q.Q4_1, Q.Q4_1, Q.Q8_0), qkv.output_sizes))
        gate_up = layer.mlp.gate_up_proj  # Q4_1 beside Q5_0: decoded to floats
        assert gate_up.weight.dtype == torch.float32 and gate_up.weight.numel() > 0
        assert gate_up.ggml_type in (-1, Q.F32)  # F32: the native op on floats (non-Intel CPUs)
        assert layer.self_attn.o_proj.ggml_type == Q.Q4_0
        assert layer.mlp.down_proj.ggml_type == Q.Q8_0
        assert model.lm_head.qweight is not None
        # the embedding looks its rows up in its Q8_0 blocks (a tied head's own) and holds no
        # float table; every row decodes to the table dequantized at load
        embedding = model.embed_tokens
        assert embedding.ggml_type == Q.Q8_0 and embedding.weight.numel() == 0
        tied = model.lm_head.tied
        assert (embedding.qweight is model.lm_head.qweight) == tied
        gguf = GGUFFile(str(gguf_path))
        info = gguf.tensors["token_embd.weight"]
        table = dequantize(gguf.raw_rows(info), info.ggml_type, info.shape)
        ids = torch.arange(table.shape[0]).flip(0)
        assert torch.equal(embedding(ids), table[ids])
    finally:
        llm.shutdown()


def test_same_tokens_and_logprobs_as_dequantized(gguf_path):
    results = {}
    for quantization in ("auto", "none"):
        llm = LLM(
            str(gguf_path),
            dtype="float32",
            quantization=quantization,
            use_tqdm=False,
            max_model_len=128,
        )
        try:
            results[quantization] = _generate(llm)
        finally:
            llm.shutdown()
    _assert_same_generation(results["auto"], results["none"], prompt_logprobs=True)


def test_bad_quantization_value_is_named():
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(quantization="int3", use_tqdm=False)


def test_bf16_cpu_worker_reads_blocks_too(gguf_path):
    # A bf16 CPU stage (as in a GPU+CPU run) keeps the blocks; the op computes in fp32.
    results = {}
    for dtype in ("bfloat16", "float32"):
        llm = LLM(str(gguf_path), dtype=dtype, use_tqdm=False, max_model_len=128)
        try:
            model = llm.llm_engine.executor.workers[0].model_runner.model
            layer = model.layers[0]
            assert layer.self_attn.o_proj.ggml_type == Q.Q4_0
            assert len(layer.self_attn.qkv_proj.shard_blocks) == 3  # not packed for oneDNN
            results[dtype] = _generate(llm)
        finally:
            llm.shutdown()
    for ours, ref in zip(results["bfloat16"], results["float32"]):
        assert len(ours.outputs[0].token_ids) == 24
        for a, b in zip(ours.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
            for tid in a.keys() & b.keys():  # bf16 activations: close, not equal
                assert abs(a[tid].logprob - b[tid].logprob) < 0.1


def test_planner_counts_the_blocks_a_cpu_worker_keeps(gguf_path):
    source = open_model_source(str(gguf_path))
    layers = source.hf_config.num_hidden_layers
    blocks = gguf_block_sizes(source, layers)
    infos = source.tensor_infos()
    kinds = {n: n.split(".")[2] for n in infos if n.startswith("blk.")}
    # kept: q/k/v (each its own type), o (Q4_0), down (Q8_0); gate/up (one Q5_0) dequantized
    kept_kinds = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_down")
    kept = [n for n, k in kinds.items() if k in kept_kinds]
    every = kept + [n for n, k in kinds.items() if k in ("ffn_gate", "ffn_up")]
    assert blocks.kept_bytes == sum(infos[n].nbytes for n in kept)
    assert blocks.total_params == sum(math.prod(infos[n].shape) for n in every)
    head = infos.get("output.weight") or infos["token_embd.weight"]
    assert blocks.lm_head_bytes == head.nbytes


def test_planner_block_sizes_of_the_embedded_model():
    source = open_model_source(default_model_path())
    blocks = gguf_block_sizes(source, source.hf_config.num_hidden_layers)
    assert blocks.kept_params == blocks.total_params  # every linear is Q4_1
    assert blocks.kept_bytes * 32 == blocks.total_params * 20
    assert blocks.lm_head_bytes == 49152 * 576 // 32 * 34  # the tied Q8_0 embedding
    assert gguf_block_sizes(HFFolderSource.__new__(HFFolderSource), 30) is None  # no blocks


def test_tensor_parallel_cpu_ranks_compute_from_blocks(gguf_path):
    # Two CPU ranks (`mp`) keep their slices of the blocks: the single worker's generation.
    results = {}
    for tp in (1, 2):
        llm = LLM(
            str(gguf_path),
            dtype="float32",
            tensor_parallel_size=tp,
            distributed_executor_backend="mp" if tp > 1 else "uni",
            use_tqdm=False,
            max_model_len=128,
        )
        try:
            results[tp] = _generate(llm)
        finally:
            llm.shutdown()
    _assert_same_generation(results[2], results[1])


@pytest.mark.parametrize("base", [Q.Q4_K, Q.Q5_K], ids=lambda t: t.name)
def test_k_quant_linears_computed_from_their_super_blocks(tmp_path, base):
    # A model whose linears are Q4_K (Q5_K), and v and down Q6_K as in a Q4_K_M (Q5_K_M) file
    # (random super-blocks: gguf cannot quantize to K-quants), gives the tokens and logprobs of
    # the same file dequantized at load.
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.gguf_helpers import tokenizer_vocab

    vocab = len(tokenizer_vocab())
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=vocab - 2, eos_token_id=vocab - 1, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    quantize = {
        name: Q.Q6_K if name.endswith(("v_proj.weight", "down_proj.weight")) else base
        for name in model.state_dict()
        if name.endswith("proj.weight")  # every q/k/v/o and gate/up/down
    }
    path = write_gguf(tmp_path / "q4_k.gguf", model, quantize=quantize)
    results = {}
    for quantization in ("auto", "none"):
        llm = LLM(
            str(path), dtype="float32", quantization=quantization, use_tqdm=False, max_model_len=128
        )
        try:
            layer = llm.llm_engine.executor.workers[0].model_runner.model.layers[0]
            qkv_types = [t for _, t, _ in layer.self_attn.qkv_proj.shard_blocks]
            if quantization == "auto":
                assert layer.mlp.gate_up_proj.ggml_type == base
                assert layer.mlp.down_proj.ggml_type == Q.Q6_K
                assert qkv_types == [base, base, Q.Q6_K]
            else:
                # floats (on a non-Intel CPU through the op as type F32)
                assert layer.mlp.down_proj.ggml_type in (-1, Q.F32) and not qkv_types
            results[quantization] = _generate(llm)
        finally:
            llm.shutdown()
    _assert_same_generation(results["auto"], results["none"])
