"""GGUF linears computed from their blocks (quantization="auto") match the dequantized model."""

from __future__ import annotations

import math

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from hybridllm import LLM, SamplingParams
from hybridllm.loader import default_model_path, open_model_source
from hybridllm.loader.block_sizes import gguf_block_sizes
from hybridllm.loader.gguf_dequant import dequantize
from hybridllm.loader.gguf_file import GGUFFile
from hybridllm.loader.hf_folder import HFFolderSource
from tests.gguf_helpers import tiny_hf_model, write_gguf
from tests.kernel_helpers import require_cpu_kernels


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    require_cpu_kernels()


# q and k share one type, v another: each keeps its blocks and runs on its own. gate's type
# has a kernel, up's (F16, not a block type) not: the fused gate/up matmul falls back to float
# weights.
LAYER_TYPES = {
    "self_attn.q_proj.weight": Q.Q4_1,
    "self_attn.k_proj.weight": Q.Q4_1,
    "self_attn.v_proj.weight": Q.Q8_0,
    "self_attn.o_proj.weight": Q.Q4_0,
    "mlp.gate_proj.weight": Q.Q4_1,
    "mlp.up_proj.weight": Q.F16,
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


PROMPTS = [[5, 17, 42, 99, 7, 63, 12], [3, 8]]
MAX_TOKENS = 24
TOP_LOGPROBS = 3


def _generate(llm: LLM) -> list:
    params = SamplingParams(
        temperature=0,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        logprobs=TOP_LOGPROBS,
        prompt_logprobs=TOP_LOGPROBS,
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    # Every list the comparisons walk is complete: nothing passes by being short or empty.
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    for out in outputs:
        completion = out.outputs[0]
        assert len(completion.token_ids) == len(completion.logprobs) == MAX_TOKENS
        assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
        assert out.prompt_logprobs[0] is None  # the first prompt token has no context
    return outputs


def _assert_close_top_logprobs(a: dict, b: dict, chosen: int, tolerance: float) -> None:
    """One position's top-k dicts agree: the same size, the chosen token in both, and every
    token in both within `tolerance`. A token in one top-k only is allowed solely as a near-tie
    at the cut: no higher than the other dict's lowest entry plus `tolerance` (were it higher,
    it would rank inside the other's top-k too)."""
    assert a and len(a) == len(b), (a, b)
    assert chosen in a and chosen in b
    for token in a.keys() & b.keys():
        assert abs(a[token].logprob - b[token].logprob) < tolerance, (token, a, b)
    for token in a.keys() ^ b.keys():
        ours, other = (a, b) if token in a else (b, a)
        assert ours[token].logprob <= min(x.logprob for x in other.values()) + tolerance, (a, b)


def _assert_same_prompt_logprobs(ours, ref, tolerance: float) -> None:
    assert len(ours.prompt_logprobs) == len(ref.prompt_logprobs) == len(ref.prompt_token_ids)
    positions = zip(ours.prompt_logprobs[1:], ref.prompt_logprobs[1:], ref.prompt_token_ids[1:])
    for a, b, prompt_token in positions:
        _assert_close_top_logprobs(a, b, prompt_token, tolerance)


def _assert_same_generation(ours: list, ref: list, prompt_logprobs: bool = False) -> None:
    """The same tokens, and logprobs (and prompt logprobs) equal up to float rounding."""
    assert len(ours) == len(ref) == len(PROMPTS)
    for a_out, b_out in zip(ours, ref):
        a, b = a_out.outputs[0], b_out.outputs[0]
        assert len(a.token_ids) == MAX_TOKENS and a.token_ids == b.token_ids
        assert len(a.logprobs) == len(b.logprobs) == MAX_TOKENS
        for a_top, b_top, token in zip(a.logprobs, b.logprobs, a.token_ids):
            _assert_close_top_logprobs(a_top, b_top, token, 1e-4)
        if prompt_logprobs:
            _assert_same_prompt_logprobs(a_out, b_out, 1e-4)


def test_blocks_kept_where_a_kernel_reads_them(gguf_path):
    llm = LLM(str(gguf_path), dtype="float32", use_tqdm=False, max_model_len=128)
    try:
        model = llm.llm_engine.executor.workers[0].model_runner.model
        layer = model.layers[0]
        qkv = layer.self_attn.qkv_proj  # q/k Q4_1 beside v Q8_0: a shard's blocks each
        assert qkv.qweight is None and qkv.weight.numel() == 0
        types = [(t, rows) for _, t, rows in qkv.shard_blocks]
        assert types == list(zip((Q.Q4_1, Q.Q4_1, Q.Q8_0), qkv.output_sizes))
        gate_up = layer.mlp.gate_up_proj  # Q4_1 beside F16: each computed from its own bytes
        assert gate_up.qweight is None and gate_up.weight.numel() == 0
        types = [(t, rows) for _, t, rows in gate_up.shard_blocks]
        assert types == list(zip((Q.Q4_1, Q.F16), gate_up.output_sizes))
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
    # bf16 activations: the prompt logprobs close, not equal (the generated tokens may part)
    assert len(results["bfloat16"]) == len(results["float32"]) == len(PROMPTS)
    for ours, ref in zip(results["bfloat16"], results["float32"]):
        _assert_same_prompt_logprobs(ours, ref, 0.1)


def test_planner_counts_the_blocks_a_cpu_worker_keeps(gguf_path):
    source = open_model_source(str(gguf_path))
    layers = source.hf_config.num_hidden_layers
    blocks = gguf_block_sizes(source, layers)
    infos = source.tensor_infos()
    kinds = {n: n.split(".")[2] for n in infos if n.startswith("blk.")}
    # every linear kept: q/k/v (each its own type), o (Q4_0), down (Q8_0), gate/up (one F16:
    # computed from its own two bytes a weight, not inflated to fp32)
    kept_kinds = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_down", "ffn_gate", "ffn_up")
    kept = every = [n for n, k in kinds.items() if k in kept_kinds]
    assert any(infos[n].ggml_type == Q.F16 for n in kept)
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
    from tests.gguf_helpers import write_k_m_like_gguf

    path = write_k_m_like_gguf(tmp_path / "q4_k.gguf", base)
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


def test_q5_linears_computed_from_their_blocks(tmp_path):
    # The 32-weight Q5_0 / Q5_1 blocks a K-quant file falls back to where rows are not whole
    # super-blocks (IQ4_NL, the third such type, gguf cannot quantize: its kernels' tests use
    # random blocks) give the tokens and logprobs of the same file dequantized at load.
    from tests.gguf_helpers import tiny_hf_model, write_gguf

    types = {
        "self_attn.q_proj.weight": Q.Q5_0,
        "self_attn.k_proj.weight": Q.Q5_0,
        "self_attn.v_proj.weight": Q.Q5_1,
        "self_attn.o_proj.weight": Q.Q5_1,
        "mlp.gate_proj.weight": Q.Q5_0,
        "mlp.up_proj.weight": Q.Q5_0,
        "mlp.down_proj.weight": Q.Q5_1,
    }
    model = tiny_hf_model("llama", tie_word_embeddings=True)
    quantize = {"model.embed_tokens.weight": Q.Q8_0}
    for i in range(model.config.num_hidden_layers):
        quantize.update({f"model.layers.{i}.{k}": v for k, v in types.items()})
    path = write_gguf(tmp_path / "q5.gguf", model, quantize=quantize)
    results = {}
    for quantization in ("auto", "none"):
        llm = LLM(
            str(path), dtype="float32", quantization=quantization, use_tqdm=False, max_model_len=128
        )
        try:
            layer = llm.llm_engine.executor.workers[0].model_runner.model.layers[0]
            if quantization == "auto":
                assert layer.mlp.gate_up_proj.ggml_type == Q.Q5_0
                assert layer.mlp.down_proj.ggml_type == Q.Q5_1
                assert layer.self_attn.o_proj.ggml_type == Q.Q5_1
                qkv_types = [t for _, t, _ in layer.self_attn.qkv_proj.shard_blocks]
                assert qkv_types == [Q.Q5_0, Q.Q5_0, Q.Q5_1]
            results[quantization] = _generate(llm)
        finally:
            llm.shutdown()
    _assert_same_generation(results["auto"], results["none"], prompt_logprobs=True)
