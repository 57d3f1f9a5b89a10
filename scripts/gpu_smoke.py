"""GPU smoke check: a real GPU stage beside a real CPU stage gives what GPU-only gives."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

# hybridllm and the tests' helpers from this checkout, wherever the script is started from
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridllm import LLM, SamplingParams  # noqa: E402
from tests.model_helpers import make_tiny_model, tiny_config  # noqa: E402

PROMPTS = [{"prompt_token_ids": [5, 17, 42, 99, 7]}, {"prompt_token_ids": list(range(3, 40))}]
# Logprobs of one position may differ this much between a GPU and a CPU in bf16: activations
# are rounded to 8 bits of mantissa at different points (fused kernels, accumulation order).
BF16_LOGPROB_ATOL = 0.15
FP32_LOGPROB_ATOL = 1e-3

Generation = tuple[list[int], list[dict], list[dict | None]]  # tokens, logprobs, prompt lps


def generate(llm: LLM, params: SamplingParams) -> list[Generation]:
    outs = llm.generate(PROMPTS, params)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs, o.prompt_logprobs) for o in outs]


def assert_close_generation(got: Generation, want: Generation, atol: float) -> str:
    """Prompt logprobs within `atol` at every position; sampled tokens equal, except that a
    greedy choice may flip where the reference's top two are within `atol` (a near-tie), after
    which the sequences are free to differ. Returns a note on how the tokens compared."""
    got_tokens, got_lps, got_prompt = got
    want_tokens, want_lps, want_prompt = want
    for pos, (g, w) in enumerate(zip(got_prompt, want_prompt)):
        if g is None or w is None:
            assert g is w, f"prompt position {pos}: {g} vs {w}"
            continue
        for tid in w.keys() & g.keys():
            diff = abs(g[tid].logprob - w[tid].logprob)
            assert diff <= atol, f"prompt position {pos}, token {tid}: logprobs differ by {diff}"
    for pos, (gt, wt) in enumerate(zip(got_tokens, want_tokens)):
        g, w = got_lps[pos], want_lps[pos]
        if gt != wt:
            # both candidates must be (near-)best in the reference
            assert gt in w, f"position {pos}: {gt} is not among the reference's top tokens {w}"
            gap = w[wt].logprob - w[gt].logprob
            assert gap <= atol, f"position {pos}: token {gt} != {wt}, {gap} apart (not a tie)"
            return f"tokens equal up to a near-tie at position {pos} (gap {gap:.4f})"
        diff = abs(g[gt].logprob - w[wt].logprob)
        assert diff <= atol, f"position {pos}, token {gt}: logprobs differ by {diff}"
    assert len(got_tokens) == len(want_tokens)
    return "tokens equal"


def check_dtype(path: str, dtype: str, layers: int, cpu_only: bool = False) -> None:
    """GPU-only against three GPU + CPU layouts in `dtype` (`cpu_only`: CPU-only against the
    same layouts over CPU workers, to check this script where no GPU is)."""
    exact = dtype == "float32"
    atol = FP32_LOGPROB_ATOL if exact else BF16_LOGPROB_ATOL
    params = SamplingParams(
        temperature=0, max_tokens=32, ignore_eos=True, logprobs=2, prompt_logprobs=2
    )
    common: dict[str, Any] = dict(dtype=dtype, use_tqdm=False, max_model_len=256)
    ref = LLM(path, device="cpu" if cpu_only else "cuda", **common)
    want = generate(ref, params)
    ref.shutdown()
    split = {"pipeline_parallel_size": 2} if cpu_only else {"gpu_layers": layers // 2}
    for kwargs in (
        {**split, "distributed_executor_backend": "uni"},
        {**split, "distributed_executor_backend": "mp"},
        {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
    ):
        device = "cpu" if cpu_only else "heterogeneous"
        llm = LLM(path, device=device, **common, **kwargs)
        got = generate(llm, params)
        llm.shutdown()
        if exact:
            # fp32: greedy tokens are identical (ties at fp32 rounding are improbable)
            assert [g[0] for g in got] == [w[0] for w in want], (kwargs, got, want)
        notes = [assert_close_generation(g, w, atol) for g, w in zip(got, want)]
        print(f"{dtype} {device} {kwargs} vs one device: {'; '.join(notes)}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated dtypes")
    ap.add_argument("--cpu", action="store_true", help="CPU workers only: check the script")
    args = ap.parse_args()
    path = str(make_tiny_model("llama", tempfile.mkdtemp()))
    layers = tiny_config("llama").num_hidden_layers
    for dtype in args.dtypes.split(","):
        check_dtype(path, dtype, layers, args.cpu)


if __name__ == "__main__":  # mp workers are spawned and re-import this module: guard main()
    main()
