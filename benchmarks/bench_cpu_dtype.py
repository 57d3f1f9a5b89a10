"""A bf16 Hugging Face checkpoint on the CPU worker: dtype float32 against bfloat16, side by side.

Writes a random Llama-3.2-1B-shaped model (`bench_cpu_gguf.py`'s "1b" shape, the tests' 266-token
vocabulary) as a bf16 safetensors folder, loads it once per dtype, and alternates the two for
`--rounds` rounds: batch-1 decode (NEW_TOKENS after an 8-token prompt), the time to first token
of a PROMPT_LEN-token prompt, and a batch of BATCH prompts decoding together. Reports each
figure's best round and `dtype="auto"`'s choice on this machine.

    python benchmarks/bench_cpu_dtype.py [--shape 1b] [--rounds 3] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_cpu_gguf import SHAPES, random_llama  # noqa: E402
from benchmarks.bench_offline import machine  # noqa: E402

NEW_TOKENS = 64
PROMPT_LEN = 512
BATCH = 16


def write_folder(path: Path, shape: str) -> Path:
    random_llama(shape).to(torch.bfloat16).save_pretrained(path)
    return path


def auto_dtype() -> str:
    """What dtype="auto" picks for this checkpoint on this machine (as EngineArgs decides)."""
    from hybridllm.plan.cpu_dtype import cpu_auto_dtype, cpu_flags
    from hybridllm.plan.hardware_profile import load_or_measure_profile
    from hybridllm.platforms.discovery import discover_hardware

    cpu = load_or_measure_profile(discover_hardware()).cpu
    return cpu_auto_dtype("bfloat16", True, cpu_flags(), lambda: (cpu.fp32_flops, cpu.bf16_flops))


class Engine:
    def __init__(self, folder: Path, dtype: str):
        from hybridllm import LLM

        self.llm = LLM(str(folder), dtype=dtype, skip_tokenizer_init=True, use_tqdm=False)
        self.dtype = self.llm.llm_engine.model_config.dtype
        self.seed = 0

    def prompts(self, n: int, length: int) -> list[dict]:
        self.seed += 1
        g = torch.Generator().manual_seed(self.seed)
        return [{"prompt_token_ids": torch.randint(0, 260, (length,), generator=g).tolist()}
                for _ in range(n)]  # fmt: skip

    def seconds(self, n: int, length: int, new: int) -> float:
        from hybridllm import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        start = time.perf_counter()
        self.llm.generate(self.prompts(n, length), params)
        return time.perf_counter() - start

    def round(self) -> dict[str, float]:
        ttft = self.seconds(1, PROMPT_LEN, 1)
        short = self.seconds(1, 8, 1)
        decode = (NEW_TOKENS - 1) / (self.seconds(1, 8, NEW_TOKENS) - short)
        batch_first = self.seconds(BATCH, 8, 1)
        batch = BATCH * (NEW_TOKENS - 1) / (self.seconds(BATCH, 8, NEW_TOKENS) - batch_first)
        return {"decode_tok_s": decode, f"ttft_{PROMPT_LEN}_s": ttft, f"batch{BATCH}_tok_s": batch}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1b", choices=list(SHAPES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_folder(Path(tmp) / "model", args.shape)
        auto = auto_dtype()
        engines = [Engine(folder, "float32"), Engine(folder, "bfloat16")]
        rounds: dict[str, list[dict[str, float]]] = {e.dtype: [] for e in engines}
        for _ in range(args.rounds):
            for engine in engines:
                rounds[engine.dtype].append(engine.round())
    result = {"machine": machine(), "shape": args.shape, "auto_picks": auto, "rounds": rounds}
    for dtype, runs in rounds.items():
        best = {
            key: (min if key.startswith("ttft") else max)(r[key] for r in runs) for key in runs[0]
        }
        result[dtype] = best
        print(dtype, {k: round(v, 3) for k, v in best.items()})
    print("dtype='auto' picks", auto)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
