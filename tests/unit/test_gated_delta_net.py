"""GatedDeltaNet (Qwen3-Next / Qwen3.5 linear attention) against transformers' layers: prefill,
chunked prefill and decode from its state, mixed batches, and the native ops against torch."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from hybridllm.layers.gated_delta_net import DeltaNetBatch, DeltaNetState, GatedDeltaNet
from hybridllm.layers.gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from tests.kernel_helpers import require_cpu_kernels

# Dk != Dv and Hv = 2 Hk, so that a swapped dimension or head mapping cannot pass
SIZES = {
    "hidden_size": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 24,
    "linear_conv_kernel_dim": 4,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
}
PATHS = ["torch", "native"]


def build(kind: str = "qwen3_next", path: str = "torch", seed: int = 0):
    """transformers' layer with random weights, and ours holding the same weights."""
    torch.manual_seed(seed)
    if kind == "qwen3_next":
        config = Qwen3NextConfig(**SIZES)
        hf = Qwen3NextGatedDeltaNet(config, layer_idx=0)
    else:
        config = Qwen3_5MoeTextConfig(**SIZES)
        hf = Qwen3_5MoeGatedDeltaNet(config, layer_idx=0)
    with torch.no_grad():  # init leaves these at ones: random, so that a misuse shows
        hf.dt_bias.uniform_(-1, 1)
        hf.norm.weight.uniform_(0.5, 1.5)
    if path == "native":
        require_cpu_kernels()
    ours = GatedDeltaNet(config, torch.float32, use_cpu_kernels=path == "native")
    loaders = ours.weight_loaders("layer.")
    weights = {f"layer.{name}": t for name, t in hf.state_dict().items()}
    assert set(weights) <= set(loaders)  # Qwen3-Next also takes the split in_proj_qkv, z
    with torch.no_grad():
        for name, tensor in weights.items():
            loaders[name](tensor)
    return config, hf.eval(), ours


def run(layer, x, lengths, fresh, slots, state):
    with torch.no_grad():
        return layer(x, DeltaNetBatch.build(lengths, fresh, slots), state)


def reference(hf, x: torch.Tensor) -> torch.Tensor:
    """transformers' single forward over the whole sequence, [L, hidden]."""
    with torch.no_grad():
        return hf(x.unsqueeze(0))[0]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("splits", [(150,), (37, 100, 1, 12)])
def test_prefill_chunks_and_decode_match_transformers(path, splits):
    """A prefill longer than two chunks (or one split at arbitrary points, continuing from the
    state), then 5 decode steps, equal transformers' one forward over all the tokens."""
    _, hf, ours = build(path=path)
    x = torch.randn(sum(splits) + 5, SIZES["hidden_size"])
    state = DeltaNetState(ours.shape, num_slots=3)
    state.recurrent.fill_(7.0)  # a stale slot: a fresh sequence must not read it
    state.conv.fill_(7.0)
    outs, at = [], 0
    for i, n in enumerate(list(splits) + [1] * 5):
        outs.append(run(ours, x[at : at + n], [n], [i == 0], [2], state))
        at += n
    torch.testing.assert_close(torch.cat(outs), reference(hf, x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("path", PATHS)
def test_qwen3_5_moe_split_projections(path):
    _, hf, ours = build("qwen3_5_moe", path)
    x = torch.randn(75, SIZES["hidden_size"])
    state = DeltaNetState(ours.shape, num_slots=1)
    outs = [run(ours, x[:70], [70], [True], [0], state)]
    outs += [run(ours, x[i : i + 1], [1], [False], [0], state) for i in range(70, 75)]
    torch.testing.assert_close(torch.cat(outs), reference(hf, x), rtol=1e-4, atol=1e-5)


def random_rule_inputs(length: int, heads: int = 3, dk: int = 16, dv: int = 24):
    g = torch.Generator().manual_seed(length)
    q, k = (
        torch.nn.functional.normalize(torch.randn(length, heads, dk, generator=g), dim=-1)
        for _ in range(2)
    )
    v = torch.randn(length, heads, dv, generator=g)
    decay = -torch.rand(length, heads, generator=g) * 0.5
    beta = torch.rand(length, heads, generator=g)
    state = torch.randn(heads, dk, dv, generator=g)
    return q * dk**-0.5, k, v, decay, beta, state


def test_chunked_and_recurrent_forms_agree():
    q, k, v, decay, beta, state = random_rule_inputs(130)
    chunked_state = state.clone()
    chunked = chunk_gated_delta_rule(q, k, v, decay, beta, chunked_state)
    rec_state = state.clone().unsqueeze(0)
    rec = torch.stack(
        [
            recurrent_gated_delta_rule(
                q[t : t + 1],
                k[t : t + 1],
                v[t : t + 1],
                decay[t : t + 1],
                beta[t : t + 1],
                rec_state,
            )[0]
            for t in range(q.shape[0])
        ]
    )
    torch.testing.assert_close(chunked, rec, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(chunked_state, rec_state[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("path", PATHS)
def test_mixed_batch_equals_each_alone(path):
    """Decode rows of two sequences and a fresh prefill in one batch, slots out of order."""
    _, _, ours = build(path=path)
    hidden = SIZES["hidden_size"]
    state = DeltaNetState(ours.shape, num_slots=4)
    run(ours, torch.randn(20, hidden), [20], [True], [3], state)  # sequence A's prompt
    run(ours, torch.randn(90, hidden), [90], [True], [1], state)  # sequence B's prompt
    before = (state.conv.clone(), state.recurrent.clone())
    rows = torch.randn(2 + 70, hidden)
    mixed = run(ours, rows, [1, 1, 70], [False, False, True], [3, 1, 0], state)
    alone = DeltaNetState(ours.shape, num_slots=4)
    alone.conv.copy_(before[0])
    alone.recurrent.copy_(before[1])
    each = [
        run(ours, rows[0:1], [1], [False], [3], alone),
        run(ours, rows[1:2], [1], [False], [1], alone),
        run(ours, rows[2:], [70], [True], [0], alone),
    ]
    torch.testing.assert_close(mixed, torch.cat(each), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state.recurrent, alone.recurrent, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state.conv, alone.conv)
    assert state.recurrent[2].abs().max() == 0  # a slot no sequence names is untouched


def test_native_and_torch_paths_agree():
    """The same mixed batch (two decode rows, a fresh 80-token prefill) on both paths."""
    _, _, native = build(path="native")
    _, _, plain = build(path="torch")
    prompts, rows = torch.randn(40, SIZES["hidden_size"]), torch.randn(82, SIZES["hidden_size"])
    outs, states = [], []
    for layer in (native, plain):
        state = DeltaNetState(layer.shape, num_slots=3)
        run(layer, prompts, [30, 10], [True, True], [0, 2], state)
        outs.append(run(layer, rows, [1, 1, 80], [False, False, True], [2, 0, 1], state))
        states.append(state)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(states[0].recurrent, states[1].recurrent, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(states[0].conv, states[1].conv, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("length", [2, 100])
def test_native_recurrent_op_over_many_tokens_matches_chunked(length):
    """The native op on a multi-token sequence (its prefill) equals the chunked form: Dv = 24 is
    a 16-column block and 8 columns apart; 100 tokens are two runs (64 a run)."""
    require_cpu_kernels()
    q, k, v, decay, beta, state = random_rule_inputs(length, heads=2)
    expected_state = state.clone()
    expected = chunk_gated_delta_rule(q, k, v, decay, beta, expected_state)
    # the op takes raw q|k|v rows and normalizes them itself: q, k are unit vectors (scaled q)
    qkv = torch.cat([(q * 16**0.5).flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    slots_state = torch.zeros(2, *state.shape)
    slots_state[1] = state
    loc, slot = torch.tensor([0, length]), torch.tensor([1])
    out = torch.ops.hybridllm.gdn_recurrent(qkv, decay, beta, slots_state, loc, slot, 2)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(slots_state[1], expected_state, rtol=1e-4, atol=1e-5)
    assert slots_state[0].abs().max() == 0


@pytest.mark.parametrize("path", PATHS)
def test_state_size_does_not_depend_on_length(path):
    _, _, ours = build(path=path)
    sizes = []
    for length in (5, 300):
        state = DeltaNetState(ours.shape, num_slots=2)
        run(ours, torch.randn(length, SIZES["hidden_size"]), [length], [True], [1], state)
        sizes.append([(t.shape, t.dtype) for t in (state.conv, state.recurrent)])
    assert sizes[0] == sizes[1]
    assert sizes[0] == [
        ((2, 160, 3), torch.float32),
        ((2, 4, 16, 24), torch.float32),
    ]
    assert state.nbytes_per_slot() == (160 * 3 + 4 * 16 * 24) * 4


def test_native_conv_over_many_channels_matches_torch():
    """gdn_conv1d against torch's conv1d over channels that span several of its chunks (the last
    one partial): fresh prompts, a continued sequence shorter than the window, a decode row."""
    require_cpu_kernels()
    torch.manual_seed(0)
    channels, kernel = 1100, 4
    weight = torch.randn(channels, kernel)
    state = torch.randn(4, channels, kernel - 1)
    lens, fresh, slots = [37, 2, 1, 9], [True, False, False, True], [2, 0, 3, 1]
    x = torch.randn(sum(lens), channels)
    loc = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    expect_state = state.clone()
    expect = []
    for s, (new, slot) in enumerate(zip(fresh, slots)):
        rows = x[loc[s] : loc[s + 1]].T  # [C, tokens]
        before = torch.zeros(channels, kernel - 1) if new else state[slot]
        window = torch.cat([before, rows], dim=1)  # [C, kernel - 1 + tokens]
        conv = torch.nn.functional.conv1d(window[None], weight[:, None, :], groups=channels)
        expect.append(torch.nn.functional.silu(conv[0].T))
        expect_state[slot] = window[:, -(kernel - 1) :]
    out = torch.ops.hybridllm.gdn_conv1d(
        x, state, weight, loc, torch.tensor(fresh), torch.tensor(slots)
    )
    torch.testing.assert_close(out, torch.cat(expect), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, expect_state)


def test_native_ops_reject_bad_batches():
    require_cpu_kernels()
    qkv, gb = torch.randn(3, 2 * 16 + 2 * 8), torch.randn(3, 2)
    state, loc = torch.zeros(2, 2, 16, 8), torch.tensor([0, 3])
    op = torch.ops.hybridllm.gdn_recurrent
    with pytest.raises(RuntimeError, match="slot out of range"):
        op(qkv, gb, gb, state, loc, torch.tensor([2]), 1)
    with pytest.raises(RuntimeError, match="must span"):
        op(qkv, gb, gb, state, torch.tensor([0, 2]), torch.tensor([0]), 1)
    with pytest.raises(RuntimeError, match="qkv width"):
        op(qkv, gb, gb, state, loc, torch.tensor([0]), 2)
    conv, weight = torch.zeros(2, 48, 3), torch.randn(48, 4)
    with pytest.raises(RuntimeError, match="fresh"):
        torch.ops.hybridllm.gdn_conv1d(qkv, conv, weight, loc, torch.tensor([1]), loc[:1])


def test_bfloat16_weights_track_float32():
    """A bf16 model: projections in bf16, the conv, the rule and the state in fp32."""
    config, _, ours = build()
    half = GatedDeltaNet(config, torch.bfloat16, use_cpu_kernels=False)
    half.load_state_dict(ours.state_dict())
    x = torch.randn(20, SIZES["hidden_size"])
    outs = []
    for layer, dtype in ((ours, torch.float32), (half, torch.bfloat16)):
        state = DeltaNetState(layer.shape, num_slots=1)
        out = run(layer, x.to(dtype), [20], [True], [0], state)
        assert out.dtype == dtype and state.recurrent.dtype == torch.float32
        outs.append(out.float())
    torch.testing.assert_close(outs[1], outs[0], rtol=0.05, atol=0.02)
