"""GPU check per model family: fp32 greedy tokens on the GPU, on GPU + CPU splits and with the
routed experts on the CPU (`cpu_moe`) equal the CPU-only run's, for a tiny random model of each
family the engine supports (Llama, Gemma 3, Qwen3-MoE, gpt-oss, DeepSeek-V3 MLA, Qwen3-Next
linear attention, a K-quant GGUF Llama).

  python scripts/gpu_families.py --make DIR     # here (CPU, transformers): write the models
  python scripts/gpu_families.py --models DIR   # on the GPU machine: run and compare

Models are written where transformers and the tests' helpers are at their pinned versions and
carried to the GPU machine, whose image has its own transformers. Each case prints one line
(`PASS`, `DIFF` with where and how close, or `ERROR` with the exception) and goes on.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# name -> whether its routed experts can go to the CPU
FAMILIES: dict[str, bool] = {
    "llama": False,
    "gemma3": False,
    "qwen3_moe": True,
    "gpt_oss": True,
    "deepseek_v3": True,
    "qwen3_next": True,
    "gguf_q4_k_m": False,
}
GGUF_LAYERS = 2  # write_k_m_like_gguf's
PROMPTS = [
    {"prompt_token_ids": [5, 17, 42, 99, 7]},
    # longer than one 64-token DeltaNet chunk and a few KV blocks
    {"prompt_token_ids": [(7 * i + 3) % 250 + 3 for i in range(90)]},
]


def make(root: Path) -> None:
    import gguf

    from tests.deepseek_helpers import make_tiny_deepseek_model
    from tests.gguf_helpers import write_k_m_like_gguf
    from tests.model_helpers import make_tiny_model
    from tests.moe_helpers import make_tiny_moe_model

    root.mkdir(parents=True, exist_ok=True)
    for name in ("llama", "gemma3", "gpt_oss", "qwen3_next"):
        make_tiny_model(name, root / name)
    make_tiny_moe_model("qwen3_moe", root / "qwen3_moe")
    make_tiny_deepseek_model("deepseek_v3", root / "deepseek_v3")
    (root / "gguf_q4_k_m").mkdir(exist_ok=True)
    write_k_m_like_gguf(root / "gguf_q4_k_m" / "model.gguf", gguf.GGMLQuantizationType.Q4_K)


def model_path(root: Path, name: str) -> str:
    folder = root / name
    ggufs = sorted(folder.glob("*.gguf"))
    return str(ggufs[0] if ggufs else folder)


def generate(path: str, **kwargs: Any) -> list[tuple[list[int], list[dict]]]:
    from hybridllm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    llm = LLM(path, dtype="float32", max_model_len=256, use_tqdm=False, **kwargs)
    try:
        outs = llm.generate(PROMPTS, params)
    finally:
        llm.shutdown()
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


def compare(got, want) -> str:
    """'PASS', or where the first token differs and how far apart the reference's choices were."""
    notes = []
    for i, ((gt, glp), (wt, wlp)) in enumerate(zip(got, want)):
        for pos, (a, b) in enumerate(zip(gt, wt)):
            if a != b:
                gap = wlp[pos][b].logprob - wlp[pos][a].logprob if a in wlp[pos] else float("inf")
                notes.append(f"prompt {i} differs at {pos} ({a} vs {b}, reference gap {gap:.4g})")
                break
        else:
            err = max(abs(g[t].logprob - w[t].logprob) for g, w, t in zip(glp, wlp, gt))
            notes.append(f"prompt {i} equal (logprob max diff {err:.2e})")
    ok = all("equal" in n for n in notes)
    return ("PASS " if ok else "DIFF ") + "; ".join(notes)


def num_layers(root: Path, name: str) -> int:
    config = root / name / "config.json"
    if not config.exists():
        return GGUF_LAYERS
    cfg = json.loads(config.read_text())
    return cfg.get("text_config", cfg)["num_hidden_layers"]


def cases(root: Path, name: str, with_mp: bool) -> list[tuple[str, dict]]:
    split = {"device": "heterogeneous", "gpu_layers": num_layers(root, name) // 2}
    out = [("cuda", {"device": "cuda"}), ("gpu+cpu pp uni", split)]
    if with_mp:
        out.append(("gpu+cpu pp mp", {**split, "distributed_executor_backend": "mp"}))
    if FAMILIES[name]:
        out.append(("cuda + cpu_moe", {"device": "auto", "cpu_moe": True}))
    return out


def check(root: Path, names: list[str], with_mp: bool) -> int:
    failures = 0
    for name in names:
        path = model_path(root, name)
        try:
            want = generate(path, device="cpu")
        except Exception as exc:  # noqa: BLE001: report and go on to the next family
            traceback.print_exc()
            print(f"{name}: cpu reference ERROR {type(exc).__name__}: {exc}", flush=True)
            failures += 1
            continue
        for label, kwargs in cases(root, name, with_mp):
            try:
                result = compare(generate(path, **kwargs), want)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                result = f"ERROR {type(exc).__name__}: {str(exc)[:400]}"
            failures += not result.startswith("PASS")
            print(f"{name}: {label}: {result}", flush=True)
    return failures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--make", type=Path, help="write the tiny models under this folder")
    ap.add_argument("--models", type=Path, help="check the models under this folder")
    ap.add_argument("--only", default=",".join(FAMILIES), help="comma-separated families")
    ap.add_argument("--mp", action="store_true", help="also a GPU + CPU split under mp workers")
    args = ap.parse_args()
    if args.make:
        make(args.make)
    if args.models:
        sys.exit(1 if check(args.models, args.only.split(","), args.mp) else 0)


if __name__ == "__main__":  # mp workers are spawned and re-import this module: guard main()
    main()
