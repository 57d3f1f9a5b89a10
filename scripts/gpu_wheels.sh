#!/usr/bin/env bash
# Run HERE (the CPU machine, which reaches PyPI), before using the GPU machine: downloads into
# .whl/ (git-ignored) the Python packages hybridllm needs that the GPU machine's image lacks, as
# CPython 3.12 manylinux wheels (that image's python3 already holds torch, triton, transformers,
# accelerate, safetensors, numpy, tqdm, aiohttp, httpx, pytest). scripts/gpu_check.sh installs
# them there; carry `.whl` with every device call that runs it. About 4 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES=(gguf fastapi starlette pydantic pydantic-core annotated-types typing-inspection
          uvicorn pyzmq)
rm -rf .whl && mkdir -p .whl
for name in "${PACKAGES[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$name"
done
ls -la .whl
