"""Tiny random Qwen3-Next and Qwen3.5-MoE Hugging Face models (tests/model_helpers'
LINEAR_ATTENTION_CONFIGS) and their GGUF files as llama.cpp's own `convert_hf_to_gguf.py` and
`llama-quantize` write them (architectures `qwen3next` and `qwen35moe`).

The models keep model_helpers' tiny configs and take SmolLM2's byte-level BPE tokenizer (the
converter only accepts a BPE tokenizer whose pre-tokenizer it knows), so the vocabulary grows to
SmolLM2's. Qwen3.5-MoE's text model is saved as `Qwen3_5MoeForCausalLM` (the converter takes
that name) with its rope as config.json says it (mrope_section and interleave, which the
converter writes as rope dimension sections). Like the released checkpoints, each holds one
multi-token-prediction layer (`mtp.*`, which transformers skips on load): the converter refuses a
Qwen3-Next / Qwen3.5 folder without one unless told --no-mtp, and writes it as block
num_hidden_layers (`blk.4.*`, `nextn_predict_layers` 1), which the loader must skip. Files are
made once under
`gguf_files_root()/linear-tiny-<VERSION>/` and reused.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from tests.gguf_deepseek_helpers import _run, convert, converter_paths, quantize

__all__ = ["KINDS", "QUANT", "converter_paths", "linear_config", "tiny_files"]

VERSION = "v1"
KINDS = ("qwen3_next", "qwen3_5_moe")
QUANT = "Q8_0"


# transformers builds a qwen3_5_moe_text folder's tokenizer as Qwen3_5Tokenizer, which replaces
# tokenizer.json's pre-tokenizer with Qwen3.5's regex; over SmolLM2's vocabulary that gives the
# converter a pre-tokenizer hash it does not know, so it refuses. The converter is run with the
# folder's own tokenizer.json instead (as for any model_type without a tokenizer class).
_CONVERT_WITH_FOLDER_TOKENIZER = """
import runpy, sys
from transformers.models.auto import tokenization_auto
tokenization_auto.TOKENIZER_MAPPING_NAMES["qwen3_5_moe_text"] = "TokenizersBackend"
script = sys.argv[1]
sys.path.insert(0, script.rsplit("/", 1)[0])
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


def linear_config(kind: str, vocab_size: int):
    """LINEAR_ATTENTION_CONFIGS[kind] with the tokenizer's vocabulary. Qwen3-Next's layers are
    all MoE (mlp_only_layers []): llama.cpp's qwen3next has no dense-FFN tensors, so the
    converter cannot map the tiny config's dense layer 1 (nor does a released model have one)."""
    from tests.model_helpers import tiny_config

    config = tiny_config(kind)
    config.vocab_size = vocab_size
    if kind == "qwen3_next":
        config.mlp_only_layers = []
    return config


def _convert(kind: str, folder: Path, out: Path) -> Path:
    """`folder` converted to an F32 file by llama.cpp's convert_hf_to_gguf.py (once)."""
    if kind != "qwen3_5_moe":
        return convert(folder, out, "f32")
    if out.is_file():
        return out
    paths = converter_paths()
    assert paths is not None, "llama.cpp's converter is not built"
    script, bin_dir = paths
    tmp = out.with_name(out.name + ".tmp")
    cmd = [sys.executable, "-c", _CONVERT_WITH_FOLDER_TOKENIZER, script, folder]
    _run([*cmd, "--outtype", "f32", "--outfile", tmp], bin_dir, out.with_suffix(".log"))
    tmp.rename(out)
    return out


def make_hf_folder(kind: str, folder: Path, seed: int = 0) -> Path:
    """The tiny random `kind` model saved with SmolLM2's tokenizer (once)."""
    if (folder / "config.json").is_file():
        return folder
    import torch

    from hybridllm.loader.default_model import default_model_path
    from hybridllm.loader.open_model import load_tokenizer
    from tests.model_helpers import random_eager_model

    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok = load_tokenizer(default_model_path())
    tok.save_pretrained(tmp)
    torch.manual_seed(seed)
    config = linear_config(kind, len(tok))
    config.bos_token_id, config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    model = random_eager_model(config)
    model.save_pretrained(tmp)
    _add_mtp_layer(tmp, config.num_hidden_layers, seed)
    tmp.rename(folder)
    return folder


def tiny_files(kind: str, root: Path | None = None) -> dict[str, Path]:
    """{"hf": folder, "F32": file, QUANT: file} for `kind`, made once under `root`."""
    if root is None:
        from tests.llamacpp_helpers import gguf_files_root

        root = gguf_files_root() / f"linear-tiny-{VERSION}"
    root.mkdir(parents=True, exist_ok=True)
    hf = make_hf_folder(kind, root / f"{kind}-hf")
    f32 = _convert(kind, hf, root / f"{kind}-F32.gguf")
    return {"hf": hf, "F32": f32, QUANT: quantize(f32, root / f"{kind}-{QUANT}.gguf", QUANT)}


def _add_mtp_layer(folder: Path, num_layers: int, seed: int) -> None:
    """The checkpoints' MTP head: `mtp.layers.0.*` (a copy of the last, full-attention decoder
    layer), `mtp.fc` [H, 2H] and the norms pre_fc_norm_embedding, pre_fc_norm_hidden, norm."""
    import torch
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    sd = load_file(str(path))
    last = f"model.layers.{num_layers - 1}."
    g = torch.Generator().manual_seed(seed + 1)
    extra = {
        "mtp.layers.0." + k[len(last) :]: v.clone() for k, v in sd.items() if k.startswith(last)
    }
    hidden = sd["model.norm.weight"].shape[0]
    extra["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=g) / (2 * hidden) ** 0.5
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        extra[f"mtp.{norm}.weight"] = 0.2 * torch.randn(hidden, generator=g)
    save_file({**sd, **extra}, str(path), metadata={"format": "pt"})
