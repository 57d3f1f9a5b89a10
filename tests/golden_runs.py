"""Greedy runs whose tokens and logprobs are saved in tests/data/golden_outputs.json.

The values were produced by `python -m tests.golden_runs` on the code before the structure
refactor (issue 38, commit 82e09a2), which read the GGUF activations from
HYBRIDLLM_GGUF_ACTIVATIONS (the cases' `gguf_activations` were that variable in its runs);
tests/integration/test_golden_outputs.py reruns every case on the current code and compares.
Session 33 saved the `smollm2` and `smollm2_bf16` cases again (`python -m tests.golden_runs OUT
smollm2 smollm2_bf16`, merged): the embedded model's Q4_1 and Q8_0 weights then computed in x8
groups, whose int8 activations round otherwise, and a near tie in a decode step (logprobs 0.04
apart; both runs 0.1-0.24 from the fp32-activation case's, as before) picked another token.
Each case builds its model the same way every time (fixed seeds).

Those values come from AVX512-VNNI builds. A build without it (AVX2: Zen 2 and 3, Intel before
Ice Lake) computes the int8 activations of the embedded model's weights with other kernels and
rounding, so its greedy tokens part from them (logprobs 0.04-0.3 apart, Session 37 on a Zen 3);
Session 37 saved every case on such a CPU into tests/data/golden_outputs_avx2.json, which such
builds compare with (`golden_path`; its later saves: tests/integration/test_golden_outputs.py).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import gguf
import torch

from hybridllm import LLM, SamplingParams
from hybridllm.layers.cpu_kernels import _cpu_fingerprint as cpu_fingerprint
from tests.gguf_helpers import write_k_m_like_gguf
from tests.kernel_helpers import require_cpu_kernels
from tests.model_helpers import make_tiny_model
from tests.moe_helpers import make_tiny_moe_model

GOLDEN_DIR = Path(__file__).parent / "data"
NEW_TOKENS = 12
TOP_LOGPROBS = 3


def golden_path(int8_paths: list[int]) -> Path | None:
    """The saved outputs for a build with these int8 paths (`gguf_int8_paths()`): AVX512-VNNI
    (path 2) builds' or AVX2 (path 4) builds'; None for a build with neither."""
    if 2 in int8_paths:
        return GOLDEN_DIR / "golden_outputs.json"
    if 4 in int8_paths:
        return GOLDEN_DIR / "golden_outputs_avx2.json"
    return None


def this_build_golden_path() -> Path | None:
    require_cpu_kernels()
    return golden_path(list(torch.ops.hybridllm.gguf_int8_paths()))


# name -> (how to build the model folder/file, LLM keyword arguments)
CASES: dict[str, tuple[str, dict]] = {
    "smollm2": ("embedded", dict(dtype="float32", gguf_activations="int8")),
    "smollm2_bf16": ("embedded", dict(dtype="bfloat16", gguf_activations="int8")),
    "smollm2_fp32_activations": ("embedded", dict(dtype="float32", gguf_activations="fp32")),
    "llama": ("dense:llama", dict(dtype="float32", block_size=4)),
    "qwen3": ("dense:qwen3", dict(dtype="float32", block_size=4)),
    "opt": ("dense:opt", dict(dtype="float32", block_size=4)),
    "qwen3_moe": ("moe:qwen3_moe", dict(dtype="float32", block_size=4)),
    "mixtral": ("moe:mixtral", dict(dtype="float32", block_size=4)),
    "q4_k_m_like": ("gguf:Q4_K", dict(dtype="float32", block_size=16, gguf_activations="int8")),
    "q4_k_m_like_fp32_activations": (
        "gguf:Q4_K",
        dict(dtype="float32", block_size=16, gguf_activations="fp32"),
    ),
    "llama_pp2": ("dense:llama", dict(dtype="float32", block_size=4, pipeline_parallel_size=2)),
    "qwen3_tp2": ("dense:qwen3", dict(dtype="float32", block_size=4, tensor_parallel_size=2)),
}


def _prompts(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab - 3, (n,), generator=generator).tolist() for n in (4, 11, 19)]


def build_model(kind: str, folder: Path) -> str | None:
    """The model path of a case (None: the embedded default model)."""
    if kind == "embedded":
        return None
    family, _, name = kind.partition(":")
    if family == "dense":
        return str(make_tiny_model(name, folder / name))
    if family == "moe":
        return str(make_tiny_moe_model(name, folder / name))
    if family == "gguf":
        base = gguf.GGMLQuantizationType[name]
        return str(write_k_m_like_gguf(folder / f"{name}.gguf", base))
    raise ValueError(f"unknown case kind {kind!r}")


def run_case(name: str, folder: Path) -> dict:
    """Greedy tokens and the top logprobs of each step, for every prompt of the case."""
    kind, kwargs = CASES[name]
    model = build_model(kind, folder)
    llm = LLM(model, max_model_len=128, use_tqdm=False, **kwargs)
    try:
        vocab = llm.llm_engine.config.model_config.vocab_size
        params = SamplingParams(
            temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP_LOGPROBS
        )
        prompts = [{"prompt_token_ids": ids} for ids in _prompts(vocab)]
        outputs = llm.generate(prompts, params)
    finally:
        llm.shutdown()
    results = []
    for out in outputs:
        completion = out.outputs[0]
        steps = [
            sorted((int(tok), float(lp.logprob)) for tok, lp in step.items())
            for step in completion.logprobs
        ]
        results.append({"tokens": list(completion.token_ids), "logprobs": steps})
    return {"results": results}


def main() -> None:
    """`python -m tests.golden_runs [OUT [CASE ...]]`: the cases (all by default) into OUT."""
    golden = {"cpu_fingerprint": cpu_fingerprint()}
    names = sys.argv[2:] or list(CASES)
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            golden[name] = run_case(name, Path(tmp))
            print(name, [r["tokens"][:6] for r in golden[name]["results"]], file=sys.stderr)
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else this_build_golden_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(golden, indent=1) + "\n")


if __name__ == "__main__":
    main()
