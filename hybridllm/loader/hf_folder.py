"""A Hugging Face model folder: config.json, (sharded) safetensors, tokenizer files."""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Iterator
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from hybridllm.loader.fp8_block import (
    dequantize_fp8_block,
    fp8_block_quant,
    is_fp8,
    is_scale_name,
    scale_name,
)
from hybridllm.loader.hf_config import CONFIG_FILE, HFConfig
from hybridllm.loader.model_source import (
    NO_TOKENIZER_HINT,
    MissingTokenizerError,
    ModelLoadError,
    ModelSource,
    WeightFilter,
    own_all,
)
from hybridllm.loader.mxfp4_blocks import MXFP4, mxfp4_pairs, mxfp4_weight

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerFast

    from hybridllm.loader.quantized_tensor import QuantizedTensor

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
        # DeepSeek's block-scaled FP8 layout (loader/fp8_block.py); other quantizations refused
        self.fp8_block = fp8_block_quant(self.hf_config, config_path)
        gen_path = os.path.join(self.path, GENERATION_CONFIG_FILE)
        from_file = read_json(gen_path) if os.path.isfile(gen_path) else {}
        self.generation_config = merge_generation_config(self.hf_config, from_file)
        self._weight_map: dict[str, str] | None = None  # hf name -> safetensors file, on demand
        # MXFP4 weights (loader/mxfp4_blocks.py): X -> (X_blocks, X_scales), on demand
        self._mxfp4_pairs: dict[str, tuple[str, str]] | None = None

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

    def _mxfp4(self) -> dict[str, tuple[str, str]]:
        """X -> (X_blocks, X_scales): the weights stored as MXFP4 block / scale pairs."""
        if self._mxfp4_pairs is None:
            self._mxfp4_pairs = mxfp4_pairs(self._weights_by_file())
        return self._mxfp4_pairs

    def weight_names(self) -> list[str]:
        names = list(self._weights_by_file())
        if self.fp8_block is not None:  # the scales belong to their weights
            names = [name for name in names if not is_scale_name(name)]
        pairs = self._mxfp4()
        if pairs:  # X_blocks stands for X (at its place in file order), X_scales goes
            blocks_of = {b: x for x, (b, _) in pairs.items()}
            scales = {s for _, s in pairs.values()}
            names = [blocks_of.get(name, name) for name in names if name not in scales]
        return names

    def iter_weights(
        self, owns: WeightFilter = own_all, quantized_types: Collection[int] = ()
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        # Safetensors hold no GGUF blocks except MXFP4 pairs, which stay blocks where MXFP4 is
        # in `quantized_types`.
        pairs = self._mxfp4()
        blocks_of = {b: x for x, (b, _) in pairs.items()}
        scales = {s for _, s in pairs.values()}
        by_file: dict[str, list[str]] = {}
        for name, file_name in self._weights_by_file().items():
            if self.fp8_block is not None and is_scale_name(name):
                continue  # read with its weight
            if name in scales:
                continue  # read with its blocks
            if owns(blocks_of.get(name, name)):
                by_file.setdefault(file_name, []).append(name)
        keep_mxfp4 = int(MXFP4) in {int(t) for t in quantized_types}
        for file_name, names in by_file.items():
            if self.fp8_block is None and not pairs:
                yield from read_safetensors(os.path.join(self.path, file_name), names)
            else:
                yield from self._read_paired_file(file_name, names, keep_mxfp4)

    def _read_paired_file(
        self, file_name: str, names: list[str], keep_mxfp4: bool
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        """One file's tensors, each fp8 weight dequantized with its scale and each MXFP4 pair
        read as one weight (the scales may lie in another shard: those are opened as needed and
        closed with this file)."""
        weight_map = self._weights_by_file()
        pairs = self._mxfp4()
        blocks_of = {b: x for x, (b, _) in pairs.items()}
        with ExitStack() as stack:
            handles: dict[str, Any] = {}

            def opened(shard: str) -> Any:
                if shard not in handles:
                    path = os.path.join(self.path, shard)
                    handles[shard] = stack.enter_context(_open_safetensors(path))
                return handles[shard]

            for name in names:
                tensor = _read_tensor(opened(file_name), self.path, file_name, name)
                if name in blocks_of:
                    weight = blocks_of[name]
                    scales_name = pairs[weight][1]
                    scales_file = weight_map[scales_name]
                    scales = _read_tensor(opened(scales_file), self.path, scales_file, scales_name)
                    yield weight, mxfp4_weight(weight, tensor, scales, keep_mxfp4)
                    del tensor, scales
                    continue
                scale_file = weight_map.get(scale_name(name))
                if self.fp8_block is None:
                    yield name, tensor
                    continue
                if not is_fp8(tensor):
                    if scale_file is not None:
                        raise ModelLoadError(
                            f"{name}: has a scale {scale_name(name)!r} but is stored as "
                            f"{tensor.dtype}, not float8_e4m3fn"
                        )
                    yield name, tensor
                    continue
                scale = None
                if scale_file is not None:
                    scale = _read_tensor(
                        opened(scale_file), self.path, scale_file, scale_name(name)
                    )
                yield name, dequantize_fp8_block(name, tensor, scale, self.fp8_block.block)
                del tensor, scale

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
    folder, file_name = os.path.split(file_path)
    with _open_safetensors(file_path) as f:
        for name in names:
            yield name, _read_tensor(f, folder, file_name, name)


def _read_tensor(f: Any, folder: str, file_name: str, name: str) -> torch.Tensor:
    from safetensors import SafetensorError

    try:
        return f.get_tensor(name)
    except (SafetensorError, OSError) as e:
        file_path = os.path.join(folder, file_name)
        raise ModelLoadError(f"{file_path}: cannot read tensor {name!r} ({e})") from None
