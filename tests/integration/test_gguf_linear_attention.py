"""GGUF files of llama.cpp's `qwen3next` and `qwen35moe` architectures (Gated DeltaNet hybrids),
written by llama.cpp's own convert_hf_to_gguf.py and llama-quantize from tiny random transformers
models (tests/gguf_linear_helpers.py), read as the HF folder they came from: the same config
fields, and every tensor the folder's (bit for bit from the F32 file, with what the converter did
undone; within 8-bit blocks' error from the Q8_0 file). The multi-token-prediction block is
skipped. Skips where llama.cpp's converter and tools are not built; files are made once.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors import safe_open

from hybridllm.loader.gguf_file import GGUFFile
from hybridllm.loader.gguf_mapping import GGUF_ARCHS, hf_config_kwargs, hf_tensor_name
from hybridllm.loader.gguf_mapping_linear import v_head_order
from hybridllm.loader.gguf_source import GGUFSource
from hybridllm.loader.model_source import ModelLoadError
from hybridllm.loader.quantized_tensor import QuantizedTensor
from tests.gguf_linear_helpers import KINDS, QUANT, converter_paths, tiny_files

# config.json fields that are no part of the model (or that the GGUF file does not carry)
_NOT_MODEL_FIELDS = {
    "transformers_version", "dtype", "initializer_range", "attention_dropout", "use_cache",
    "output_router_logits", "router_aux_loss_coef", "pad_token_id",
}  # fmt: skip
# the norms HF applies as 1 + w, which the converter stored as 1 + w
_SHIFTED_NORM = re.compile(r"(layernorm|q_norm|k_norm|model\.norm)\.weight$")

# Q8_0 tensors that stay blocks (renamed; Qwen3.5's with rows or whole blocks reordered)
_KEPT_QUANTIZED = [
    f"model.layers.0.{n}.weight"
    for n in (
        "linear_attn.in_proj_qkv",
        "linear_attn.in_proj_z",
        "linear_attn.out_proj",
        "mlp.experts.up_proj",
    )
]

needs_converter = pytest.mark.skipif(
    converter_paths() is None,
    reason="llama.cpp's convert_hf_to_gguf.py and llama-quantize are not built "
    "(../shared/tools/build_llamacpp.sh builds them)",
)


@pytest.fixture(scope="module", params=KINDS)
def files(request):
    if converter_paths() is None:
        pytest.skip("llama.cpp's convert_hf_to_gguf.py and llama-quantize are not built")
    return request.param, tiny_files(request.param)


@needs_converter
def test_config_equals_the_hf_folders(files):
    kind, paths = files
    hf = json.loads((paths["hf"] / "config.json").read_text())
    fields = {k: v for k, v in hf.items() if k not in _NOT_MODEL_FIELDS}
    for label in ("F32", QUANT):
        config = GGUFSource(str(paths[label]), use_cache=False).hf_config.to_dict()
        assert {k: config.get(k, "missing") for k in fields} == fields, label


def _folder_tensors(f) -> dict[str, torch.Tensor]:
    """The folder's tensors in the file's layout: the experts stacked [E, rows, cols], and
    Qwen3-Next's fused in_proj_qkvz split into in_proj_qkv (every head's q, k, v) and in_proj_z
    as GatedDeltaNet's fused loader splits it; the MTP head (`mtp.*`) left out."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name in f.keys():
        if name.startswith("mtp."):
            continue
        m = re.match(r"^(.*\.mlp\.experts)\.(\d+)\.(\w+)\.weight$", name)
        if m:
            experts.setdefault(f"{m.group(1)}.{m.group(3)}.weight", {})[int(m.group(2))] = (
                f.get_tensor(name)
            )
        else:
            out[name] = f.get_tensor(name)
    for name, parts in experts.items():
        out[name] = torch.stack([parts[e] for e in sorted(parts)])
    return out


def _split_qkvz(state: dict[str, torch.Tensor], hf: dict) -> None:
    k_heads, v_heads = hf["linear_num_key_heads"], hf["linear_num_value_heads"]
    dk, dv, group = hf["linear_key_head_dim"], hf["linear_value_head_dim"], v_heads // k_heads
    for name in [n for n in state if n.endswith("in_proj_qkvz.weight")]:
        w = state.pop(name)
        sizes = [dk, dk, group * dv, group * dv]
        q, k, v, z = (
            p.reshape(-1, w.shape[1]) for p in w.reshape(k_heads, -1, w.shape[1]).split(sizes, 1)
        )
        prefix = name[: -len("in_proj_qkvz.weight")]
        state[prefix + "in_proj_qkv.weight"] = torch.cat([q, k, v])
        state[prefix + "in_proj_z.weight"] = z


@needs_converter
def test_every_tensor_maps_to_the_folders(files):
    """Every GGUF tensor but the MTP block's maps to a folder tensor and every folder tensor is
    covered: equal from the F32 file (the 1 + w norms as the model holds them, A_log as the
    model uses it, -exp(A_log)), within Q8_0's error from the quantized one, whose linears and
    expert stacks stay blocks where only renamed or rows reordered (Qwen3.5's value heads)."""
    kind, paths = files
    hf = json.loads((paths["hf"] / "config.json").read_text())
    with safe_open(str(paths["hf"] / "model.safetensors"), "pt") as f:
        folder = _folder_tensors(f)
    if kind == "qwen3_next":
        _split_qkvz(folder, hf)
    for label in ("F32", QUANT):
        source = GGUFSource(str(paths[label]), use_cache=False)
        layers = hf["num_hidden_layers"]
        trunk = [
            n for n in GGUFFile(str(paths[label])).tensors if not n.startswith(f"blk.{layers}.")
        ]
        assert len(source.weight_names()) == len(trunk)
        got = dict(source.iter_weights())
        assert set(got) == set(folder), (label, set(got) ^ set(folder))
        for name, tensor in got.items():
            want = folder[name]
            assert tensor.shape == want.shape, (label, name)
            if label == "F32" and _SHIFTED_NORM.search(name):
                assert torch.equal(tensor + 1, want + 1), name
            elif label == "F32" and name.endswith("A_log"):
                assert torch.equal(-tensor.exp(), -want.exp()), name
            elif label == "F32":
                assert torch.equal(tensor, want), name
            else:
                err = (tensor.float() - want).abs().max() / want.abs().max()
                assert err < 0.01, (label, name, err)
        quantized = dict(source.iter_weights(quantized_types={GGMLQuantizationType.Q8_0}))
        for name in _KEPT_QUANTIZED:
            # Qwen3.5's out_proj columns move by value head, 16 columns: half a Q8_0 block,
            # so it is decoded to reorder them (a real model's 128 are whole blocks)
            blocks = label == QUANT and not (kind == "qwen3_5_moe" and "out_proj" in name)
            assert isinstance(quantized[name], QuantizedTensor) == blocks, (label, name)


# ---- mapping units (no converter needed) --------------------------------------------------------


def _metadata(arch: str, **keys):
    p = f"{arch}."
    base = {
        "general.architecture": arch, p + "block_count": 49, p + "embedding_length": 2048,
        p + "feed_forward_length": 5120, p + "attention.head_count": 16,
        p + "attention.head_count_kv": 2, p + "attention.key_length": 256,
        p + "attention.value_length": 256, p + "vocab_size": 151936,
        p + "attention.layer_norm_rms_epsilon": 1e-6, p + "rope.freq_base": 1e7,
        p + "rope.dimension_count": 64, p + "expert_count": 512, p + "expert_used_count": 10,
        p + "expert_feed_forward_length": 512, p + "expert_shared_feed_forward_length": 512,
        p + "nextn_predict_layers": 1, p + "ssm.conv_kernel": 4, p + "ssm.state_size": 128,
        p + "ssm.group_count": 16, p + "ssm.time_step_rank": 32, p + "ssm.inner_size": 4096,
        p + "full_attention_interval": 4,
    }  # fmt: skip
    return {**base, **{p + k: v for k, v in keys.items()}}


def test_qwen3_next_80b_config_from_metadata():
    """Qwen3-Next-80B-A3B's shapes: 48 decoder layers (the 49th block is MTP), every 4th full
    attention, a quarter of head_dim rotated, top-k renormalised as llama.cpp always does."""
    arch, kw = hf_config_kwargs(_metadata("qwen3next"), set(), "f")
    assert (arch.model_type, kw["architectures"]) == ("qwen3_next", ["Qwen3NextForCausalLM"])
    assert kw["num_hidden_layers"] == 48 and kw["head_dim"] == 256
    assert kw["layer_types"][:4] == ["linear_attention"] * 3 + ["full_attention"]
    assert len(kw["layer_types"]) == 48
    assert kw["rope_parameters"] == {
        "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
    }  # fmt: skip
    assert (kw["linear_num_key_heads"], kw["linear_num_value_heads"]) == (16, 32)
    assert (kw["linear_key_head_dim"], kw["linear_value_head_dim"]) == (128, 128)
    assert kw["linear_conv_kernel_dim"] == 4 and kw["norm_topk_prob"] is True
    assert (kw["num_experts"], kw["num_experts_per_tok"], kw["moe_intermediate_size"]) == (
        512, 10, 512,
    )  # fmt: skip
    assert kw["shared_expert_intermediate_size"] == 512 and kw["rms_norm_eps"] == 1e-6
    assert kw["mlp_only_layers"] == list(range(48))  # no ffn_gate_inp among the names given


def test_qwen35moe_config_follows_recurrent_layers_flags():
    flags = [True, False, True] + [False] * 46
    arch, kw = hf_config_kwargs(
        _metadata("qwen35moe", **{"attention.recurrent_layers": flags}), set(), "f"
    )
    assert arch.model_type == "qwen3_5_moe_text" and kw["architectures"] == [
        "Qwen3_5MoeForCausalLM"
    ]
    assert kw["layer_types"][:3] == ["linear_attention", "full_attention", "linear_attention"]
    assert "norm_topk_prob" not in kw and "mlp_only_layers" not in kw
    with pytest.raises(ModelLoadError, match="time_step_rank"):
        hf_config_kwargs(_metadata("qwen35moe", **{"ssm.time_step_rank": 24}), set(), "f")


def test_linear_tensor_names():
    nxt, q35 = GGUF_ARCHS["qwen3next"], GGUF_ARCHS["qwen35moe"]
    la = "model.layers.2.linear_attn."
    assert hf_tensor_name("blk.2.ssm_a", "f", nxt) == la + "A_log"
    assert hf_tensor_name("blk.2.ssm_dt.bias", "f", nxt) == la + "dt_bias"
    assert hf_tensor_name("blk.2.attn_qkv.weight", "f", nxt) == la + "in_proj_qkv.weight"
    assert hf_tensor_name("blk.2.attn_gate.weight", "f", nxt) == la + "in_proj_z.weight"
    assert hf_tensor_name("blk.2.ssm_ba.weight", "f", nxt) == la + "in_proj_ba.weight"
    assert hf_tensor_name("blk.2.ssm_beta.weight", "f", q35) == la + "in_proj_b.weight"
    assert hf_tensor_name("blk.2.ssm_alpha.weight", "f", q35) == la + "in_proj_a.weight"
    assert hf_tensor_name("blk.2.ssm_norm.weight", "f", q35) == la + "norm.weight"
    assert hf_tensor_name("blk.2.post_attention_norm.weight", "f", q35) == (
        "model.layers.2.post_attention_layernorm.weight"
    )
    assert hf_tensor_name("blk.48.attn_q.weight", "f", nxt, num_layers=48) is None  # MTP
    assert hf_tensor_name("blk.3.nextn.eh_proj.weight", "f", nxt) is None
    with pytest.raises(ModelLoadError):
        hf_tensor_name("blk.2.ssm_a", "f", GGUF_ARCHS["qwen3"])


def test_v_head_order_undoes_the_converters_tiling():
    """The converter's grouped -> tiled reorder (k heads 2, 3 value heads each, 2 rows a head)
    applied to an index, then v_head_order, gives the index back."""
    k, r, d = 2, 3, 2
    hf = torch.arange(k * r * d)
    gguf = hf.reshape(k, r, d).transpose(0, 1).reshape(-1)  # what the converter writes
    order = torch.from_numpy(v_head_order(k, k * r, d))
    assert torch.equal(gguf[order], hf)
    assert v_head_order(4, 4, 8) is None


@needs_converter
def test_greedy_tokens_equal_transformers(files):
    """The F32 file through the engine (prompts longer than a delta-rule chunk, prefilled in
    chunks, a one-token prompt) against transformers on the folder the file came from; the Q8_0
    file runs the same prompts from its blocks."""
    from transformers import AutoModelForCausalLM

    from hybridllm import LLM
    from tests.integration.test_moe_models_vs_hf import ENGINE_KWARGS, MAX_TOKENS, PARAMS
    from tests.moe_helpers import hf_greedy

    kind, paths = files
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (70, 1, 9)]
    hf = AutoModelForCausalLM.from_pretrained(
        paths["hf"], dtype=torch.float32, attn_implementation="eager"
    ).eval()
    want = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    with torch.no_grad():  # each prompt's margin between its two likeliest first tokens
        gaps = [hf(torch.tensor([p])).logits[0, -1].topk(2).values for p in prompts]
    clear = [i for i, top in enumerate(gaps) if top[0] - top[1] > 0.2]
    assert clear  # the Q8_0 check below compares these prompts' first tokens
    for path in (paths["F32"], paths[QUANT]):
        llm = LLM(str(path), **{**ENGINE_KWARGS, "kv_cache_dtype": "float32"})
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
        finally:
            llm.shutdown()
        got = [list(o.outputs[0].token_ids) for o in outs]
        if path == paths["F32"]:
            assert got == want
        else:  # 8-bit blocks: first tokens agree where no near-tie can flip them
            assert [got[i][0] for i in clear] == [want[i][0] for i in clear]


@needs_converter
def test_plan_counts_the_files_kept_blocks(files):
    """The planner sizes a Gated DeltaNet layer's linears as the blocks the CPU worker keeps
    (not as fp32: a Q4_K_M Qwen3-Next-shaped file was planned at 6.5x its size before)."""
    from hybridllm.loader.block_sizes import gguf_block_sizes
    from hybridllm.plan.model_size import model_size

    kind, paths = files
    source = GGUFSource(str(paths[QUANT]), use_cache=False)
    config = source.hf_config
    sizes = gguf_block_sizes(source, config.num_hidden_layers)
    assert sizes is not None
    # the linears in kept block types (not the tiny model's 48-wide shared-expert down, which
    # llama-quantize leaves float, nor Qwen3-Next's per-key-head interleaved ssm_ba)
    assert 0.9 * sizes.total_params < sizes.kept_params < sizes.total_params
    size = model_size(config, "float32", sizes).cpu_view()
    matmul = sum(size.layer_matmul_params(i) for i in range(size.num_layers))
    # the planner's linears are the file's (its count adds the routers, which the file's
    # stacks leave out)
    assert sizes.total_params <= matmul < 1.01 * sizes.total_params
