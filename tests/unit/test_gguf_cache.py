"""GGUF conversion cache: hits, atomic builds, detection of corrupted or stale entries, the
tokenizer's entry of its own, and the removal of entries whose GGUF file is gone."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from hybridllm.loader import GGUFSource
from hybridllm.loader.gguf_cache import MANIFEST_FILE, GGUFConversionCache
from tests.gguf_helpers import tiny_hf_model, write_gguf


@pytest.fixture
def gguf_file(tmp_path) -> Path:
    return write_gguf(tmp_path / "tiny.gguf", tiny_hf_model("llama"))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("HYBRIDLLM_CACHE_DIR", str(path))
    return path


def _entries(cache_dir: Path) -> list[Path]:
    root = cache_dir / "gguf"
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.exists() else []


def _weights(source: GGUFSource) -> dict[str, torch.Tensor]:
    # Copies: cached tensors map the entry's file, which these tests then damage.
    return {name: tensor.clone() for name, tensor in source.iter_weights()}


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_second_open_hits_the_cache(gguf_file, cache_dir):
    reference = _weights(GGUFSource(str(gguf_file), use_cache=False))
    first = GGUFSource(str(gguf_file))
    assert not first.is_cached and _entries(cache_dir) == []  # opening alone converts nothing
    _assert_equal(_weights(first), reference)
    assert first.is_cached
    [entry] = _entries(cache_dir)
    assert {"config.json", "model.safetensors", "tokenizer.json", MANIFEST_FILE} <= {
        p.name for p in entry.iterdir()
    }

    second = GGUFSource(str(gguf_file))
    assert second.is_cached  # found at open: config, weights and tokenizer come from the entry
    _assert_equal(_weights(second), reference)
    assert second.hf_config.to_dict()["num_hidden_layers"] == first.hf_config.num_hidden_layers
    assert second.generation_config == first.generation_config
    assert second.load_tokenizer()("hello").input_ids == first.load_tokenizer()("hello").input_ids
    assert _entries(cache_dir) == [entry]


def test_explicit_cache_dir(gguf_file, tmp_path):
    source = GGUFSource(str(gguf_file), cache_dir=str(tmp_path / "elsewhere"))
    source.load_tokenizer()
    assert len(_entries(tmp_path / "elsewhere")) == 1


def _damage_weights_header(entry: Path) -> None:
    path = entry / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[20] ^= 0x01  # inside the JSON header: same size, different content
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage",
    [
        lambda e: (e / "model.safetensors").write_bytes(b"\0" * 100),  # truncated
        _damage_weights_header,
        lambda e: (e / "tokenizer.json").write_text("{}"),
        lambda e: (e / "config.json").unlink(),
        lambda e: (e / MANIFEST_FILE).write_text("{garbage"),
    ],
    ids=["truncated_weights", "weights_header", "tokenizer", "missing_config", "manifest"],
)
def test_corrupted_entry_is_rebuilt(gguf_file, cache_dir, caplog, damage):
    reference = _weights(GGUFSource(str(gguf_file)))
    [entry] = _entries(cache_dir)
    damage(entry)
    with caplog.at_level(logging.WARNING, logger="hybridllm.loader.gguf_cache"):
        source = GGUFSource(str(gguf_file))
    assert not source.is_cached
    assert any("invalid" in r.getMessage() and str(entry) in r.getMessage() for r in caplog.records)
    _assert_equal(_weights(source), reference)
    assert _entries(cache_dir) == [entry] and GGUFSource(str(gguf_file)).is_cached


def test_changed_source_is_reconverted(gguf_file, cache_dir, caplog):
    _weights(GGUFSource(str(gguf_file)))
    [old_entry] = _entries(cache_dir)
    # A new model written over the same path (new content, new mtime).
    new_model = tiny_hf_model("llama", seed=1)
    write_gguf(gguf_file, new_model)
    st = os.stat(gguf_file)
    os.utime(gguf_file, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    source = GGUFSource(str(gguf_file))
    assert not source.is_cached
    with caplog.at_level(logging.WARNING, logger="hybridllm.loader.gguf_cache"):
        got = _weights(source)
    assert torch.equal(got["model.norm.weight"], new_model.state_dict()["model.norm.weight"])
    assert torch.equal(
        got["model.layers.0.mlp.up_proj.weight"],
        new_model.state_dict()["model.layers.0.mlp.up_proj.weight"],
    )
    [new_entry] = _entries(cache_dir)
    assert new_entry != old_entry and not old_entry.exists()
    assert any("stale" in r.getMessage() for r in caplog.records)


def test_failed_build_leaves_no_entry(gguf_file, cache_dir):
    cache = GGUFConversionCache(str(gguf_file))

    def crash(folder: str) -> None:
        Path(folder, "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed mid-conversion")

    with pytest.raises(RuntimeError):
        cache.build(crash)
    assert [p.name for p in (cache_dir / "gguf").iterdir() if p.is_dir()] == []
    assert cache.lookup() is None


def test_manifest_records_source_identity(gguf_file, cache_dir):
    _weights(GGUFSource(str(gguf_file)))
    [entry] = _entries(cache_dir)
    manifest = json.loads((entry / MANIFEST_FILE).read_text())
    st = os.stat(gguf_file)
    assert manifest["source"] == {
        "path": str(gguf_file.resolve()),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
    }
    assert (
        manifest["files"]["model.safetensors"]["size"]
        == (entry / "model.safetensors").stat().st_size
    )


def test_unwritable_cache_falls_back_to_direct_reads(gguf_file, tmp_path, caplog):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")  # the cache root cannot be created under a file
    reference = _weights(GGUFSource(str(gguf_file), use_cache=False))
    source = GGUFSource(str(gguf_file), cache_dir=str(blocker))
    with caplog.at_level(logging.WARNING, logger="hybridllm.loader.gguf_source"):
        _assert_equal(_weights(source), reference)
    assert not source.is_cached
    assert any("cannot write the GGUF cache" in r.getMessage() for r in caplog.records)


def test_the_tokenizer_converts_no_weights(gguf_file, cache_dir):
    # a model computed from the file's blocks asks for the tokenizer only: no float copy
    direct = GGUFSource(str(gguf_file), use_cache=False).load_tokenizer()
    first = GGUFSource(str(gguf_file))
    assert first.load_tokenizer()("hello world").input_ids == direct("hello world").input_ids
    [entry] = _entries(cache_dir)
    names = {p.name for p in entry.iterdir()}
    assert "tokenizer.json" in names and MANIFEST_FILE in names
    assert "model.safetensors" not in names and not first.is_cached
    second = GGUFSource(str(gguf_file))
    assert second.load_tokenizer()("hello world").input_ids == direct("hello world").input_ids
    assert _entries(cache_dir) == [entry]  # found, not rebuilt
    # the float weights then get the whole conversion beside it; neither deletes the other
    _weights(second)
    assert len(_entries(cache_dir)) == 2 and entry.exists() and second.is_cached
    assert GGUFSource(str(gguf_file)).load_tokenizer()("hi").input_ids == direct("hi").input_ids


def test_entries_of_deleted_files_go_at_the_next_build(tmp_path, cache_dir):
    gone = write_gguf(tmp_path / "gone.gguf", tiny_hf_model("llama"))
    kept = write_gguf(tmp_path / "kept.gguf", tiny_hf_model("llama", seed=1))
    GGUFSource(str(gone)).load_tokenizer()  # its tokenizer's entry, then the whole conversion
    _weights(GGUFSource(str(gone)))
    GGUFSource(str(kept)).load_tokenizer()
    root = cache_dir / "gguf"

    def sources() -> dict[str, str]:  # entry name -> its GGUF file
        return {
            e.name: json.loads((e / MANIFEST_FILE).read_text())["source"]["path"]
            for e in _entries(cache_dir)
        }

    [gone_key] = {name.split("-")[0] for name, path in sources().items() if path == str(gone)}
    assert len(sources()) == 3 and (root / f"{gone_key}-lock").exists()
    gone.unlink()
    later = write_gguf(tmp_path / "later.gguf", tiny_hf_model("llama", seed=2))
    GGUFSource(str(later)).load_tokenizer()  # a build: the deleted file's two entries go
    assert sorted(sources().values()) == sorted([str(kept.resolve()), str(later.resolve())])
    assert not (root / f"{gone_key}-lock").exists()
