"""The MoE routing, grouping and expert op against a naive per-token loop; experts from GGUF blocks."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from hybridllm.layers.expert_weights import StackedExpertWeight
from hybridllm.layers.fused_moe import FusedMoE
from hybridllm.layers.moe_routing import group_by_expert, select_experts
from hybridllm.loader.quantized_tensor import QuantizedTensor
from tests.gguf_helpers import random_k_quant_blocks
from tests.kernel_helpers import require_cpu_kernels

CPU = torch.device("cpu")


def naive_routing(logits, top_k, scoring, renormalize):
    """One token at a time: scores, the k best (ties to the lower id), optional renormalisation."""
    weights, ids = [], []
    for row in logits.double():
        scores = torch.softmax(row, -1) if scoring == "softmax" else torch.sigmoid(row)
        best = sorted(range(len(row)), key=lambda e: (-scores[e].item(), e))[:top_k]
        w = torch.stack([scores[e] for e in best])
        weights.append(w / w.sum() if renormalize else w)
        ids.append(best)
    return torch.stack(weights).float(), torch.tensor(ids)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("top_k", [1, 3, 7])
def test_select_experts_matches_a_naive_loop(scoring, renormalize, top_k):
    logits = torch.randn(11, 7, generator=torch.Generator().manual_seed(top_k))
    weights, ids = select_experts(logits, top_k, scoring, renormalize)
    want_w, want_ids = naive_routing(logits, top_k, scoring, renormalize)
    assert weights.dtype == torch.float32 and ids.tolist() == want_ids.tolist()
    torch.testing.assert_close(weights, want_w, atol=1e-6, rtol=1e-6)
    # bf16 logits route in fp32 too
    assert select_experts(logits.bfloat16(), top_k, scoring)[0].dtype == torch.float32


def test_select_experts_rejects_bad_arguments():
    with pytest.raises(ValueError, match="scoring"):
        select_experts(torch.zeros(2, 4), 2, "relu")
    with pytest.raises(ValueError, match="top_k 5"):
        select_experts(torch.zeros(2, 4), 5)


def test_group_by_expert_runs_and_inverse():
    ids = torch.tensor([[4, 0], [0, 2], [4, 1], [2, 0]])  # 4 tokens, top-2, 6 experts
    groups = group_by_expert(ids, 6)
    assert groups.counts == [3, 1, 2, 0, 2, 0] and groups.active == [0, 1, 2, 4]
    assert groups.offsets == [0, 3, 4, 6, 6, 8, 8]
    flat = ids.reshape(-1)
    for e in range(6):
        pairs = groups.order[groups.offsets[e] : groups.offsets[e + 1]]
        assert (flat[pairs] == e).all()
        # tokens of one expert in order (stable)
        assert groups.token_ids[groups.offsets[e] : groups.offsets[e + 1]].tolist() == sorted(
            (pairs // 2).tolist()
        )
    assert torch.equal(groups.order[groups.inverse], torch.arange(8))


def naive_moe(x, w13, w2, weights, ids):
    """Token by token, slot by slot: the definition of the MoE output."""
    out = torch.zeros_like(x)
    inter = w2.shape[-1]
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = ids[t, slot]
            gate_up = w13[e] @ x[t]
            act = F.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += weights[t, slot] * (w2[e] @ act)
    return out


def make_moe(num_experts, top_k, hidden, inter, renormalize=True, scoring="softmax", seed=0):
    g = torch.Generator().manual_seed(seed)
    moe = FusedMoE(num_experts, top_k, hidden, inter, renormalize, torch.float32, CPU, scoring)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    moe.w13.load(w13, "w13")
    moe.w2.load(w2, "w2")
    return moe, w13, w2


@pytest.mark.parametrize("num_tokens", [1, 5, 40])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_fused_moe_matches_a_naive_loop(num_tokens, scoring):
    moe, w13, w2 = make_moe(7, 3, 48, 20, renormalize=scoring == "softmax", scoring=scoring)
    g = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, 48, generator=g)
    logits = torch.randn(num_tokens, 7, generator=g)
    weights, ids = select_experts(logits, 3, scoring, scoring == "softmax")
    want = naive_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(moe(x, logits), want, atol=1e-5, rtol=1e-5)
    # the compiled SiLU-and-mul gives the same
    from hybridllm.layers.cpu_kernels import load_cpu_kernels

    if load_cpu_kernels():
        moe.use_native_op()
        torch.testing.assert_close(moe(x, logits), want, atol=1e-5, rtol=1e-5)


def test_fused_moe_reads_only_the_selected_experts():
    # experts nobody selects may hold anything (NaN): their weights are never read
    moe, w13, w2 = make_moe(6, 2, 32, 16)
    logits = torch.full((3, 6), -10.0)
    logits[:, 1], logits[:, 4] = 5.0, 4.0
    moe.w13.weight[[0, 2, 3, 5]] = float("nan")
    moe.w2.weight[[0, 2, 3, 5]] = float("nan")
    x = torch.randn(3, 32)
    assert torch.isfinite(moe(x, logits)).all()


def random_blocks(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return random_k_quant_blocks((rows, cols), qtype, seed=seed)
    data = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.1
    return gguf.quants.quantize(data, qtype)


@pytest.mark.parametrize(
    "qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda t: t.name
)
def test_experts_computed_from_gguf_blocks(qtype):
    # stacked gate and up blocks [E * I, bytes] stay blocks (interleaved per expert); each
    # expert's product equals the dequantized weight's
    require_cpu_kernels()
    experts, inter, hidden = 5, 256, 256
    gate, up = (random_blocks(qtype, experts * inter, hidden, s) for s in (1, 2))
    down = random_blocks(qtype, experts * hidden, inter, 3)
    w13 = StackedExpertWeight(experts, (inter, inter), hidden, torch.float32, CPU)
    w2 = StackedExpertWeight(experts, (hidden,), inter, torch.float32, CPU)
    blocks = [QuantizedTensor(b, qtype, (b.shape[0], hidden)) for b in (gate, up)]
    w13.load(blocks[0], "gate", part=0)
    w13.load(blocks[1], "up", part=1)
    w2.load(QuantizedTensor(down, qtype, (experts * hidden, inter)), "down", part=0)
    w13.finish_loading()
    w2.finish_loading()
    assert w13.ggml_type == w2.ggml_type == qtype and w13.weight.numel() == 0
    dense13 = torch.cat([b.dequantize().view(experts, inter, hidden) for b in blocks], 1)
    dense2 = QuantizedTensor(down, qtype, (experts * hidden, inter)).dequantize()
    dense2 = dense2.view(experts, hidden, inter)
    x = torch.randn(3, hidden)
    for e in (0, 3, 4):
        torch.testing.assert_close(w13.matmul(e, x), x @ dense13[e].T, atol=2e-3, rtol=2e-3)
        h = torch.randn(3, inter)
        torch.testing.assert_close(w2.matmul(e, h), h @ dense2[e].T, atol=2e-3, rtol=2e-3)


def test_gate_and_up_blocks_of_different_types_are_decoded():
    experts, inter, hidden = 3, 64, 64
    gate = QuantizedTensor(random_blocks(Q.Q8_0, experts * inter, hidden, 1), Q.Q8_0, (192, 64))
    up = QuantizedTensor(random_blocks(Q.Q4_0, experts * inter, hidden, 2), Q.Q4_0, (192, 64))
    w13 = StackedExpertWeight(experts, (inter, inter), hidden, torch.float32, CPU)
    w13.load(gate, "gate", part=0)
    w13.load(up, "up", part=1)
    w13.finish_loading()
    assert w13.qweight is None
    want = torch.cat([gate.dequantize().view(3, 64, 64), up.dequantize().view(3, 64, 64)], 1)
    assert torch.equal(w13.weight, want)
    with pytest.raises(ValueError, match="expected shape"):
        w13.load(torch.zeros(3, 64, 64), "gate_up")


@pytest.mark.parametrize("num_tokens", [1, 6, 45])
def test_native_whole_block_op_from_fp32_weights(num_tokens):
    # fp32 experts read as F32 blocks by hybridllm::fused_moe: the naive loop's output
    require_cpu_kernels()
    moe, w13, w2 = make_moe(9, 4, 64, 32, seed=num_tokens)
    moe.use_native_op()
    moe.use_f32_kernel()
    assert moe.w13.qweight is not None and moe.w2.qweight is not None
    g = torch.Generator().manual_seed(10 + num_tokens)
    x = torch.randn(num_tokens, 64, generator=g)
    logits = torch.randn(num_tokens, 9, generator=g)
    want = naive_moe(x, w13, w2, *select_experts(logits, 4))
    torch.testing.assert_close(moe(x, logits), want, atol=1e-5, rtol=1e-5)
    # bf16 activations (a CPU expert stage beside a GPU) come back in bf16
    got = moe(x.bfloat16(), logits)
    assert got.dtype == torch.bfloat16
    want_bf16 = moe(x.bfloat16().float(), logits).bfloat16()
    torch.testing.assert_close(got, want_bf16, atol=0, rtol=0)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0, Q.Q6_K], ids=lambda t: t.name)
def test_native_whole_block_op_from_gguf_blocks(qtype):
    # the one-call op equals the per-expert loop over the same blocks, bit for bit (same
    # kernels, same order of the weighted sum), and the dequantized experts' naive output
    # (within the int8-activation tolerance)
    require_cpu_kernels()
    experts, top_k, inter, hidden = 6, 3, 256, 256
    gate, up = (random_blocks(qtype, experts * inter, hidden, s) for s in (4, 5))
    down = random_blocks(qtype, experts * hidden, inter, 6)
    moe = FusedMoE(experts, top_k, hidden, inter, True, torch.float32, CPU)
    blocks = [QuantizedTensor(b, qtype, (b.shape[0], hidden)) for b in (gate, up)]
    moe.w13.load(blocks[0], "gate", part=0)
    moe.w13.load(blocks[1], "up", part=1)
    down_blocks = QuantizedTensor(down, qtype, (experts * hidden, inter))
    moe.w2.load(down_blocks, "down", part=0)
    moe.finish_loading()
    dense13 = torch.cat([b.dequantize().view(experts, inter, hidden) for b in blocks], 1)
    dense2 = down_blocks.dequantize().view(experts, hidden, inter)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(11, hidden, generator=g)
    logits = torch.randn(11, experts, generator=g)
    loop = moe(x, logits)
    moe.use_native_op()
    native = moe(x, logits)
    torch.testing.assert_close(native, loop, atol=1e-6, rtol=1e-6)
    want = naive_moe(x, dense13, dense2, *select_experts(logits, top_k))
    torch.testing.assert_close(native, want, atol=2e-3, rtol=2e-3)


def per_expert_int8(x, weights, ids, w13, t13, w2, t2, activations):
    """hybridllm::gguf_linear once per active expert with int8 activations, outputs added in
    expert order: what the op computes for experts with many rows."""
    linear, inter = torch.ops.hybridllm.gguf_linear, w13.shape[1] // 2
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        if len(tokens) == 0:
            continue
        gate_up = linear(x[tokens], w13[e], t13, 2 * inter, activations)
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out[tokens] += weights[tokens, slots, None] * linear(
            act, w2[e], t2, x.shape[1], activations
        )
    return out


@pytest.mark.parametrize("qtypes", [(Q.Q4_K, Q.Q6_K), (Q.Q4_1, Q.Q8_0)], ids=lambda t: t[0].name)
def test_experts_with_few_rows_computed_together(qtypes):
    # int8 activations: experts with fewer rows than the int8 GEMM takes run gate/up and down
    # each in one parallel region for all of them; every path gives what one gguf_linear call per
    # expert gives (the rest of the experts, with many rows, as before)
    require_cpu_kernels()
    experts, top_k, inter, hidden = 7, 3, 256, 512
    t13, t2 = qtypes
    w13 = torch.from_numpy(random_blocks(t13, experts * 2 * inter, hidden, 8))
    w13 = w13.view(experts, 2 * inter, -1)
    w2 = torch.from_numpy(random_blocks(t2, experts * hidden, inter, 9)).view(experts, hidden, -1)
    g = torch.Generator().manual_seed(3)
    op = torch.ops.hybridllm.fused_moe
    for num_tokens in (1, 5, 30):
        x = torch.randn(num_tokens, hidden, generator=g)
        logits = torch.randn(num_tokens, experts, generator=g)
        logits[:, 2] += 3.0  # expert 2 takes every token: 30 rows, the GEMM's side
        weights, ids = select_experts(logits, top_k)
        counts = torch.bincount(ids.flatten(), minlength=experts)
        assert num_tokens < 30 or (counts[2] == 30 and (counts[counts > 0] < 8).any())
        for path in torch.ops.hybridllm.gguf_int8_paths():
            got = op(x, weights, ids, w13, t13, w2, t2, path)
            want = per_expert_int8(x, weights, ids, w13, t13, w2, t2, path)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_native_whole_block_op_rejects_bad_inputs():
    require_cpu_kernels()
    w13 = torch.zeros(4, 64, 32 * 4, dtype=torch.uint8)  # F32 blocks of [4, 64, 32]
    w2 = torch.zeros(4, 32, 32 * 4, dtype=torch.uint8)
    x, weights = torch.randn(2, 32), torch.ones(2, 2)
    op = torch.ops.hybridllm.fused_moe
    with pytest.raises(RuntimeError, match="expert id 4 out of range"):
        op(x, weights, torch.tensor([[0, 4], [1, 2]]), w13, 0, w2, 0)
    with pytest.raises(RuntimeError, match="expert id -1 out of range"):
        op(x, weights, torch.tensor([[0, -1], [1, 2]]), w13, 0, w2, 0)
    with pytest.raises(RuntimeError, match="topk_weights must be float32"):
        op(x, torch.ones(2, 3), torch.tensor([[0, 1], [1, 2]]), w13, 0, w2, 0)
    with pytest.raises(RuntimeError, match="w13 must be"):
        op(x, weights, torch.tensor([[0, 1], [1, 2]]), w13, 0, w2[:3], 0)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("top_k", [1, 3, 8])
def test_native_routing_matches_select_experts(scoring, renormalize, top_k):
    require_cpu_kernels()
    g = torch.Generator().manual_seed(top_k)
    logits = torch.randn(37, 11, generator=g) * 3
    want_w, want_ids = select_experts(logits, top_k, scoring, renormalize)
    got_w, got_ids = torch.ops.hybridllm.route_experts(
        logits, top_k, scoring == "sigmoid", renormalize
    )
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-6)
    # bf16 logits (a GPU stage's router) are scored in fp32 too; they tie often, and a tie
    # may pick either expert: the chosen logits and weights agree
    low = logits.bfloat16()
    got_w, got_ids = torch.ops.hybridllm.route_experts(
        low, top_k, scoring == "sigmoid", renormalize
    )
    want_w, want_ids = select_experts(low, top_k, scoring, renormalize)
    assert torch.equal(low.gather(1, got_ids), low.gather(1, want_ids))
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-6)
    with pytest.raises(RuntimeError, match="top_k 12 must be in"):
        torch.ops.hybridllm.route_experts(logits, 12, False, True)


def gpt_oss_experts(experts, hidden, inter, gate_up, gate_up_bias, down, down_bias):
    """transformers' GptOssExperts (its float forward) holding the given weights: gate_up
    [E, 2I, H] and its bias [E, 2I] with gate and up rows interleaved, down [E, H, I]."""
    from types import SimpleNamespace

    modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    config = SimpleNamespace(
        intermediate_size=inter,
        num_local_experts=experts,
        hidden_size=hidden,
        swiglu_alpha=1.702,
        swiglu_limit=7.0,
        _experts_implementation=None,  # its own (eager) forward
    )
    module = modeling.GptOssExperts(config)
    with torch.no_grad():
        module.gate_up_proj.copy_(gate_up.transpose(1, 2))  # x @ W layout
        module.gate_up_proj_bias.copy_(gate_up_bias)
        module.down_proj.copy_(down.transpose(1, 2))
        module.down_proj_bias.copy_(down_bias)
    return module


def deinterleaved(t: torch.Tensor) -> torch.Tensor:
    """[E, 2I, ...] with gate/up rows interleaved -> gate rows, then up rows."""
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)


@pytest.mark.parametrize("qtype", [Q.MXFP4, Q.Q8_0], ids=lambda t: t.name)
def test_gpt_oss_experts_with_biases_and_swigluoai(qtype):
    # gpt-oss's experts (MXFP4 as its checkpoints hold them, or re-blocked as Q8_0): the native
    # op with biases and the clamped activation equals FusedMoE's per-expert loop over the
    # same blocks, on fp32 and on every int8 path, and transformers' GptOssExperts over the
    # blocks' decoding. Rows of 288 and 96: not whole 256-weight super-blocks, as 2880 is not.
    require_cpu_kernels()
    from hybridllm.layers.mlp import ExpertActivation
    from hybridllm.loader.mxfp4_blocks import deinterleave_rows, repack_mxfp4

    experts, top_k, hidden, inter = 8, 4, 288, 96
    g = torch.Generator().manual_seed(11)

    def hf_mxfp4(rows, cols):  # HF blocks [E, rows, cols / 32, 16] + E8M0 scales 2^-5 .. 2^-2
        blocks = torch.randint(
            0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8, generator=g
        )
        scales = torch.randint(
            122, 126, (experts, rows, cols // 32), dtype=torch.uint8, generator=g
        )
        return repack_mxfp4("w", blocks.numpy(), scales.numpy())

    gate_up_qt = deinterleave_rows(hf_mxfp4(2 * inter, hidden), experts)  # gate | up
    down_qt = hf_mxfp4(hidden, inter)
    if qtype == Q.Q8_0:  # the same weights re-blocked
        gate_up_qt, down_qt = (
            QuantizedTensor(gguf.quants.quantize(qt.dequantize().numpy(), qtype), qtype, qt.shape)
            for qt in (gate_up_qt, down_qt)
        )
    w13 = gate_up_qt.dequantize().view(experts, 2 * inter, hidden)  # gate | up
    w2 = down_qt.dequantize().view(experts, hidden, inter)
    b13 = torch.randn(experts, 2 * inter, generator=g)  # gate | up
    b2 = torch.randn(experts, hidden, generator=g)
    interleave = torch.stack((torch.arange(inter), torch.arange(inter) + inter), 1).flatten()
    reference = gpt_oss_experts(
        experts, hidden, inter, w13[:, interleave], b13[:, interleave], w2, b2
    )

    act = ExpertActivation("swigluoai", alpha=1.702, limit=7.0)
    moe = FusedMoE(
        experts, top_k, hidden, inter, True, torch.float32, CPU, hidden_act=act, bias=True
    )
    moe.w13.load(gate_up_qt, "gate_up")
    moe.w2.load(down_qt, "down")
    moe.finish_loading()
    assert moe.w13.ggml_type == moe.w2.ggml_type == qtype and not moe.plain
    with torch.no_grad():
        moe.w13_bias.copy_(b13)
        moe.w2_bias.copy_(b2)

    def run(native: bool, activations: int, x, logits):
        moe.native = native
        moe.activations = moe.w13.activations = moe.w2.activations = activations
        return moe(x, logits)

    for num_tokens in (1, 5, 40):
        x = torch.randn(num_tokens, hidden, generator=g)
        logits = torch.randn(num_tokens, experts, generator=g)
        logits[:, 3] += 4.0  # expert 3 takes every token: past the int8 GEMM's 8 rows at 40
        weights, ids = select_experts(logits, top_k)
        with torch.no_grad():
            want = reference(x, router_indices=ids, routing_weights=weights)
        scale = want.abs().max().item()
        gate = x @ w13[:, :inter].reshape(-1, hidden).T  # some gates past the limit
        assert num_tokens == 1 or (gate > 7).any()
        loop = run(False, 0, x, logits)
        torch.testing.assert_close(loop, want, atol=1e-5 * scale, rtol=1e-4)
        native = run(True, 0, x, logits)
        torch.testing.assert_close(native, loop, atol=1e-5 * scale, rtol=1e-5)
        for path in torch.ops.hybridllm.gguf_int8_paths():
            loop = run(False, path, x, logits)
            native = run(True, path, x, logits)
            torch.testing.assert_close(native, loop, atol=1e-5 * scale, rtol=1e-5)
            # int8 activations: within their rounding of the float reference
            torch.testing.assert_close(native, want, atol=3e-2 * scale, rtol=0)


def test_native_op_activations_and_biases_equal_the_loop():
    # every activation the op computes, with and without biases, from fp32 experts read as
    # F32 blocks; SiLU without biases stays the compiled silu_and_mul (the decode stack's)
    require_cpu_kernels()
    from hybridllm.layers.mlp import ExpertActivation

    g = torch.Generator().manual_seed(5)
    for name in ("silu", "gelu_pytorch_tanh", "swigluoai"):
        for bias in (False, True):
            moe = FusedMoE(
                6, 2, 64, 32, True, torch.float32, CPU,
                hidden_act=ExpertActivation(name, alpha=1.5, limit=1.0), bias=bias,
            )  # fmt: skip
            moe.w13.load(torch.randn(6, 64, 64, generator=g) / 4, "w13")
            moe.w2.load(torch.randn(6, 64, 32, generator=g) / 4, "w2")
            if bias:
                with torch.no_grad():
                    moe.w13_bias.copy_(torch.randn(6, 64, generator=g))
                    moe.w2_bias.copy_(torch.randn(6, 64, generator=g))
            x, logits = torch.randn(9, 64, generator=g), torch.randn(9, 6, generator=g)
            loop = moe(x, logits)
            moe.use_native_op()
            moe.use_f32_kernel()
            assert moe.plain == (name == "silu" and not bias)
            torch.testing.assert_close(moe(x, logits), loop, atol=1e-5, rtol=1e-5)
    w13 = torch.zeros(4, 64, 32 * 4, dtype=torch.uint8)
    w2 = torch.zeros(4, 32, 32 * 4, dtype=torch.uint8)
    x, weights, ids = torch.randn(2, 32), torch.ones(2, 2), torch.tensor([[0, 1], [1, 2]])
    op = torch.ops.hybridllm.fused_moe
    with pytest.raises(RuntimeError, match="act must be"):
        op(x, weights, ids, w13, 0, w2, 0, 0, None, None, 3)
    with pytest.raises(RuntimeError, match="w13_bias must be a float32"):
        op(x, weights, ids, w13, 0, w2, 0, 0, torch.zeros(4, 32), None, 2)
    with pytest.raises(RuntimeError, match="w2_bias must be a float32"):
        op(x, weights, ids, w13, 0, w2, 0, 0, None, torch.zeros(4, 32).double(), 2)
