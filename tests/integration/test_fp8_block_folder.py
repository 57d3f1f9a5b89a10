"""Hugging Face folders in DeepSeek's block-scaled FP8 layout (loader/fp8_block.py).

A tiny random Qwen3-MoE (attention, per-expert MoE weights, a bf16 router, an untied bf16 head)
is saved in bf16, and its FP8 twin written here in the official layout: each decoder linear as
float8_e4m3fn with `weight_scale_inv` float32 [ceil(out/128), ceil(in/128)], scale = the
block's amax / 448. The hidden size 192 and widths 96 leave partial blocks in both directions.

The reference for generation is a third folder holding the same dequantized values
(`fp8.float() * scale`, computed here) as float32 tensors: bf16 cannot hold those products
exactly (4 significant bits times a 24-bit scale), float32 holds them exactly as the loader
computes them. Loaded with `--quantization q8_0`, the reference quantizes the identical float32
values into identical Q8_0 blocks, so both engines run the same model: greedy tokens and
logprobs must be equal, not merely close.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from hybridllm import LLM, SamplingParams
from hybridllm.engine_args import EngineArgs
from hybridllm.loader import fp8_block, open_model_source
from hybridllm.loader.block_sizes import cpu_block_sizes
from hybridllm.loader.model_source import ModelLoadError
from tests.deepseek_helpers import build_tiny_deepseek_model
from tests.kernel_helpers import require_cpu_kernels
from tests.moe_helpers import build_tiny_moe_model

BLOCK = 128
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [BLOCK, BLOCK],
}
# hidden 192 = 1.5 blocks; q/o 4 x 48 = 192, k/v 2 x 48 = 96, experts 96 wide: partial blocks
MOE = dict(
    hidden_size=192,
    head_dim=48,
    moe_intermediate_size=96,
    intermediate_size=160,
    num_experts=6,
    num_experts_per_tok=4,
    num_hidden_layers=2,
)
PROMPTS = [[5, 17, 42, 99, 7, 63, 12, 8, 150, 33], [3, 8, 200]]
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)


def is_fp8_linear(name: str, tensor: torch.Tensor) -> bool:
    """What the official checkpoints store as fp8: the decoder layers' 2-D projections (the
    router `mlp.gate.weight`, norms, embeddings and the head stay bf16; Qwen3-Next's fused
    Gated DeltaNet in-projections are fp8 too)."""
    projection = name.endswith(("proj.weight", "in_proj_qkvz.weight", "in_proj_ba.weight"))
    return name.startswith("model.layers.") and projection and tensor.dim() == 2


def quantize_fp8_block(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [out, in] as float8_e4m3fn and its scale_inv [ceil(out/128), ceil(in/128)]."""
    rows, cols = weight.shape
    nr, nc = math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)
    padded = torch.zeros(nr * BLOCK, nc * BLOCK)
    padded[:rows, :cols] = weight.float()
    amax = padded.abs().reshape(nr, BLOCK, nc, BLOCK).amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    q = (weight.float() / expand(scale, rows, cols)).to(torch.float8_e4m3fn)
    return q, scale


def expand(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * expand(scale, *q.shape)


def write_folder(path: Path, tensors: dict, config: dict) -> Path:
    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


def write_fp8_twins(model, root: Path) -> tuple[dict, Path, Path]:
    """`model` saved in bf16, its FP8 folder in the official layout and the folder of the
    FP8 folder's dequantized values: (bf16 source tensors, fp8 folder, dequantized folder)."""
    model.to(torch.bfloat16).save_pretrained(root / "bf16")
    source = load_file(str(root / "bf16" / "model.safetensors"))
    config = json.loads((root / "bf16" / "config.json").read_text())
    fp8, dequantized = {}, {}
    for name, tensor in source.items():
        if is_fp8_linear(name, tensor):
            q, scale = quantize_fp8_block(tensor)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            dequantized[name] = dequantize(q, scale)
        else:
            fp8[name] = dequantized[name] = tensor
    fp8_folder = write_folder(
        root / "fp8", fp8, {**config, "quantization_config": QUANTIZATION_CONFIG}
    )
    twin = write_folder(root / "dequantized", dequantized, config)
    return source, fp8_folder, twin


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(bf16 source tensors, the fp8 folder, the folder of its dequantized values)."""
    model = build_tiny_moe_model("qwen3_moe", seed=5, **MOE)
    source, fp8_folder, twin = write_fp8_twins(model, tmp_path_factory.mktemp("fp8"))
    assert any(".mlp.experts.3.gate_proj.weight" in n for n in source)  # per-expert names
    return source, fp8_folder, twin


def test_weights_are_the_fp8_values_times_their_scales(folders):
    source, fp8_folder, twin = folders
    fp8 = open_model_source(str(fp8_folder))
    assert fp8.fp8_block is not None and fp8.fp8_block.block == (BLOCK, BLOCK)
    assert sorted(fp8.weight_names()) == sorted(source)  # no scale among the weights
    want = load_file(str(twin / "model.safetensors"))
    stored = load_file(str(fp8_folder / "model.safetensors"))
    got = dict(fp8.iter_weights())
    assert sorted(got) == sorted(source)
    linears = 0
    for name, tensor in got.items():
        if is_fp8_linear(name, source[name]):
            linears += 1
            assert tensor.dtype == torch.float32 and torch.equal(tensor, want[name]), name
            # and they are the source's fp8 rounding: within half e4m3's relative step
            # (2^-4) or, below its normal range, half its subnormal step (2^-10 of a scale)
            scale = expand(stored[name + "_scale_inv"], *tensor.shape)
            err = (tensor - source[name].float()).abs()
            assert (err <= source[name].float().abs() / 16 + scale / 512).all(), name
        else:
            assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, source[name]), name
    assert linears == 2 * (4 + 6 * 3)  # attention and every expert of both layers
    # a stage reads only what it owns, scales paired with their weights
    owned = dict(fp8.iter_weights(lambda n: ".layers.1.mlp.experts.2." in n))
    assert sorted(owned) == [
        f"model.layers.1.mlp.experts.2.{p}_proj.weight" for p in ("down", "gate", "up")
    ]


@pytest.mark.parametrize("chunk", [1, 128 * 200, 3 * 128 * 200])
def test_dequantized_a_chunk_of_block_rows_at_a_time(chunk, monkeypatch):
    """Chunks of whole block rows (one, several, the last partial) give the whole product."""
    monkeypatch.setattr(fp8_block, "_CHUNK_VALUES", chunk)
    torch.manual_seed(0)
    q, scale = quantize_fp8_block(torch.randn(300, 200))
    got = fp8_block.dequantize_fp8_block("w.weight", q, scale, (BLOCK, BLOCK))
    assert torch.equal(got, dequantize(q, scale))


def test_scales_in_another_shard(folders, tmp_path):
    """A sharded folder may keep a weight's scale in another file than the weight."""
    _, fp8_folder, _ = folders
    tensors = load_file(str(fp8_folder / "model.safetensors"))
    folder = tmp_path / "sharded"
    folder.mkdir()
    scales = {n: t for n, t in tensors.items() if n.endswith("_scale_inv")}
    weights = {n: t for n, t in tensors.items() if n not in scales}
    shards = {"weights.safetensors": weights, "scales.safetensors": scales}
    for file_name, part in shards.items():
        save_file(part, str(folder / file_name))
    weight_map = {n: f for f, part in shards.items() for n in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copy(fp8_folder / "config.json", folder / "config.json")
    got = dict(open_model_source(str(folder)).iter_weights())
    want = dict(open_model_source(str(fp8_folder)).iter_weights())
    assert got.keys() == want.keys()
    assert all(torch.equal(got[n], want[n]) for n in want)


def cpu_llm(path: Path, quantization: str) -> LLM:
    """An engine with one CPU worker over the folder at `path`."""
    return LLM(
        str(path),
        device="cpu",
        quantization=quantization,
        skip_tokenizer_init=True,
        max_model_len=128,
        kv_cache_memory="16MiB",
        use_tqdm=False,
    )


def outputs_of(llm: LLM):
    """Greedy tokens and logprobs of PROMPTS."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def generate(path: Path, quantization: str):
    """Greedy tokens and logprobs, and the block types the CPU worker's linears hold."""
    llm = cpu_llm(path, quantization)
    try:
        assert llm.llm_engine.config.model_config.quantization == "q8_0"
        model = llm.llm_engine.executor.workers[0].model_runner.model
        types = {}
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            types[f"{i}.qkv_proj"] = attn.qkv_proj.ggml_type
            types[f"{i}.o_proj"] = attn.o_proj.ggml_type
            types[f"{i}.experts.w13"] = mlp.experts.w13.ggml_type
            types[f"{i}.experts.w2"] = mlp.experts.w2.ggml_type
            types[f"{i}.experts.native"] = mlp.experts.native
            types[f"{i}.router"] = getattr(mlp.gate, "ggml_type", -1)
        types["lm_head"] = model.lm_head.ggml_type
        return outputs_of(llm), types
    finally:
        llm.shutdown()


def test_cpu_worker_reblocks_into_q8_0_as_the_dequantized_folder_does(
    folders, tmp_path, monkeypatch, caplog
):
    require_cpu_kernels()
    _, fp8_folder, twin = folders
    monkeypatch.setenv("HYBRIDLLM_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.INFO, logger="hybridllm.engine_args"):
        got, types = generate(fp8_folder, "auto")  # no --quantization: Q8_0 for fp8
    assert "re-block its linears into Q8_0 (the default)" in caplog.text
    want, want_types = generate(twin, "q8_0")
    assert types == want_types
    for i in range(MOE["num_hidden_layers"]):
        for part in ("qkv_proj", "o_proj", "experts.w13", "experts.w2"):
            assert types[f"{i}.{part}"] == Q.Q8_0, part
        assert types[f"{i}.experts.native"]  # the fused op reads the expert blocks
        assert types[f"{i}.router"] != Q.Q8_0  # the router stays float
    assert types["lm_head"] == Q.Q8_0
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    for (_, got_lp), (_, want_lp) in zip(got, want):
        for a, b in zip(got_lp, want_lp):
            assert {t: p.logprob for t, p in a.items()} == {t: p.logprob for t, p in b.items()}


def greedy_outputs(path: Path, quantization: str):
    """Greedy tokens and logprobs of PROMPTS from a CPU worker of the folder at `path`."""
    llm = cpu_llm(path, quantization)
    try:
        return outputs_of(llm)
    finally:
        llm.shutdown()


def test_deepseek_v3_fp8_folder_runs_as_its_dequantized_values(tmp_path, monkeypatch):
    """The layout's own architecture: MLA's low-rank projections, shared and routed experts,
    a dense first layer (hidden 96: every block partial)."""
    require_cpu_kernels()
    monkeypatch.setenv("HYBRIDLLM_CACHE_DIR", str(tmp_path / "cache"))
    model = build_tiny_deepseek_model("deepseek_v3", seed=2)
    source, fp8_folder, twin = write_fp8_twins(model, tmp_path)
    fp8_names = {n for n, t in source.items() if is_fp8_linear(n, t)}
    assert {"model.layers.0.self_attn.kv_b_proj.weight", "model.layers.0.mlp.down_proj.weight",
            "model.layers.1.mlp.shared_experts.up_proj.weight",
            "model.layers.2.mlp.experts.7.gate_proj.weight"} <= fp8_names  # fmt: skip

    got, want = greedy_outputs(fp8_folder, "auto"), greedy_outputs(twin, "q8_0")
    assert got == want
    cached = {p.name.split(".weight.")[0] for p in (tmp_path / "cache").rglob("*.Q8_0.npy")}
    assert "model.layers.2.mlp.experts.7.gate_proj" in cached  # the experts became blocks


def test_plan_sizes_fp8_linears_as_q8_0_blocks(folders):
    _, fp8_folder, twin = folders
    source = open_model_source(str(fp8_folder))
    config = source.hf_config

    def kept(quantization: str):
        args = EngineArgs(model=str(fp8_folder), quantization=quantization)
        return args.kept_cpu_blocks(source, config, args.kernel_config())

    require_cpu_kernels()
    sizes = kept("auto")
    twin_source = open_model_source(str(twin))
    assert sizes == cpu_block_sizes(twin_source, twin_source.hf_config, "q8_0", lambda: True)
    assert sizes.kept_bytes == math.ceil(sizes.kept_params * 34 / 32)  # Q8_0: 34 bytes / 32
    assert kept("q4_0").kept_bytes == math.ceil(sizes.kept_params * 18 / 32)  # explicit wins
    assert kept("none") is None


def copy_folder(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_a_bad_or_missing_scale_is_an_error_naming_the_tensor(folders, tmp_path):
    _, fp8_folder, _ = folders
    tensors = load_file(str(fp8_folder / "model.safetensors"))
    config = json.loads((fp8_folder / "config.json").read_text())
    name = "model.layers.1.self_attn.k_proj.weight"  # [96, 192]: scales [1, 2]
    assert tensors[name + "_scale_inv"].shape == (1, 2)

    bad = dict(tensors)
    bad[name + "_scale_inv"] = torch.ones(2, 1)
    source = open_model_source(str(write_folder(tmp_path / "bad", bad, config)))
    with pytest.raises(ModelLoadError, match=r"k_proj\.weight_scale_inv.*\[2, 1\].*\[1, 2\]"):
        list(source.iter_weights())

    missing = {n: t for n, t in tensors.items() if n != name + "_scale_inv"}
    source = open_model_source(str(write_folder(tmp_path / "missing", missing, config)))
    with pytest.raises(ModelLoadError, match=r"k_proj\.weight: float8 weight without its scale"):
        list(source.iter_weights())


@pytest.mark.parametrize(
    "change, message",
    [
        ({"quant_method": "gptq"}, "quant_method 'gptq' is not supported"),
        ({"weight_block_size": None}, "fp8 without weight_block_size"),
        ({"activation_scheme": "static"}, "activation_scheme 'static'"),
        ({"fmt": "e5m2"}, "fmt 'e5m2' is not supported"),
        ({"weight_block_size": [128]}, "not a pair of positive integers"),
    ],
)
def test_other_quantizations_are_refused(folders, tmp_path, change, message):
    _, fp8_folder, _ = folders
    folder = copy_folder(fp8_folder, tmp_path / "other")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {**QUANTIZATION_CONFIG, **change}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        open_model_source(str(folder))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_worker_gets_the_dequantized_weights_in_bf16(folders):
    """On a GPU the fp8 folder runs as its dequantized values cast to bf16 (no blocks)."""
    _, fp8_folder, twin = folders

    def run(path: Path, quantization: str):
        llm = LLM(
            str(path),
            device="cuda",
            dtype="bfloat16",
            quantization=quantization,
            skip_tokenizer_init=True,
            max_model_len=128,
            use_tqdm=False,
        )
        try:
            outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
            return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]
        finally:
            llm.shutdown()

    got, want = run(fp8_folder, "auto"), run(twin, "none")
    assert [t for t, _ in got] == [t for t, _ in want]


def test_qwen3_next_fp8_folder_runs_as_its_dequantized_values(tmp_path, monkeypatch):
    """Qwen3-Next's FP8 layout: the Gated DeltaNet's fused in_proj_qkvz / in_proj_ba and
    out_proj, the gated attention's projections and the shared expert as fp8 blocks (hidden
    64: every block partial), re-blocked into Q8_0 as the dequantized twin is quantized."""
    from tests.model_helpers import build_tiny_hf_model

    require_cpu_kernels()
    monkeypatch.setenv("HYBRIDLLM_CACHE_DIR", str(tmp_path / "cache"))
    source, fp8_folder, twin = write_fp8_twins(build_tiny_hf_model("qwen3_next"), tmp_path)
    fp8_names = {n for n, t in source.items() if is_fp8_linear(n, t)}
    assert {"model.layers.0.linear_attn.in_proj_qkvz.weight",
            "model.layers.0.linear_attn.out_proj.weight",
            "model.layers.3.self_attn.q_proj.weight",
            "model.layers.2.mlp.shared_expert.down_proj.weight"} <= fp8_names  # fmt: skip

    assert greedy_outputs(fp8_folder, "auto") == greedy_outputs(twin, "q8_0")
