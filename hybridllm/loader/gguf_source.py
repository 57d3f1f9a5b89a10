"""A single .gguf file: dequantized once into a cached HF folder, or read for its blocks directly."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES

from hybridllm.loader.gguf_cache import GGUFConversionCache
from hybridllm.loader.gguf_dequant import decoded_dtype, dequantize
from hybridllm.loader.gguf_file import GGUFFile, GGUFTensorInfo
from hybridllm.loader.gguf_mapping import (
    KV_B_PARTS,
    ROPE_FREQS_TENSOR,
    GGUFArch,
    generation_config_from_metadata,
    hf_config_kwargs,
    hf_tensor_name,
    kv_b_from_parts,
    kv_b_shape,
    mtp_tensor_name,
    rope_row_order,
)
from hybridllm.loader.gguf_mapping_linear import (
    is_a_log,
    linear_hf_shape,
    linear_row_order,
    out_proj_column_order,
)
from hybridllm.loader.hf_config import HFConfig
from hybridllm.loader.hf_folder import GENERATION_CONFIG_FILE, SAFETENSORS_FILE, HFFolderSource
from hybridllm.loader.model_source import (
    NO_TOKENIZER_HINT,
    MissingTokenizerError,
    ModelLoadError,
    ModelSource,
    WeightFilter,
    own_all,
)
from hybridllm.loader.quantized_tensor import QuantizedTensor
from hybridllm.loader.safetensors_writer import write_safetensors

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"


class GGUFSource(ModelSource):
    """A GGUF checkpoint seen through Hugging Face names, config and tokenizer.

    The first use of the float weights converts the whole file into a cache entry (an HF folder
    of float32 safetensors, see `GGUFConversionCache`); every later open, in any process, reads
    that entry lazily, tensor by tensor. The tokenizer alone gets a small entry of its own: a
    model computed from the file's blocks never needs the float copy (a 1B Q4_K_M file's is
    3.9 GB). With `use_cache=False`, or when the cache folder cannot be written, tensors are
    dequantized straight from the GGUF file on each read and the tokenizer built from it.
    """

    arch: GGUFArch | None  # set when the GGUF header was parsed (direct reads need it)

    def __init__(self, path: str, cache_dir: str | None = None, use_cache: bool = True):
        self.path = os.path.abspath(path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        self._cache_dir = cache_dir
        self._cache = GGUFConversionCache(self.path, cache_dir) if use_cache else None
        self._gguf: GGUFFile | None = None
        self._entry: HFFolderSource | None = None
        entry_dir = self._cache.lookup() if self._cache is not None else None
        if entry_dir is not None:
            self._entry = HFFolderSource(entry_dir)
            self.hf_config = self._entry.hf_config
            self.generation_config = self._entry.generation_config
            self.arch = None
        else:
            self._init_from_gguf()

    @property
    def is_cached(self) -> bool:
        """Whether reads come from a converted cache entry rather than the GGUF file."""
        return self._entry is not None

    def _init_from_gguf(self) -> None:
        self._gguf = GGUFFile(self.path)
        arch, kwargs = hf_config_kwargs(self._gguf.metadata, set(self._gguf.tensors), self.path)
        rope_freqs = self._gguf.tensors.get(ROPE_FREQS_TENSOR)
        if rope_freqs is not None:
            # llama.cpp's converter stores Llama 3.1 rope scaling as these divisors, not metadata
            factors = dequantize(
                self._gguf.raw_rows(rope_freqs), rope_freqs.ggml_type, rope_freqs.shape
            )
            scaling = kwargs.setdefault("rope_scaling", {"rope_type": "default"})
            scaling["freq_factors"] = factors.flatten().tolist()
        self.arch = arch
        self.hf_config = HFConfig({"model_type": arch.model_type, **kwargs}, origin=self.path)
        self.generation_config = generation_config_from_metadata(self._gguf.metadata)

    # ---- cache ----------------------------------------------------------------------------------

    def _ensure_entry(self) -> HFFolderSource | None:
        """The cache entry, converting the file into it on first use; None without a cache."""
        if self._entry is None and self._cache is not None:
            entry_dir = self._build(self._cache, self._write_entry)
            if entry_dir is None:  # work straight from the GGUF file from now on
                self._cache = None
                return None
            self._entry = HFFolderSource(entry_dir)
        return self._entry

    def _build(self, cache: GGUFConversionCache, write_entry: Callable[[str], None]) -> str | None:
        """`cache.build(write_entry)`, or None where the cache cannot be written (read-only or
        full disk)."""
        try:
            return cache.build(write_entry)
        except OSError as e:
            logger.warning("cannot write the GGUF cache for %s (%s); not caching", self.path, e)
            return None

    def _write_entry(self, folder: str) -> None:
        gguf = self._gguf_file()
        self.hf_config.save_pretrained(folder)
        with open(os.path.join(folder, GENERATION_CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(self.generation_config, f, indent=1)
        specs = [
            (name, *self._decoded_spec(gguf, info))
            for info in gguf.tensors.values()
            if (name := self._hf_name(info.name)) is not None
        ]
        # The tokenizer build is pure Python; it overlaps the weights, which mostly release the GIL.
        # A file without tokenizer metadata still converts (the tokenizer may come from elsewhere).
        weights_path = os.path.join(folder, SAFETENSORS_FILE)
        with ThreadPoolExecutor(1, thread_name_prefix="gguf-tokenizer") as pool:
            tokenizer = pool.submit(self._tokenizer_from_gguf) if self._has_tokenizer() else None
            write_safetensors(weights_path, specs, self._iter_gguf(own_all))
            if tokenizer is not None:
                tokenizer.result().save_pretrained(folder)

    def _hf_name(self, gguf_name: str) -> str | None:
        """`hf_tensor_name` for this file's architecture and decoder layers."""
        return hf_tensor_name(gguf_name, self.path, self.arch, self.hf_config.num_hidden_layers)

    def _decoded_spec(self, gguf: GGUFFile, info: GGUFTensorInfo) -> tuple[tuple[int, ...], object]:
        """The shape and dtype `_read_tensor` gives the tensor `info` (not quantized)."""
        if self._is_k_b(info):
            v_b = self._v_b_info(gguf, info)
            return kv_b_shape(info.shape, v_b.shape), torch.float32
        name = self._hf_name(info.name)
        shape = info.shape if name is None else linear_hf_shape(name, info.shape)
        return shape, decoded_dtype(info.ggml_type)

    @staticmethod
    def _is_k_b(info: GGUFTensorInfo) -> bool:
        """Whether `info` is a `blk.N.attn_k_b.weight`, read with its attn_v_b as kv_b_proj."""
        return info.name.startswith("blk.") and info.name.endswith(f".{KV_B_PARTS[0]}.weight")

    def _v_b_info(self, gguf: GGUFFile, k_b: GGUFTensorInfo) -> GGUFTensorInfo:
        name = k_b.name.replace(f".{KV_B_PARTS[0]}.", f".{KV_B_PARTS[1]}.")
        info = gguf.tensors.get(name)
        if info is None:
            raise ModelLoadError(f"{self.path}: GGUF tensor {k_b.name!r} comes without {name!r}")
        return info

    def _gguf_file(self) -> GGUFFile:
        if self._gguf is None:
            self._init_from_gguf()
        assert self._gguf is not None
        return self._gguf

    # ---- weights --------------------------------------------------------------------------------

    def tensor_infos(self) -> dict[str, GGUFTensorInfo]:
        """GGUF tensor name -> type, shape and byte size (the header only; no data is read)."""
        return self._gguf_file().tensors

    def weight_names(self) -> list[str]:
        if self._entry is not None:
            return self._entry.weight_names()
        names = (self._hf_name(n) for n in self._gguf_file().tensors)
        return [n for n in names if n is not None]

    def iter_weights(
        self, owns: WeightFilter = own_all, quantized_types: Collection[int] = ()
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        entry = None if quantized_types else self._ensure_entry()
        if entry is not None:
            yield from entry.iter_weights(owns)
        else:
            # Quantized blocks exist only in the GGUF file; the cache holds float32.
            yield from self._iter_gguf(owns, frozenset(quantized_types))

    def iter_mtp_weights(
        self, owns: WeightFilter = own_all, quantized_types: Collection[int] = ()
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        """The MTP layers' tensors, straight from the file (never through the cache, which
        holds the decoder layers only)."""
        num_layers = self.hf_config.num_hidden_layers

        def mtp_name(gguf_name: str) -> str | None:
            return mtp_tensor_name(gguf_name, self.path, self.arch, num_layers)

        yield from self._iter_gguf(owns, frozenset(quantized_types), mtp_name)

    def _iter_gguf(
        self,
        owns: WeightFilter,
        quantized_types: frozenset[int] = frozenset(),
        hf_name: Callable[[str], str | None] | None = None,
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        """The owned tensors straight from the GGUF file, in file order: 2-D ones of
        `quantized_types` as QuantizedTensor, everything else dequantized.

        A QuantizedTensor may be a view of the file's mapped pages, valid while the consumer
        runs; what it keeps it copies then. Once the consumer returns, the tensor's pages are
        dropped from the process's resident memory (`GGUFFile.release_pages`), so loading holds
        the copies and not also the whole mapped file."""
        gguf = self._gguf_file()
        hf_name = hf_name or self._hf_name
        for info in gguf.tensors.values():
            name = hf_name(info.name)
            if name is None or not owns(name):
                continue
            if self._is_k_b(info):
                v_b = self._v_b_info(gguf, info)
                yield name, self._read_kv_b(gguf, info, v_b)
                gguf.release_pages(v_b)
            else:
                yield name, self._read_tensor(gguf, info, name, quantized_types)
            gguf.release_pages(info)

    def _read_kv_b(self, gguf: GGUFFile, k_b: GGUFTensorInfo, v_b: GGUFTensorInfo) -> torch.Tensor:
        """HF's kv_b_proj from llama.cpp's two parts, dequantized (float32): a small tensor
        (kv_lora_rank columns) whose rows are regrouped per head, so never kept quantized."""
        parts = []
        for info in (k_b, v_b):
            try:
                parts.append(dequantize(gguf.raw_rows(info), info.ggml_type, info.shape).float())
            except (NotImplementedError, ValueError) as e:
                raise ModelLoadError(
                    f"{self.path}: cannot decode tensor {info.name!r} ({info.ggml_type.name}): {e}"
                ) from None
        return kv_b_from_parts(parts[0], parts[1], self.path)

    def _read_tensor(
        self, gguf: GGUFFile, info: GGUFTensorInfo, name: str, quantized_types: frozenset[int]
    ) -> torch.Tensor | QuantizedTensor:
        """The tensor `info` (HF `name`) as `_iter_gguf` yields it."""
        order = self._rope_row_order(name, info.shape[0])
        raw = gguf.raw_rows(info)
        if order is not None and len(info.shape) == 2:
            raw = raw[order]  # [rows, bytes_per_row]: permute whole quantized rows
        raw, columns = self._column_blocks(raw, info, name)
        # F16 / BF16 rows of a length the 32-weight kernels cannot cut stay floats
        kept = info.ggml_type in quantized_types and info.shape[-1] % 32 == 0
        if kept and len(info.shape) >= 2 and columns is None:
            # a stack of experts [E, rows, cols] as blocks of its E * rows rows
            return QuantizedTensor(
                raw, info.ggml_type, (math.prod(info.shape[:-1]), info.shape[-1])
            )
        try:
            tensor = dequantize(raw, info.ggml_type, info.shape)
        except (NotImplementedError, ValueError) as e:
            raise ModelLoadError(
                f"{self.path}: cannot decode tensor {info.name!r} ({info.ggml_type.name}): {e}"
            ) from None
        if columns is not None:  # a value-head order within quantized blocks: decoded for it
            tensor = tensor[:, torch.from_numpy(columns)]
        if order is not None and len(info.shape) == 1:  # q/k bias, value-head entries: [rows]
            tensor = tensor[torch.from_numpy(order)]
        assert self.arch is not None
        if (
            self.arch.norm_shift
            and info.name.endswith("norm.weight")
            and not name.endswith(self.arch.unshifted_norms)
        ):
            # Gemma's and Qwen3-Next's converters stored 1 + w: the checkpoint's w, as the
            # model loads a folder's
            tensor = (tensor.float() - self.arch.norm_shift).to(tensor.dtype)
        if is_a_log(name):  # stored as A = -exp(A_log) (gguf_mapping_linear)
            tensor = torch.log(-tensor.double()).to(tensor.dtype)
        return tensor.reshape(linear_hf_shape(name, tuple(tensor.shape)))

    def _column_blocks(
        self, raw: np.ndarray, info: GGUFTensorInfo, name: str
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Qwen3.5's out_proj with its value heads' columns put back in order: in the raw rows
        when a head spans whole blocks (quantized blocks kept), else (raw, the column order to
        apply once decoded)."""
        assert self.arch is not None
        columns = out_proj_column_order(self.arch.model_type, name, self.hf_config)
        if columns is None:
            return raw, None
        block_size, type_size = GGML_QUANT_SIZES[info.ggml_type]
        head_dim = self.hf_config.linear_value_head_dim
        if head_dim % block_size:
            return raw, columns
        blocks = columns.reshape(-1, block_size)[:, 0] // block_size  # whole blocks move
        rows = raw.reshape(raw.shape[0], -1, type_size)[:, blocks.ravel()]
        return np.ascontiguousarray(rows.reshape(raw.shape[0], -1)), None

    def _rope_row_order(self, hf_name: str, num_rows: int) -> np.ndarray | None:
        """For llama-arch q/k projections, the row order undoing llama.cpp's permutation; for
        Qwen3.5's value-head rows, the one undoing its value-head reorder."""
        assert self.arch is not None
        if not self.arch.rope_permuted:
            return linear_row_order(self.arch.model_type, hf_name, self.hf_config)
        if ".self_attn.q_proj." in hf_name:
            return rope_row_order(num_rows, self.hf_config.num_attention_heads)
        if ".self_attn.k_proj." in hf_name:
            return rope_row_order(num_rows, self.hf_config.num_key_value_heads)
        return None

    # ---- tokenizer ------------------------------------------------------------------------------

    def load_tokenizer(self) -> PreTrainedTokenizerFast:
        folder = self._entry.path if self._entry is not None else self._tokenizer_entry()
        if folder is None:
            return self._tokenizer_from_gguf()
        if not os.path.isfile(os.path.join(folder, TOKENIZER_FILE)):
            raise self._no_tokenizer_error()
        from transformers import PreTrainedTokenizerFast

        try:
            return PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{folder}: cannot load the cached tokenizer ({e})") from None

    def _tokenizer_entry(self) -> str | None:
        """The cache entry of the tokenizer alone, built on first use; None without a cache."""
        if self._cache is None:
            return None
        if not self._has_tokenizer():
            raise self._no_tokenizer_error()
        cache = GGUFConversionCache(self.path, self._cache_dir, kind="tokenizer")
        # found without the build's lock, as the whole conversion is at open: a read-only cache
        return cache.lookup() or self._build(
            cache, lambda folder: self._tokenizer_from_gguf().save_pretrained(folder)
        )

    def _tokenizer_from_gguf(self) -> PreTrainedTokenizerFast:
        # transformers builds the fast tokenizer (vocab, merges, pre-tokenizer, chat template,
        # special tokens) from the GGUF metadata; the class, not AutoTokenizer, skips a slow
        # second parse of the whole file for the model config.
        from transformers import PreTrainedTokenizerFast

        if not self._has_tokenizer():
            raise self._no_tokenizer_error()
        folder, file_name = os.path.split(self.path)
        try:
            return PreTrainedTokenizerFast.from_pretrained(
                folder, gguf_file=file_name, local_files_only=True
            )
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"{self.path}: cannot build a tokenizer from GGUF ({e})") from None

    def _has_tokenizer(self) -> bool:
        return "tokenizer.ggml.tokens" in self._gguf_file().metadata

    def _no_tokenizer_error(self) -> MissingTokenizerError:
        return MissingTokenizerError(
            f"{self.path}: GGUF file has no tokenizer metadata; {NO_TOKENIZER_HINT}"
        )
