"""Tiny random DeepSeek-V2, DeepSeek-V3 and GLM-4.5 (glm4_moe) Hugging Face models, and their
GGUF files as llama.cpp's own `convert_hf_to_gguf.py` and `llama-quantize` write them
(architectures `deepseek2` and `glm4moe`).

The models use SmolLM2's tokenizer (the converter only accepts tokenizers whose pre-tokenizer it
knows), with GLM's special tokens added for glm4_moe. Files are made once under
`gguf_files_root()/deepseek-tiny-<VERSION>/` and reused.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

VERSION = "v1"
KINDS = ("deepseek_v2", "deepseek_v3", "glm4_moe")
# GLM's tokenizer tokens the converter's _set_vocab_glm looks up (<|endoftext|> is SmolLM2's)
GLM_SPECIAL_TOKENS = ["[gMASK]", "<|user|>", "<|observation|>"]
NUM_LAYERS = 3
# llama.cpp reads a deepseek2 file without q_lora_rank only at DeepSeek-V2-Lite's depth (27 or
# 26 layers: its `is_lite`), so the q_lora_rank-less DeepSeek-V2 has 27.
NUM_LAYERS_V2 = 27
NEXTN_LAYERS = 1  # glm4_moe's MTP layer (the converter exports it as blk.3.*, nextn.*)


def converter_paths() -> tuple[Path, Path] | None:
    """(convert_hf_to_gguf.py, the bin folder with llama-quantize), or None when not built."""
    from tests.llamacpp_helpers import make_gguf_files_module

    bin_dir = make_gguf_files_module().find_llamacpp_bin(build=False)
    if bin_dir is None:
        return None
    script = bin_dir.parent.parent / "convert_hf_to_gguf.py"
    return (script, bin_dir) if script.is_file() else None


def tiny_config(kind: str, vocab_size: int, bos: int, eos: int):
    from transformers import DeepseekV2Config, DeepseekV3Config, Glm4MoeConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=NUM_LAYERS_V2 if kind == "deepseek_v2" else NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,  # DeepSeek's configs: as many as the heads (the converter asks)
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=bos,
        eos_token_id=eos,
    )
    mla = dict(kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
    if kind == "deepseek_v2":
        return DeepseekV2Config(
            **common, **mla, q_lora_rank=None, first_k_dense_replace=1, topk_method="greedy",
            norm_topk_prob=False, routed_scaling_factor=1.0, head_dim=16,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )  # fmt: skip
    if kind == "deepseek_v3":
        config = DeepseekV3Config(
            **common, **mla, q_lora_rank=64, first_k_dense_replace=1, n_group=4, topk_group=2,
            norm_topk_prob=True, routed_scaling_factor=2.5, head_dim=16,
            num_nextn_predict_layers=0,
            rope_parameters={
                "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                "original_max_position_embeddings": 32, "mscale": 0.707, "mscale_all_dim": 0.707,
                "beta_fast": 32.0, "beta_slow": 1.0,
            },
        )  # fmt: skip
        # what DeepSeek-V3's config.json says (transformers' class assumes it)
        config.scoring_func = "sigmoid"
        config.topk_method = "noaux_tc"
        return config
    if kind == "glm4_moe":
        return Glm4MoeConfig(
            **common, head_dim=32, first_k_dense_replace=1, n_group=1, topk_group=1,
            norm_topk_prob=True, routed_scaling_factor=1.5, attention_bias=True,
            use_qk_norm=True, num_nextn_predict_layers=NEXTN_LAYERS,
            rope_parameters={
                "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            },
        )  # fmt: skip
    raise ValueError(kind)


def _randomize(model, seed: int) -> None:
    """Every parameter and buffer random, scaled so a tiny model's logits are peaked: norms
    1 +- 0.1, linears N(0, 1/fan_in), the router's correction bias N(0, 0.1)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if not t.is_floating_point() or "rotary" in name or "inv_freq" in name:
                continue
            if "norm" in name:
                t.copy_(1.0 + 0.1 * torch.randn(t.shape, generator=g))
            elif "e_score_correction_bias" in name:
                t.copy_(0.1 * torch.randn(t.shape, generator=g))
            elif name.endswith("bias"):
                t.copy_(0.1 * torch.randn(t.shape, generator=g))
            else:
                fan_in = t.shape[-1]
                t.copy_(torch.randn(t.shape, generator=g) / fan_in**0.5)


def make_hf_folder(kind: str, folder: Path, seed: int = 0) -> Path:
    """The tiny random `kind` model saved with its tokenizer (and glm4_moe's MTP layer added to
    the weights, as GLM-4.5's checkpoints carry it)."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoModelForCausalLM

    from hybridllm.loader.default_model import default_model_path
    from hybridllm.loader.open_model import load_tokenizer

    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok = load_tokenizer(default_model_path())
    if kind == "glm4_moe":
        tok.add_special_tokens({"additional_special_tokens": GLM_SPECIAL_TOKENS})
    tok.save_pretrained(tmp)
    config = tiny_config(kind, len(tok), tok.bos_token_id, tok.eos_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _randomize(model, seed)
    model.save_pretrained(tmp)
    if kind == "glm4_moe":
        _add_mtp_layer(tmp, seed)
    tmp.rename(folder)
    return folder


def _add_mtp_layer(folder: Path, seed: int) -> None:
    """GLM-4.5's checkpoints hold an MTP layer after the last: a copy of the last decoder layer
    with eh_proj, enorm, hnorm, shared_head.norm (transformers skips it on load)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    sd = load_file(str(path))
    last, mtp = f"model.layers.{NUM_LAYERS - 1}.", f"model.layers.{NUM_LAYERS}."
    g = torch.Generator().manual_seed(seed + 1)
    extra = {mtp + k[len(last) :]: v.clone() for k, v in sd.items() if k.startswith(last)}
    hidden = sd["model.norm.weight"].shape[0]
    extra[mtp + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=g)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        extra[mtp + norm + ".weight"] = 1.0 + 0.1 * torch.randn(hidden, generator=g)
    save_file({**sd, **extra}, str(path), metadata={"format": "pt"})


def _run(cmd: list, bin_dir: Path, log_path: Path) -> None:
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = f"{bin_dir}:{env.get('LD_LIBRARY_PATH', '')}".rstrip(":")
    with open(log_path, "w") as f:
        f.write(" ".join(map(str, cmd)) + "\n")
        f.flush()
        proc = subprocess.run([str(c) for c in cmd], env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{cmd[0]} failed ({proc.returncode}), log {log_path}:\n{tail}")


def convert(folder: Path, out: Path, outtype: str = "f32") -> Path:
    """`folder` converted by llama.cpp's convert_hf_to_gguf.py (once)."""
    if out.is_file():
        return out
    paths = converter_paths()
    assert paths is not None, "llama.cpp's converter is not built"
    script, bin_dir = paths
    tmp = out.with_name(out.name + ".tmp")
    _run(
        [sys.executable, script, folder, "--outtype", outtype, "--outfile", tmp],
        bin_dir,
        out.with_suffix(".log"),
    )
    tmp.rename(out)
    return out


def quantize(src: Path, out: Path, type_name: str) -> Path:
    """`src` quantized by llama.cpp's llama-quantize (once)."""
    if out.is_file():
        return out
    paths = converter_paths()
    assert paths is not None, "llama.cpp's llama-quantize is not built"
    _, bin_dir = paths
    tmp = out.with_name(out.name + ".tmp")
    _run([bin_dir / "llama-quantize", src, tmp, type_name], bin_dir, out.with_suffix(".log"))
    tmp.rename(out)
    return out


def tiny_files(kind: str, root: Path | None = None, quant: str | None = None) -> dict[str, Path]:
    """{"hf": folder, "F32": file, quant: file} for `kind`, made once under `root`."""
    if root is None:
        from tests.llamacpp_helpers import gguf_files_root

        root = gguf_files_root() / f"deepseek-tiny-{VERSION}"
    root.mkdir(parents=True, exist_ok=True)
    hf = make_hf_folder(kind, root / f"{kind}-hf")
    files = {"hf": hf, "F32": convert(hf, root / f"{kind}-F32.gguf", "f32")}
    if quant is not None:
        files[quant] = quantize(files["F32"], root / f"{kind}-{quant}.gguf", quant)
    return files


def hf_config_dict(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())
