"""Tiny random Gemma 2, Gemma 3, gpt-oss and MiniMax-M2 Hugging Face models (tests/model_helpers'
TINY_CONFIGS) and their GGUF files as llama.cpp's own `convert_hf_to_gguf.py` and
`llama-quantize` write them (architectures `gemma2`, `gemma3`, `gpt-oss`, `minimax-m2`).

A GGUF file carries less than a config.json, so each model is set up as llama.cpp reads it:
Gemma's attention scale is 1/sqrt(head_dim) (llama.cpp has no query_pre_attn_scalar but for
the 27B shapes), Gemma 3 is five sliding layers to a global one (its default pattern), and
gpt-oss's clamp is the 7.0 llama.cpp computes with. Gemma's models get a sentencepiece
vocabulary trained here (what the converter reads for them), gpt-oss and MiniMax-M2 SmolLM2's
byte-level BPE (the converter only takes a BPE tokenizer whose pre-tokenizer it knows). Files are
made once under `gguf_files_root()/variants-tiny-<VERSION>/` and reused.
"""

from __future__ import annotations

import io
import random
import shutil
from pathlib import Path

from tests.gguf_deepseek_helpers import convert, converter_paths, quantize

__all__ = ["KINDS", "QUANTS", "converter_paths", "tiny_files", "variant_config"]

VERSION = "v1"
KINDS = ("gemma2", "gemma3", "gpt_oss", "minimax_m2")
# one quantized file each: Q8_0 for the dense and MiniMax's SiLU experts, gpt-oss's MXFP4 experts
QUANTS = {"gemma2": "Q8_0", "gemma3": "Q8_0", "gpt_oss": "MXFP4_MOE", "minimax_m2": "Q8_0"}
SPM_VOCAB = 200  # pieces trained; the converter pads the vocabulary to the config's 320


def variant_config(kind: str, vocab_size: int):
    """TINY_CONFIGS[kind] as a GGUF file can say it (see the module docstring)."""
    from tests.model_helpers import tiny_config

    config = tiny_config(kind)
    config.vocab_size = vocab_size
    if kind == "gemma2":
        config.query_pre_attn_scalar = config.head_dim
    elif kind == "gemma3":
        config.num_hidden_layers = 6
        config.layer_types = ["sliding_attention"] * 5 + ["full_attention"]
    elif kind == "gpt_oss":
        config.swiglu_limit = 7.0
        config.intermediate_size = 64  # MXFP4 blocks of 32 along each expert's rows
    elif kind == "minimax_m2":
        config.intermediate_size = 64
        config.scoring_func = "sigmoid"  # MiniMax-M2's config.json says so; the converter reads it
    return config


def _spm_tokenizer(folder: Path) -> None:
    """A sentencepiece BPE model trained on model_helpers' corpus (no download), ids 0-3 pad,
    bos, eos, unk as the tiny configs say: tokenizer.model, and GemmaTokenizer's files from it."""
    import sentencepiece as spm
    from transformers import GemmaTokenizer

    from tests.model_helpers import _TOKENIZER_CORPUS

    words = _TOKENIZER_CORPUS.split()
    rng = random.Random(0)
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(400)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, model_type="bpe",
        vocab_size=SPM_VOCAB, hard_vocab_limit=False, add_dummy_prefix=False,
        pad_id=0, bos_id=1, eos_id=2, unk_id=3,
        pad_piece="<pad>", bos_piece="<bos>", eos_piece="<eos>", unk_piece="<unk>",
        minloglevel=2,
    )  # fmt: skip
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    GemmaTokenizer.from_pretrained(folder).save_pretrained(folder)  # converts tokenizer.model


def make_hf_folder(kind: str, folder: Path, seed: int = 0) -> Path:
    """The tiny random `kind` model saved with its tokenizer (once)."""
    if (folder / "config.json").is_file():
        return folder
    import torch

    from tests.model_helpers import random_eager_model

    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if kind.startswith("gemma"):
        _spm_tokenizer(tmp)
        vocab_size = 320
    else:
        from hybridllm.loader.default_model import default_model_path
        from hybridllm.loader.open_model import load_tokenizer

        tok = load_tokenizer(default_model_path())
        tok.save_pretrained(tmp)
        vocab_size = len(tok)
    torch.manual_seed(seed)
    model = random_eager_model(variant_config(kind, vocab_size))
    model.save_pretrained(tmp)
    tmp.rename(folder)
    return folder


def tiny_files(kind: str, root: Path | None = None, outtype: str = "f32") -> dict[str, Path]:
    """{"hf": folder, "F32": file, QUANTS[kind]: file} for `kind`, made once under `root`."""
    if root is None:
        from tests.llamacpp_helpers import gguf_files_root

        root = gguf_files_root() / f"variants-tiny-{VERSION}"
    root.mkdir(parents=True, exist_ok=True)
    hf = make_hf_folder(kind, root / f"{kind}-hf")
    f32 = convert(hf, root / f"{kind}-F32.gguf", outtype)
    quant = QUANTS[kind]
    return {"hf": hf, "F32": f32, quant: quantize(f32, root / f"{kind}-{quant}.gguf", quant)}
