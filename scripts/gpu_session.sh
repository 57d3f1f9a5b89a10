#!/usr/bin/env bash
# Every GPU check of ../shared/GPU_CHECKLIST.md in one device call, most valuable first, each
# step time-boxed and logging under $OUT as it goes (a call stopped at its limit keeps what
# finished). Prepare here first:
#   bash scripts/gpu_wheels.sh                                  # .whl/: packages the image lacks
#   .venv/bin/python scripts/gpu_families.py --make .gpu/models # tiny models of each family
# then run on the device with carry [".whl", ".gpu"]: `BUDGET=400 bash scripts/gpu_session.sh`.
# STEPS picks steps (default: all, as listed below); FAMILIES the families (comma-separated);
# BENCH_ARGS the benchmark's flags. On a fresh machine the native CPU kernels build for
# minutes (2 min 27 s on the first H200 run): the build starts first, in the background, and
# the unit tests and the families run meanwhile with HYBRIDLLM_CPU_KERNELS=0 (their CPU sides on
# the torch paths); the steps after them use the native kernels (KERNELS=0: none at all).
# Background: the CUDA-gated unit tests, then the integration tests on the GPU (`auto` picks
# it). Foreground: per-family greedy tokens (GPU, GPU + CPU, cpu_moe == CPU), the GPU + CPU
# smoke check (fp32 and bf16), `serve --device heterogeneous` with an OpenAI client request and
# `bench serve` at concurrency 1 and 8, then `bench_hetero_gpu.py --shape tiny`.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}
BUDGET=${BUDGET:-400}
STEPS=${STEPS:-"unit integration families smoke serve bench"}
BENCH_ARGS=${BENCH_ARGS:-"--shape tiny"}  # e.g. "--shape 8b --part hybrid,accelerate"
FAMILIES=${FAMILIES:-all}
want() { [[ " $STEPS " == *" $1 "* ]]; }
PY=${PY:-python3}
mkdir -p "$OUT"
start=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - start))); }
step() { echo "== $(date +%T) [$(left)s left] $*" | tee -a "$OUT/env.log"; }

"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/hybridllm-site .whl/*.whl >>"$OUT/env.log" 2>&1
export PYTHONPATH="/tmp/hybridllm-site:$PWD" PATH="/tmp/hybridllm-site/bin:$PATH"
export PYTHONUNBUFFERED=1 HYBRIDLLM_GGUF_ACTIVATIONS=fp32
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-200
  "$PY" -c "import torch, transformers, triton; print(torch.__version__, torch.version.cuda, transformers.__version__, triton.__version__, torch.cuda.get_device_name(0))"
} >>"$OUT/env.log" 2>&1

if [[ ${KERNELS:-1} == 0 ]]; then
  export HYBRIDLLM_CPU_KERNELS=0
else
  step "native CPU kernels build (background)"
  "$PY" -c "from hybridllm.layers.cpu_kernels import load_cpu_kernels as l; print(l())" \
    >"$OUT/build.log" 2>&1 &
fi

step "tests (background)"
(
  export HYBRIDLLM_CPU_KERNELS=0
  if want unit; then
    timeout -s INT 120 "$PY" -m pytest -q -p no:cacheprovider -rfEs --tb=short \
      tests/unit/test_paged_attention.py tests/unit/test_sampler.py \
      tests/unit/test_gguf_dequant_torch.py tests/integration/test_fp8_block_folder.py
  fi
  if want integration; then
    timeout -s INT $(($(left) - 25)) "$PY" -m pytest -v -p no:cacheprovider -rfE --tb=short \
      --timeout 120 tests/integration --ignore=tests/integration/test_smollm2.py \
      --ignore=tests/integration/test_ray_executor.py \
      --ignore=tests/integration/test_fp8_block_folder.py
  fi
) >"$OUT/tests.log" 2>&1 &
tests_pid=$!

if want families; then
  step "families"
  only=(); [[ $FAMILIES == all ]] || only=(--only "$FAMILIES")
  HYBRIDLLM_CPU_KERNELS=0 timeout -s INT 200 \
    "$PY" scripts/gpu_families.py --models .gpu/models "${only[@]}" \
    >"$OUT/families.log" 2>&1
  grep -E "PASS|DIFF|ERROR" "$OUT/families.log" | tee -a "$OUT/env.log"
fi

if want smoke; then
  step "smoke"
  timeout -s INT 90 "$PY" scripts/gpu_smoke.py >"$OUT/smoke.log" 2>&1
  tail -8 "$OUT/smoke.log" >>"$OUT/env.log"
fi

want serve && step "serve" && {
  model=.gpu/models/llama url=http://127.0.0.1:8011
  "$PY" -m hybridllm serve $model --device heterogeneous --gpu-layers 1 --port 8011 \
    --max-model-len 256 &
  server=$!
  for _ in $(seq 90); do
    "$PY" -c "import urllib.request as u; u.urlopen('$url/v1/models')" 2>/dev/null && break
    sleep 1
  done
  "$PY" - <<'EOF'
import openai
client = openai.OpenAI(base_url="http://127.0.0.1:8011/v1", api_key="none")
model = client.models.list().data[0].id
out = client.completions.create(model=model, prompt="Hello world", max_tokens=16)
print("completion:", repr(out.choices[0].text), out.usage)
chat = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True)
print("streamed chunks:", sum(1 for _ in chat))
EOF
  for c in 1 8; do
    timeout 45 "$PY" -m hybridllm bench serve --base-url $url --tokenizer $model \
      --num-prompts $((c * 16)) --max-concurrency $c --random-input-len 64 \
      --random-output-len 32 --ignore-eos --disable-tqdm
  done
  "$PY" -c "import urllib.request as u; print(u.urlopen('$url/metrics').read().decode())" | grep -E "^hybridllm_(num_requests|prompt_tokens|generation_tokens)" | head
  kill -INT $server; wait $server
} >"$OUT/serve.log" 2>&1
want serve && grep -E "completion:|chunks:|Output token throughput|Successful|Failed" "$OUT/serve.log" >>"$OUT/env.log"

if want bench && (($(left) > 60)); then
  step "bench $BENCH_ARGS"
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
  timeout -s INT $(($(left) - 20)) "$PY" benchmarks/bench_hetero_gpu.py $BENCH_ARGS \
    --json "$OUT/bench.json" >"$OUT/bench.log" 2>&1
  grep "bench_hetero_gpu\]" "$OUT/bench.log" >>"$OUT/env.log"
fi

step "waiting for tests"
wait $tests_pid
grep -E "passed|failed|FAILED|ERROR" "$OUT/tests.log" | tail -40 >>"$OUT/env.log"
step "done"
