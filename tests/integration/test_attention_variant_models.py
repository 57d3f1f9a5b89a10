"""Gemma 2, Gemma 3, gpt-oss and MiniMax-M2 through the engine against transformers' greedy
tokens: prompts longer than the sliding window, a shared prefix (prefix-cache hits), chunked
prefill, one worker and two pipeline stages; Gemma 3's multimodal folders load their text part."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType

from hybridllm import LLM
from hybridllm.layers.fused_moe import FusedMoE
from hybridllm.loader.hf_config import HFConfig
from tests.integration.test_moe_models_vs_hf import ENGINE_KWARGS, MAX_TOKENS, PARAMS
from tests.model_helpers import random_eager_model, tiny_config
from tests.moe_helpers import hf_greedy

# windows of 8 tokens but MiniMax-M2's (tests/model_helpers.py), which saves its checkpoint
# names (block_sparse_moe, experts.N.w1)
ARCHS = ("gemma2", "gemma3", "gpt_oss", "minimax_m2")


def make_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 320, (13,), generator=g).tolist()
    # a shared 13-token prefix, then lengths up to 35: all but one longer than the window
    tails = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (22, 4)]
    single = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (3, 19)]
    return [shared + t for t in tails] + single


def generate(model: str, **kwargs) -> list[list[int]]:
    llm = LLM(model, **{**ENGINE_KWARGS, **kwargs})
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in make_prompts()], PARAMS)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module", params=ARCHS)
def saved_model(request, tmp_path_factory):
    """(saved HF folder, HF's greedy tokens for every prompt)."""
    torch.manual_seed(0)
    hf = random_eager_model(tiny_config(request.param))
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return path, [hf_greedy(hf, p, MAX_TOKENS) for p in make_prompts()]


def test_single_worker_matches_hf(saved_model):
    path, want = saved_model
    assert generate(str(path)) == want


def test_without_prefix_caching_and_in_two_stages(saved_model):
    path, want = saved_model
    assert generate(str(path), enable_prefix_caching=False, max_num_batched_tokens=64) == want
    got = generate(str(path), pipeline_parallel_size=2, distributed_executor_backend="mp")
    assert got == want


def test_gemma3_multimodal_folder_runs_its_text_part(tmp_path):
    text = tiny_config("gemma3")
    vision = transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = transformers.Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4
    )
    torch.manual_seed(1)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "language_model" in name and "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
    hf.generation_config.eos_token_id = None
    hf.save_pretrained(tmp_path)
    names = json.loads((tmp_path / "config.json").read_text())
    assert names["architectures"] == ["Gemma3ForConditionalGeneration"]
    want = [hf_greedy(hf, p, MAX_TOKENS) for p in make_prompts()]
    assert generate(str(tmp_path)) == want


def test_gemma3_config_defaults_derive_the_layer_kinds():
    # gemma-3-4b-it's config.json gives only a few text fields; the rest are the defaults
    config = HFConfig(
        {
            "architectures": ["Gemma3ForConditionalGeneration"],
            "model_type": "gemma3",
            "text_config": {
                "hidden_size": 2560,
                "intermediate_size": 10240,
                "model_type": "gemma3_text",
                "num_hidden_layers": 34,
                "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                "sliding_window": 1024,
            },
        }
    )
    assert config.architectures == ["Gemma3ForConditionalGeneration"]
    assert (config.vocab_size, config.head_dim, config.query_pre_attn_scalar) == (262208, 256, 256)
    kinds = config.layer_types
    assert len(kinds) == 34 and kinds[5] == kinds[11] == "full_attention"
    assert kinds.count("full_attention") == 5 and kinds[0] == "sliding_attention"
    from hybridllm.models.gemma import gemma_rope_parameters

    assert gemma_rope_parameters(config, "full_attention")["rope_type"] == "linear"
    assert gemma_rope_parameters(config, "sliding_attention") == {
        "rope_type": "default",
        "rope_theta": 10000.0,
    }


def test_gpt_oss_mxfp4_folder_runs_its_experts_from_the_blocks(tmp_path):
    """A folder as gpt-oss ships: experts as `*_blocks` + `*_scales` (quant_method mxfp4). The
    engine keeps them as MXFP4 blocks and matches transformers holding the decoded floats."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    config = tiny_config("gpt_oss")
    config.intermediate_size = 64  # MXFP4 rows are whole 32-weight blocks: hidden 64, inter 64
    torch.manual_seed(2)
    hf = random_eager_model(config)
    experts, hidden, inter = config.num_local_experts, config.hidden_size, 64
    g = torch.Generator().manual_seed(3)

    def packed(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = torch.randint(
            0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8, generator=g
        )
        scales = torch.randint(
            122, 126, (experts, rows, cols // 32), dtype=torch.uint8, generator=g
        )
        return blocks, scales

    shipped = {}
    for layer_idx, layer in enumerate(hf.model.layers):
        prefix = f"model.layers.{layer_idx}.mlp.experts."
        for name, (rows, cols) in (
            ("gate_up_proj", (2 * inter, hidden)),
            ("down_proj", (hidden, inter)),
        ):
            blocks, scales = packed(rows, cols)
            shipped[prefix + name + "_blocks"], shipped[prefix + name + "_scales"] = blocks, scales
            with torch.no_grad():  # [E, cols, rows]: transformers' x @ W layout
                getattr(layer.mlp.experts, name).copy_(
                    convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
                )
    hf.save_pretrained(tmp_path)
    tensors = {
        k: v
        for k, v in load_file(tmp_path / "model.safetensors").items()
        if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))
    }
    save_file({**tensors, **shipped}, str(tmp_path / "model.safetensors"))
    values = json.loads((tmp_path / "config.json").read_text())
    values["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(values))
    want = [hf_greedy(hf, p, MAX_TOKENS) for p in make_prompts()]
    llm = LLM(str(tmp_path), **ENGINE_KWARGS)
    try:
        model = llm.llm_engine.executor.workers[0].model_runner.model
        kept = {m.w13.ggml_type for m in model.modules() if isinstance(m, FusedMoE)}
        kept |= {m.w2.ggml_type for m in model.modules() if isinstance(m, FusedMoE)}
        assert kept == {int(GGMLQuantizationType.MXFP4)}  # never inflated to floats
        outs = llm.generate([{"prompt_token_ids": p} for p in make_prompts()], PARAMS)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
    finally:
        llm.shutdown()
