"""Tensor-parallel models across spawned CPU ranks give the single-worker model's logits."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from hybridllm.distributed.parallel_groups import destroy_groups, init_tp_group
from hybridllm.layers.gguf_linear import gguf_kernel_types
from hybridllm.layers.linear import cpu_bf16_packing_supported
from hybridllm.layers.tensor_parallel import HeadShard, shard_align, split_attention_heads
from hybridllm.loader import open_model_source
from hybridllm.models.registry import get_model_class
from hybridllm.plan.plan import Plan
from tests.dist_pool import RankPool
from tests.gguf_helpers import tiny_hf_model, write_gguf
from tests.kernel_helpers import require_cpu_kernels
from tests.model_helpers import (
    StepSequence,
    allocate_kv_caches,
    build_tiny_hf_model,
    load_our_model,
    make_step,
    scattered_block_tables,
)

NUM_BLOCKS, BLOCK_SIZE = 32, 4
ATOL = 1e-4


def _steps(vocab: int = 320) -> list[list[StepSequence]]:
    """Two prompts prefilled together, then three steps decoding both (fixed next tokens)."""
    tables = scattered_block_tables(2, 6, NUM_BLOCKS, seed=3)
    gen = torch.Generator().manual_seed(11)
    a, b = (torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (13, 7))
    steps = [[StepSequence(a, 0, tables[0]), StepSequence(b, 0, tables[1])]]
    for i in range(3):
        steps.append(
            [
                StepSequence([5 + i], len(a) + i, tables[0]),
                StepSequence([40 + i], len(b) + i, tables[1]),
            ]
        )
    return steps


def _run_steps(model, vocab: int = 320) -> list[np.ndarray]:
    caches = allocate_kv_caches(model, NUM_BLOCKS, BLOCK_SIZE)
    out = []
    for seqs in _steps(vocab):
        input_ids, positions, meta = make_step(seqs, BLOCK_SIZE)
        with torch.inference_mode():
            out.append(model.compute_logits(model(input_ids, positions, caches, meta)).numpy())
    return out


def _plan(weights: tuple[float, ...]) -> Plan:
    plan = Plan.uniform([["cpu"] * len(weights)], num_layers=1)
    stage = dataclasses.replace(plan.stages[0], tp_weights=weights)
    return dataclasses.replace(plan, stages=(stage,))


def _case_tp_models(rank, init_method, weights, models, dtype):
    """models: (arch, HF config, HF state dict as numpy); the parent built them, so ranks
    need not import the HF modeling code (seconds per process on the CI machine)."""
    tp = init_tp_group(_plan(weights), rank, init_method, torch.device("cpu"))
    results = {}
    for arch, config, state in models:
        model = get_model_class(config.architectures[0])(
            config, dtype, torch.device("cpu"), tp_group=tp
        )
        # full HF tensors in: each rank keeps its slice
        loaded = model.load_weights(
            (n, torch.from_numpy(t)) for n, t in state.items() if model.owns_weight(n)
        )
        missing = model.expected_weight_names() - loaded
        assert not missing, sorted(missing)
        model.process_weights_after_loading()
        shape = model.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE)
        results[arch] = (shape, _run_steps(model))
    tp.close()
    destroy_groups()
    return results


def _load_gguf(path: str, tp_group=None):
    """Our model of a GGUF file as a CPU worker loads it: blocks kept where the op reads them."""
    source = open_model_source(path)
    config = source.hf_config
    extra = {} if tp_group is None else {"tp_group": tp_group}
    cpu = torch.device("cpu")
    model = get_model_class(config.architectures[0])(config, torch.float32, cpu, **extra)
    loaded = model.load_weights(
        source.iter_weights(model.owns_weight, gguf_kernel_types(cpu, True))
    )
    assert not model.expected_weight_names() - loaded
    model.process_weights_after_loading()
    return model


def _case_tp_gguf(rank, init_method, weights, path):
    """Each rank keeps its slices of the file's blocks: the types it holds, and its logits."""
    tp = init_tp_group(_plan(weights), rank, init_method, torch.device("cpu"))
    model = _load_gguf(path, tp)
    layer = model.layers[0]
    linears = {
        "qkv": layer.self_attn.qkv_proj,
        "o": layer.self_attn.o_proj,
        "gate_up": layer.mlp.gate_up_proj,
        "down": layer.mlp.down_proj,
        "lm_head": model.lm_head,
        "embedding": model.embed_tokens,
    }
    kept = {name: (None if m.qweight is None else int(m.ggml_type)) for name, m in linears.items()}
    logits = _run_steps(model, model.hf_config.vocab_size)
    tp.close()
    destroy_groups()
    return kept, logits


def _tiny_models(archs):
    """arch -> HF model, and what the ranks need to build ours from it."""
    hf = {arch: build_tiny_hf_model(arch) for arch in archs}
    for model in hf.values():
        model.config.architectures = [type(model).__name__]
    shipped = [
        (arch, m.config, {n: t.numpy() for n, t in m.state_dict().items()})
        for arch, m in hf.items()
    ]
    return hf, shipped


@pytest.fixture(scope="module")
def pool():
    pool = RankPool(3)
    pool.pids()  # start the processes now: they import torch while the parent builds models
    yield pool
    pool.close(graceful=False)


def _check_against_single_worker(results, hf_models, kv_heads_per_rank):
    for arch, hf in hf_models.items():
        expected = _run_steps(load_our_model(hf))
        for rank, per_arch in enumerate(results):
            shape, logits = per_arch[arch]
            assert shape[3] == kv_heads_per_rank[arch][rank], (arch, rank, shape)
            for step, (got, want) in enumerate(zip(logits, expected)):
                assert got.shape == want.shape  # full vocabulary rows on every rank
                err = float(np.abs(got - want).max())
                assert err <= ATOL, f"{arch} rank {rank} step {step}: max error {err}"


def test_tp2_equal_shards(pool):
    # llama3, qwen3: 2 KV heads, one per rank, LM head tied to the vocab-parallel embedding
    # (qwen3: q/k norms); mistral: 1 KV head, replicated, sliding window; opt_post_ln: MHA,
    # biases, replicated project_in/out (llama, qwen2 and opt run in the TP=3 test)
    archs = ("llama3", "mistral", "qwen3", "opt_post_ln")
    hf, shipped = _tiny_models(archs)
    results = pool.run(_case_tp_models, 2, (1.0, 1.0), shipped, torch.float32)
    kv = {"llama3": (1, 1), "mistral": (1, 1), "qwen3": (1, 1), "opt_post_ln": (2, 2)}
    _check_against_single_worker(results, hf, kv)


def test_tp3_unequal_shards(pool):
    # weights (2, 1, 1): rank 0 takes half of every split dimension. llama and qwen2 have 2
    # KV heads for 3 ranks: rank 0 holds KV head 0, ranks 1 and 2 each replicate KV head 1.
    archs = ("llama", "qwen2", "opt")
    hf, shipped = _tiny_models(archs)
    results = pool.run(_case_tp_models, 3, (2.0, 1.0, 1.0), shipped, torch.float32)
    kv = {"llama": (1, 1, 1), "qwen2": (1, 1, 1), "opt": (2, 1, 1)}
    _check_against_single_worker(results, hf, kv)


@pytest.mark.skipif(not cpu_bf16_packing_supported(), reason="no oneDNN bf16 on this CPU")
def test_tp2_bf16_packed_linears(pool):
    """bf16 on CPU repacks the sharded linears and LM head for oneDNN: still the same model."""
    hf, shipped = _tiny_models(("qwen2",))
    results = pool.run(_case_tp_models, 2, (1.0, 1.0), shipped, torch.bfloat16)
    single = load_our_model(hf["qwen2"], dtype=torch.bfloat16)
    single.process_weights_after_loading()
    expected = _run_steps(single)
    for per_arch in results:
        for got, want in zip(per_arch["qwen2"][1], expected):
            assert np.abs(got - want).max() < 0.03 * np.abs(want).max()
    np.testing.assert_array_equal(results[0]["qwen2"][1][0], results[1]["qwen2"][1][0])


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def gguf_path(request, tmp_path_factory):
    model = tiny_hf_model("llama", tie_word_embeddings=request.param)
    quantize = {"model.embed_tokens.weight": Q.Q8_0, "lm_head.weight": Q.Q4_1}
    for i in range(model.config.num_hidden_layers):
        for proj, kind in (("q", Q.Q4_1), ("k", Q.Q4_1), ("v", Q.Q4_1), ("o", Q.Q4_0)):
            quantize[f"model.layers.{i}.self_attn.{proj}_proj.weight"] = kind
        for proj in ("gate", "up", "down"):
            quantize[f"model.layers.{i}.mlp.{proj}_proj.weight"] = Q.Q8_0
    return str(write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", model, quantize=quantize))


def test_tp2_ranks_keep_their_gguf_blocks(pool, gguf_path):
    """CPU ranks compute from their slices of the file's blocks, as a single worker does.

    Column-parallel rows and vocabulary rows are whole block rows; a row-parallel slice is
    kept where it falls on 32-column block boundaries (o: 32 of 64 columns a rank) and
    decoded to floats where it does not (down: 48 of 96).
    """
    require_cpu_kernels()
    single = _load_gguf(gguf_path)
    expected = _run_steps(single, single.hf_config.vocab_size)
    results = pool.run(_case_tp_gguf, 2, (1.0, 1.0), gguf_path)
    for kept, logits in results:
        assert kept == {
            "qkv": Q.Q4_1, "o": Q.Q4_0, "gate_up": Q.Q8_0, "down": None,
            "lm_head": Q.Q8_0 if single.lm_head.tied else Q.Q4_1, "embedding": Q.Q8_0,
        }  # fmt: skip
        for step, (got, want) in enumerate(zip(logits, expected)):
            err = float(np.abs(got - want).max())
            assert err <= ATOL, f"step {step}: max error {err}"


def test_split_attention_heads():
    # enough KV heads: whole KV groups per rank, proportional to the weights
    assert split_attention_heads(32, 8, (3.0, 1.0)) == [
        HeadShard(0, 24, 0, 6),
        HeadShard(24, 32, 6, 8),
    ]
    assert [s.num_kv_heads for s in split_attention_heads(32, 8, (1.0,) * 3)] == [3, 3, 2]
    # fewer KV heads than ranks: each rank replicates the one KV head its queries use
    assert split_attention_heads(4, 2, (2.0, 1.0, 1.0)) == [
        HeadShard(0, 2, 0, 1),
        HeadShard(2, 3, 1, 2),
        HeadShard(3, 4, 1, 2),
    ]
    assert split_attention_heads(4, 1, (1.0, 1.0)) == [HeadShard(0, 2, 0, 1), HeadShard(2, 4, 0, 1)]
    # every KV head gets a rank even when the weights are lopsided
    shards = split_attention_heads(12, 3, (100.0, 1.0, 1.0, 1.0))
    assert sorted({s.kv_start for s in shards}) == [0, 1, 2]
    assert sum(s.num_heads for s in shards) == 12
    with pytest.raises(ValueError, match="KV head 0 would serve 3 ranks"):
        split_attention_heads(2, 1, (1.0, 1.0, 1.0))
    with pytest.raises(ValueError, match="not a multiple"):
        split_attention_heads(6, 4, (1.0, 1.0))


def test_shard_align():
    assert shard_align(14336, 2) == 64
    assert shard_align(128, 3) == 8
    assert shard_align(321, 2) == 1
