"""A Hugging Face model folder: config.json, (sharded) safetensors, tokenizer files."""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING, Any

from hybridllm.loader.hf_config import CONFIG_FILE, HFConfig
from hybridllm.loader.model_source import (
    NO_TOKENIZER_HINT,
    MissingTokenizerError,
    ModelLoadError,
    ModelSource,
    WeightFilter,
    own_all,
)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerFast

GENERATION_CONFIG_FILE = "generation_config.json"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
SAFETENSORS_FILE = "model.safetensors"
_SPECIAL_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
# Each entry is one way a folder holds a tokenizer's vocabulary: a fast tokenizer's
# serialization, a SentencePiece model, or a byte-level BPE vocabulary and its merges.
TOKENIZER_FILE_SETS: tuple[tuple[str, ...], ...] = (
    ("tokenizer.json",),
    ("tokenizer.model",),
    ("vocab.json", "merges.txt"),
)


def read_json(path: str) -> Any:
    """Parse a JSON file, turning a decode or read failure into a ModelLoadError naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read JSON ({e})") from None


def merge_generation_config(hf_config: Any, from_file: dict[str, Any]) -> dict[str, Any]:
    """Special token ids from the model config, overridden by what generation_config.json says."""
    merged = {k: getattr(hf_config, k, None) for k in _SPECIAL_TOKEN_KEYS}
    merged = {k: v for k, v in merged.items() if v is not None}
    merged.update(from_file)
    return merged


class HFFolderSource(ModelSource):
    """Lazy reader of a local Hugging Face checkpoint folder (safetensors only)."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        config_path = os.path.join(self.path, CONFIG_FILE)
        if not os.path.isfile(config_path):
            raise ValueError(f"{self.path}: not a Hugging Face model folder (no {CONFIG_FILE})")
        self.hf_config = HFConfig.from_file(config_path)
        gen_path = os.path.join(self.path, GENERATION_CONFIG_FILE)
        from_file = read_json(gen_path) if os.path.isfile(gen_path) else {}
        self.generation_config = merge_generation_config(self.hf_config, from_file)
        self._weight_map: dict[str, str] | None = None  # hf name -> safetensors file, on demand

    # ---- weights --------------------------------------------------------------------------------

    def _weights_by_file(self) -> dict[str, str]:
        """hf name -> safetensors file: from the index if sharded, else from the file headers."""
        if self._weight_map is not None:
            return self._weight_map
        index_path = os.path.join(self.path, SAFETENSORS_INDEX_FILE)
        if os.path.isfile(index_path):
            # Trusted like transformers trusts it, so a stage never opens shards it does not own.
            index = read_json(index_path)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict):
                raise ModelLoadError(f"{index_path}: no 'weight_map' object")
            self._weight_map = dict(weight_map)
            return self._weight_map
        if os.path.isfile(os.path.join(self.path, SAFETENSORS_FILE)):
            files = [SAFETENSORS_FILE]
        else:
            files = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
        if not files:
            raise ModelLoadError(
                f"{self.path}: no safetensors weights (expected {SAFETENSORS_FILE} or "
                f"{SAFETENSORS_INDEX_FILE}; .bin checkpoints are not supported)"
            )
        self._weight_map = {}
        for file_name in files:
            with _open_safetensors(os.path.join(self.path, file_name)) as f:
                # File (offset) order where safetensors can tell it: sequential reads.
                names = f.offset_keys() if hasattr(f, "offset_keys") else f.keys()
                self._weight_map.update(dict.fromkeys(names, file_name))
        return self._weight_map

    def weight_names(self) -> list[str]:
        return list(self._weights_by_file())

    def iter_weights(
        self, owns: WeightFilter = own_all, quantized_types: Collection[int] = ()
    ) -> Iterator[tuple[str, torch.Tensor]]:
        # safetensors hold no GGUF blocks: `quantized_types` never applies
        by_file: dict[str, list[str]] = {}
        for name, file_name in self._weights_by_file().items():
            if owns(name):
                by_file.setdefault(file_name, []).append(name)
        for file_name, names in by_file.items():
            yield from read_safetensors(os.path.join(self.path, file_name), names)

    def weight_files(self) -> list[str]:
        return sorted({os.path.join(self.path, f) for f in self._weights_by_file().values()})

    # ---- tokenizer ------------------------------------------------------------------------------

    def load_tokenizer(self) -> PreTrainedTokenizerFast:
        return load_folder_tokenizer(self.path)


def load_folder_tokenizer(folder: str) -> PreTrainedTokenizerFast:
    """The tokenizer saved in a Hugging Face folder (a model's, or a tokenizer-only folder)."""
    from transformers import AutoTokenizer

    if not has_tokenizer_files(folder):
        # Checked first: without these files transformers builds some tokenizers (Qwen2's)
        # with an empty vocabulary instead of failing, and others fail obscurely.
        expected = ", ".join(" + ".join(files) for files in TOKENIZER_FILE_SETS)
        raise MissingTokenizerError(
            f"{folder}: no tokenizer files (expected one of: {expected}); {NO_TOKENIZER_HINT}"
        )
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"{folder}: cannot load the tokenizer ({e})") from None


def has_tokenizer_files(folder: str) -> bool:
    """Whether `folder` holds a tokenizer vocabulary in one of the layouts transformers reads."""
    return any(
        all(os.path.isfile(os.path.join(folder, name)) for name in files)
        for files in TOKENIZER_FILE_SETS
    )


def _open_safetensors(file_path: str):
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(file_path, framework="pt")
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(
            f"{file_path}: corrupted or unreadable safetensors file ({e})"
        ) from None


def read_safetensors(file_path: str, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the named tensors of one safetensors file, one at a time (memory-mapped reads)."""
    from safetensors import SafetensorError

    with _open_safetensors(file_path) as f:
        for name in names:
            try:
                tensor = f.get_tensor(name)
            except (SafetensorError, OSError) as e:
                raise ModelLoadError(f"{file_path}: cannot read tensor {name!r} ({e})") from None
            yield name, tensor
