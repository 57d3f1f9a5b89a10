#!/usr/bin/env bash
# Run HERE (the CPU machine, which reaches PyPI), before using the GPU machine: downloads into
# .whl/ (git-ignored) the Python packages hybridllm and its tests need that the GPU machine's
# image lacks, as CPython 3.12 (that image's python3, /work/.library/device/KINDS.md) wheels,
# pure-Python or manylinux x86_64. The roots below and everything they require, at the versions
# this checkout's .venv holds (so the GPU runs what the CPU tests ran), less what the image
# already has (IMAGE_HAS: its package list). scripts/gpu_check.sh installs them there with
# `pip install --target /tmp/hybridllm-site`; carry `.whl` with every device call that runs it.
# About 10 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
# what hybridllm imports (gguf, the server, the mp queue) and what its tests need (the OpenAI
# client; pytest-timeout for --timeout; ninja, whose binary torch.utils.cpp_extension runs)
# jsonschema and anthropic: the structured-output and Messages API tests import them (ray, over
# 60 MB, stays behind: scripts/gpu_session.sh leaves its tests out)
ROOTS=(gguf fastapi uvicorn pyzmq openai pytest-timeout ninja jsonschema anthropic)
# in the image and recent enough: never carried (anyio and typing-extensions are: openai
# needs anyio >= 4.10 and typing-extensions >= 4.14)
IMAGE_HAS=(numpy pyyaml requests tqdm click h11 idna certifi urllib3
           charset-normalizer annotated-doc httpx httpcore pytest pluggy iniconfig packaging
           pygments colorama)
rm -rf .whl && mkdir -p .whl
# name==version of every root and requirement, walked through the .venv's installed metadata
mapfile -t PINNED < <("$PY" - "${#ROOTS[@]}" "${ROOTS[@]}" "${IMAGE_HAS[@]}" <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, distribution

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

n = int(sys.argv[1])
roots, image = sys.argv[2 : 2 + n], {canonicalize_name(x) for x in sys.argv[2 + n :]}
env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}
seen, todo = {}, [canonicalize_name(r) for r in roots]
while todo:
    name = todo.pop()
    if name in seen:
        continue
    try:
        dist = distribution(name)
    except PackageNotFoundError:
        seen[name] = None  # not in the .venv: the newest release
        continue
    seen[name] = dist.version
    for text in dist.requires or []:
        req = Requirement(text)
        dep = canonicalize_name(req.name)
        if (req.marker is None or req.marker.evaluate(env)) and dep not in image:
            todo.append(dep)
for name, version in sorted(seen.items()):
    print(name if version is None else f"{name}=={version}")
PYEOF
)
for spec in "${PINNED[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl "$spec"
done
ls -la .whl
