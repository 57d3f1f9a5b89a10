"""Pick the ModelSource for a path: a Hugging Face folder or a single .gguf file."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from hybridllm.loader.gguf_file import GGUF_MAGIC
from hybridllm.loader.hf_folder import CONFIG_FILE, HFFolderSource, load_folder_tokenizer
from hybridllm.loader.model_source import ModelSource

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast


def open_model_source(path: str) -> ModelSource:
    """Open the checkpoint at `path`; reads its config only (weights are read lazily).

    Raises FileNotFoundError for a missing path and ValueError for a path that is neither a
    folder with config.json nor a GGUF file (ModelLoadError when such a file is corrupted).
    """
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path does not exist: {path}")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
            raise ValueError(
                f"{path}: a model folder needs a {CONFIG_FILE} (Hugging Face layout); "
                "for a GGUF model pass the .gguf file itself"
            )
        return HFFolderSource(path)
    if not _looks_like_gguf(path):
        raise ValueError(
            f"{path}: not a model (expected a Hugging Face folder with {CONFIG_FILE} "
            "or a .gguf file)"
        )
    from hybridllm.loader.gguf_source import GGUFSource

    return GGUFSource(path)


def load_tokenizer(path: str) -> PreTrainedTokenizerFast:
    """The tokenizer at `path`: a model folder or GGUF file, or a folder of tokenizer files only.

    Raises MissingTokenizerError (naming the files looked for) when there is none.
    """
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, CONFIG_FILE)):
        return load_folder_tokenizer(path)
    return open_model_source(path).load_tokenizer()


def _looks_like_gguf(path: str) -> bool:
    # The extension says what the user meant (a corrupted .gguf then fails with ModelLoadError);
    # the magic catches GGUF files saved under another name.
    if path.lower().endswith(".gguf"):
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False
