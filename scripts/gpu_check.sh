#!/usr/bin/env bash
# GPU checks for a machine with a CUDA GPU (not run by CI): the CUDA-gated tests, which skip on a
# CPU-only machine, plus a heterogeneous smoke run. Run from the repo root after `make setup`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; print(torch.cuda.get_device_name(0))"
# Every test that gates on CUDA runs here; the rest of the suite must still pass.
"$PY" -m pytest -q -p no:cacheprovider tests -rs
# A real GPU stage and a real CPU stage in one model: greedy tokens must equal GPU-only.
"$PY" - <<'PYEOF'
from hybridllm import LLM, SamplingParams
prompts = ["The capital of France is", "def fibonacci(n):"]
p = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
ref = LLM(device="cuda", dtype="float32", use_tqdm=False)
want = [o.outputs[0].token_ids for o in ref.generate(prompts, p)]
ref.shutdown()
for kwargs in ({"gpu_layers": 15}, {"gpu_layers": 15, "distributed_executor_backend": "uni"}):
    llm = LLM(device="heterogeneous", dtype="float32", use_tqdm=False, **kwargs)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]
    llm.shutdown()
    assert got == want, (kwargs, got, want)
    print("heterogeneous", kwargs, "== GPU-only")
PYEOF
"$PY" -m hybridllm plan --device heterogeneous --gpu-layers 15
# GPU + CPU benchmark against accelerate, weight streaming and the bandwidth floor (writes a random
# Llama-3-8B-shaped model, about 16 GB, to the temp dir on its first run; takes minutes).
"$PY" benchmarks/bench_hetero_gpu.py --json "${OUT:-.}/bench_hetero_gpu.json"
