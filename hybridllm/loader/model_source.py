"""The interface every checkpoint format implements: config, generation config, weights, tokenizer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerFast

    from hybridllm.loader.hf_config import HFConfig
    from hybridllm.loader.quantized_tensor import QuantizedTensor

# Decides, from a Hugging Face parameter name, whether the caller (one pipeline stage) wants it.
WeightFilter = Callable[[str], bool]


def own_all(name: str) -> bool:
    """The default filter: a single-stage model owns every tensor."""
    return True


class ModelLoadError(ValueError):
    """A checkpoint file is corrupted, truncated or unreadable; the message names the file."""


class MissingTokenizerError(ModelLoadError):
    """The checkpoint has no tokenizer (files or GGUF metadata); the message says what to do."""


# How to run a checkpoint that has no tokenizer: appended to MissingTokenizerError messages.
NO_TOKENIZER_HINT = (
    "pass a tokenizer folder (tokenizer=...), or skip_tokenizer_init=True to run without one "
    "(prompts as token ids, outputs as token ids)"
)


class ModelSource(ABC):
    """One checkpoint on disk, seen through Hugging Face names whatever its format.

    Reads are lazy: opening a source reads the config only, and `iter_weights` reads just the
    tensors its filter accepts, so a pipeline stage touches only its own layers.
    """

    path: str
    hf_config: HFConfig  # config.json's fields, read-only
    generation_config: dict[str, Any]  # bos_token_id, eos_token_id (int or list), pad_token_id...

    @abstractmethod
    def weight_names(self) -> list[str]:
        """Every parameter name the checkpoint stores, in file order (no tensor data is read)."""

    @abstractmethod
    def iter_weights(
        self, owns: WeightFilter = own_all, quantized_types: Collection[int] = ()
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        """Yield `(hf_name, tensor)` for each stored tensor `owns(hf_name)` accepts.

        Tensors keep the checkpoint's precision (quantized GGUF tensors come out as float32,
        except 2-D ones of a ggml type in `quantized_types`, which stay `QuantizedTensor`
        blocks); the caller casts. A model with tied embeddings stores no `lm_head.weight`. Tensors may
        be zero-copy views of a memory-mapped file: copy them into the model (as `load_weights`
        does) rather than keeping them, and never write to them.
        """

    def iter_mtp_weights(
        self, owns: WeightFilter = own_all, quantized_types: Collection[int] = ()
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        """As `iter_weights`, for the multi-token-prediction layers after the last decoder
        layer (`model.layers.{num_hidden_layers}.*`); an HF folder stores them by those names."""
        return self.iter_weights(owns, quantized_types)

    def weight_files(self) -> list[str]:
        """The files the weights are read from (a single-file format: its path)."""
        return [self.path]

    @abstractmethod
    def load_tokenizer(self) -> PreTrainedTokenizerFast:
        """The model's fast tokenizer, with its chat template and special tokens."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r})"
