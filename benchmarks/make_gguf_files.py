"""Real GGUF files of every block type, made by llama.cpp's own tools from a random-weight model.

Builds a random-weight Llama as a Hugging Face folder (seeded; SmolLM2's tokenizer and its
49,152-token vocabulary, taken from the embedded model's GGUF file), converts it to F16 GGUF with
llama.cpp's `convert_hf_to_gguf.py` (run with this interpreter), makes an importance matrix with
`llama-imatrix` over this repository's own documentation, and quantizes the F16 file with
`llama-quantize` to each file type. Two models:

- `1b`: Llama-3.2-1B's shape (hidden 2048, intermediate 8192, 16 layers, 32 heads, 8 KV heads,
  tied embeddings, llama3 rope scaling) into `OUT/` (about 2.5 GB at F16, 16 GB for all types);
- `tiny`: hidden 256, intermediate 768, 4 layers, 4 heads, 2 KV heads, same vocabulary, into
  `OUT/tiny/` (for tests: tests/integration/test_gguf_vs_llamacpp.py makes them itself).

Idempotent: every step is skipped when its output exists (outputs are written under a temporary
name and renamed when complete). Usage:

    .venv/bin/python benchmarks/make_gguf_files.py [--models 1b tiny] [--types Q4_K_M ...]
        [--out /work/gguf-files] [--llamacpp-bin DIR]

llama.cpp's tools come from `--llamacpp-bin`, else `$HYBRIDLLM_LLAMACPP_BIN`, else the folder
`../shared/tools/build_llamacpp.sh` prints (it builds llama.cpp when it is not built yet).
The converter runs from the llama.cpp source beside that bin folder (`convert_hf_to_gguf.py`, its
own `gguf-py`); it needs torch, numpy, safetensors, sentencepiece and transformers, all in .venv.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = Path("/work/gguf-files")

# The order files are made in: what other work waits for first.
ALL_TYPES = [
    "Q4_K_M", "Q8_0", "Q3_K_M", "Q2_K", "IQ4_XS", "IQ4_NL", "Q5_0", "Q5_1",
    "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M",
]  # fmt: skip


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    subdir: str  # under OUT


SHAPES = {
    "1b": Shape("1b", 2048, 8192, 16, 32, 8, ""),
    "tiny": Shape("tiny", 256, 768, 4, 4, 2, "tiny"),
}
SEED = 1234
IMATRIX_CHUNKS = 4
IMATRIX_CTX = 512


def log(msg: str) -> None:
    print(f"[make_gguf_files {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- llama.cpp -----------------------------------------------------------------------------------


def build_script() -> Path | None:
    for cand in (
        REPO.parent / "shared/tools/build_llamacpp.sh",
        Path("/work/shared/tools/build_llamacpp.sh"),
    ):
        if cand.is_file():
            return cand
    return None


def find_llamacpp_bin(explicit: str | os.PathLike | None = None, build: bool = True) -> Path | None:
    """llama.cpp's bin folder (llama-quantize, llama-imatrix, llama-bench, llama-server), or None.

    `explicit`, else $HYBRIDLLM_LLAMACPP_BIN, else the folder build_llamacpp.sh prints; with
    `build=False` the script's folder is only computed (nothing is built) and returned if built.
    """
    for cand in (explicit, os.environ.get("HYBRIDLLM_LLAMACPP_BIN")):
        if cand:
            path = Path(cand)
            return path if (path / "llama-quantize").is_file() else None
    script = build_script()
    if script is None:
        return None
    if not build:
        v = os.environ.get("LLAMA_CPP_PY_VERSION", "0.3.36")
        work = os.environ.get("LLAMA_CPP_WORK") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "llamacpp-build"
        )
        path = Path(work) / f"llama_cpp_python-{v}/vendor/llama.cpp/build/bin"
        needed = ("llama-quantize", "llama-imatrix", "llama-server")
        return path if all((path / n).is_file() for n in needed) else None
    out = subprocess.run(["bash", str(script)], check=True, capture_output=True, text=True)
    path = Path(out.stdout.strip().splitlines()[-1])
    return path if (path / "llama-quantize").is_file() else None


def llamacpp_env(bin_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = f"{bin_dir}:{env.get('LD_LIBRARY_PATH', '')}".rstrip(":")
    return env


def llamacpp_source(bin_dir: Path) -> Path:
    return bin_dir.parent.parent  # .../llama.cpp/build/bin


def run_tool(cmd: list, bin_dir: Path, log_path: Path) -> None:
    cmd = [str(c) for c in cmd]
    with open(log_path, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(cmd, env=llamacpp_env(bin_dir), stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{cmd[0]} failed ({proc.returncode}), log {log_path}:\n{tail}")


# ---- the random model ----------------------------------------------------------------------------


def smollm2_tokenizer():
    from hybridllm.loader.default_model import default_model_path
    from hybridllm.loader.open_model import load_tokenizer

    return load_tokenizer(default_model_path())


def llama_config(shape: Shape, vocab: int, bos: int, eos: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.hidden // shape.heads,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=True,
        bos_token_id=bos,
        eos_token_id=eos,
        torch_dtype="float16",
    )


def random_state_dict(shape: Shape, vocab: int, seed: int):
    """Seeded random weights, scaled so activations stay sane through the layers.

    Linear weights are N(0, 1/fan_in) (unit-variance outputs for unit-variance inputs); the
    projections back into the residual stream are scaled down by sqrt(2 * layers) so the stream
    grows slowly; norms are 1 +- 0.1. The tied embedding is N(0, (2/sqrt(hidden))^2), so after
    the final norm the logits have a standard deviation of about 2: a distribution peaked enough
    that greedy tokens and logprobs tell quantization errors apart.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    h, inter, hd = shape.hidden, shape.intermediate, shape.hidden // shape.heads
    resid = 1.0 / math.sqrt(2 * shape.layers)

    def randn(rows: int, cols: int, std: float) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) * std).to(torch.float16)

    def norm() -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(h, generator=g)).to(torch.float16)

    sd = {"model.embed_tokens.weight": randn(vocab, h, 2.0 / math.sqrt(h))}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm()
        sd[p + "self_attn.q_proj.weight"] = randn(shape.heads * hd, h, 1 / math.sqrt(h))
        sd[p + "self_attn.k_proj.weight"] = randn(shape.kv_heads * hd, h, 1 / math.sqrt(h))
        sd[p + "self_attn.v_proj.weight"] = randn(shape.kv_heads * hd, h, 1 / math.sqrt(h))
        sd[p + "self_attn.o_proj.weight"] = randn(h, shape.heads * hd, resid / math.sqrt(h))
        sd[p + "post_attention_layernorm.weight"] = norm()
        sd[p + "mlp.gate_proj.weight"] = randn(inter, h, 1 / math.sqrt(h))
        sd[p + "mlp.up_proj.weight"] = randn(inter, h, 1 / math.sqrt(h))
        sd[p + "mlp.down_proj.weight"] = randn(h, inter, resid / math.sqrt(inter))
    sd["model.norm.weight"] = norm()
    return sd


def make_hf_folder(shape: Shape, folder: Path, seed: int = SEED) -> Path:
    if (folder / "config.json").is_file():
        return folder
    from safetensors.torch import save_file

    log(f"{shape.name}: random HF model -> {folder}")
    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    tok = smollm2_tokenizer()
    tok.save_pretrained(tmp)
    config = llama_config(shape, len(tok), tok.bos_token_id, tok.eos_token_id)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(tmp)
    sd = random_state_dict(shape, len(tok), seed)
    save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    with open(tmp / "generation_config.json", "w") as f:
        json.dump({"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}, f)
    tmp.rename(folder)
    return folder


# ---- conversion, imatrix, quantization -----------------------------------------------------------


def imatrix_text(path: Path, min_chars: int) -> Path:
    """This repository's own documentation (and code, if the docs run short): local text."""
    if path.is_file():
        return path
    parts: list[str] = []
    for pattern in ("README.md", "docs/**/*.md", "hybridllm/**/*.py"):
        for p in sorted(REPO.glob(pattern)):
            parts.append(p.read_text(errors="replace"))
            if sum(map(len, parts)) >= min_chars:
                break
        if sum(map(len, parts)) >= min_chars:
            break
    path.write_text("\n\n".join(parts))
    return path


def model_prefix(shape: Shape) -> str:
    return f"random-llama-{shape.name}"


def quant_path(out: Path, shape: Shape, type_name: str) -> Path:
    return out / shape.subdir / f"{model_prefix(shape)}.{type_name}.gguf"


def make_f16(shape: Shape, out: Path, bin_dir: Path) -> Path:
    folder = out / shape.subdir
    folder.mkdir(parents=True, exist_ok=True)
    f16 = quant_path(out, shape, "F16")
    if f16.is_file():
        return f16
    hf = make_hf_folder(shape, folder / f"{model_prefix(shape)}-hf")
    log(f"{shape.name}: convert_hf_to_gguf.py -> {f16}")
    tmp = f16.with_suffix(".tmp")
    src = llamacpp_source(bin_dir)
    run_tool(
        [sys.executable, src / "convert_hf_to_gguf.py", hf, "--outtype", "f16", "--outfile", tmp],
        bin_dir,
        folder / "convert.log",
    )
    tmp.rename(f16)
    return f16


def make_imatrix(shape: Shape, out: Path, bin_dir: Path, f16: Path, threads: int) -> Path:
    folder = out / shape.subdir
    imatrix = folder / f"{model_prefix(shape)}.imatrix.gguf"
    if imatrix.is_file():
        return imatrix
    text = imatrix_text(folder / "imatrix-text.txt", IMATRIX_CHUNKS * IMATRIX_CTX * 6)
    log(f"{shape.name}: llama-imatrix ({IMATRIX_CHUNKS} chunks of {IMATRIX_CTX}) -> {imatrix}")
    tmp = imatrix.with_name(imatrix.name + ".tmp.gguf")
    run_tool(
        [
            bin_dir / "llama-imatrix",
            "-m",
            f16,
            "-f",
            text,
            "-o",
            tmp,
            "-c",
            IMATRIX_CTX,
            "--chunks",
            IMATRIX_CHUNKS,
            "-t",
            threads,
            "--no-ppl",
        ],
        bin_dir,
        folder / "imatrix.log",
    )
    tmp.rename(imatrix)
    return imatrix


def make_quant(
    shape: Shape, out: Path, bin_dir: Path, f16: Path, imatrix: Path, type_name: str, threads: int
) -> Path:
    path = quant_path(out, shape, type_name)
    if path.is_file():
        return path
    log(f"{shape.name}: llama-quantize {type_name} -> {path}")
    tmp = path.with_name(path.name + ".tmp")
    run_tool(
        [bin_dir / "llama-quantize", "--imatrix", imatrix, f16, tmp, type_name, threads],
        bin_dir,
        out / shape.subdir / f"quantize-{type_name}.log",
    )
    tmp.rename(path)
    return path


def make_files(
    shape_name: str,
    out: Path = DEFAULT_OUT,
    types: list[str] | None = None,
    bin_dir: Path | None = None,
    threads: int = 2,
) -> dict[str, Path]:
    """Every file of one model: {"F16": path, type: path, ...} (existing ones are kept)."""
    bin_dir = bin_dir or find_llamacpp_bin()
    if bin_dir is None:
        raise RuntimeError("llama.cpp is not built (../shared/tools/build_llamacpp.sh)")
    shape = SHAPES[shape_name]
    f16 = make_f16(shape, out, bin_dir)
    files = {"F16": f16}
    imatrix = make_imatrix(shape, out, bin_dir, f16, threads)
    for t in types or ALL_TYPES:
        files[t] = make_quant(shape, out, bin_dir, f16, imatrix, t, threads)
    return files


# ---- report --------------------------------------------------------------------------------------


def tensor_types(path: Path) -> dict[str, int]:
    """{ggml type name: number of tensors} of one GGUF file (gguf's reader)."""
    import gguf

    counts: dict[str, int] = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        name = t.tensor_type.name
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def report(files: dict[str, Path]) -> str:
    lines = ["| file | size (MiB) | tensors per type |", "|---|---:|---|"]
    for path in files.values():
        types = ", ".join(f"{k} {v}" for k, v in tensor_types(path).items())
        lines.append(f"| {path.name} | {path.stat().st_size / 2**20:.1f} | {types} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["1b", "tiny"], choices=sorted(SHAPES))
    ap.add_argument("--types", nargs="+", default=ALL_TYPES, help=f"default: {' '.join(ALL_TYPES)}")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--llamacpp-bin", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--report", action="store_true", help="print sizes and tensor types")
    args = ap.parse_args()
    bin_dir = find_llamacpp_bin(args.llamacpp_bin)
    if bin_dir is None:
        sys.exit(
            "llama.cpp's tools not found: --llamacpp-bin DIR or ../shared/tools/build_llamacpp.sh"
        )
    for m in args.models:
        files = make_files(m, args.out, args.types, bin_dir, args.threads)
        if args.report:
            print(report(files), flush=True)


if __name__ == "__main__":
    main()
