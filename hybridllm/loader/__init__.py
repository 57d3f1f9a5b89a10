"""Model loading: HF folders and GGUF files behind one lazy `ModelSource` interface."""

from hybridllm.loader.default_model import default_model_path
from hybridllm.loader.gguf_source import GGUFSource
from hybridllm.loader.hf_folder import HFFolderSource
from hybridllm.loader.model_source import (
    MissingTokenizerError,
    ModelLoadError,
    ModelSource,
    WeightFilter,
)
from hybridllm.loader.open_model import load_tokenizer, open_model_source

__all__ = [
    "GGUFSource",
    "HFFolderSource",
    "MissingTokenizerError",
    "ModelLoadError",
    "ModelSource",
    "WeightFilter",
    "default_model_path",
    "load_tokenizer",
    "open_model_source",
]
