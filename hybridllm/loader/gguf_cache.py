"""On-disk cache of GGUF files converted to Hugging Face folders, keyed by the file's identity.

An entry is a complete HF folder (config.json, model.safetensors, tokenizer files) plus a
manifest.json listing each file's size and checksum; a tokenizer entry (kind "tokenizer") holds
only the tokenizer's files, for a model whose weights are read as blocks from the GGUF file.
Entries are built in a temporary folder and renamed into place, so a crash never leaves a half
entry; a lock file keeps two processes from converting the same file at once. On lookup the
manifest is checked against the folder: a corrupted entry, or one for an older version of the
same file, is deleted with a warning. Each build also deletes the entries of GGUF files that no
longer exist (a model converted from a temporary file would otherwise hold its disk forever).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

from hybridllm import envs, progress

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = envs.CACHE_DIR.name
# Bump when the conversion changes (names, layout, dtypes): old entries then stop matching.
CACHE_FORMAT_VERSION = 2  # 2: config.json written by HFConfig
MANIFEST_FILE = "manifest.json"
_STALE_TMP_SECONDS = 3600  # a temp folder this old belongs to a crashed build
# Converting dequantizes and writes float32: a 1B Q4_K_M file (0.8 GB) took 11 s on 2 cores.
_CONVERT_SECONDS_PER_GB = 15


def cache_root() -> str:
    """`$HYBRIDLLM_CACHE_DIR`, else `~/.cache/hybridllm`."""
    root = envs.read(envs.CACHE_DIR) or os.path.join("~", ".cache", "hybridllm")
    return os.path.abspath(os.path.expanduser(root))


def _sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _sha256_safetensors_header(path: str) -> str:
    # The 8-byte length and the JSON header: names, dtypes, shapes and offsets of every tensor.
    # Hashing the tensor data itself would cost a full read of the file on every load.
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            return ""
        (header_len,) = struct.unpack("<Q", prefix)
        return hashlib.sha256(prefix + f.read(min(header_len, 1 << 30))).hexdigest()


def _file_checksum(path: str) -> str:
    return _sha256_safetensors_header(path) if path.endswith(".safetensors") else _sha256_file(path)


class GGUFConversionCache:
    """The cache entry for one GGUF file: where it is, whether it is valid, how to build it.
    `kind`: "" for the whole conversion, "tokenizer" for the tokenizer's files alone."""

    def __init__(self, gguf_path: str, root: str | None = None, kind: str = ""):
        self.source_path = os.path.abspath(gguf_path)
        st = os.stat(self.source_path)
        self.source = {"path": self.source_path, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        self.root = os.path.join(root or cache_root(), "gguf")
        path_key = hashlib.sha256(self.source_path.encode()).hexdigest()[:12]
        identity = json.dumps([self.source, CACHE_FORMAT_VERSION]).encode()
        stem = os.path.splitext(os.path.basename(self.source_path))[0][:48]
        # <path key>-<identity key>-<name>[.<kind>]: entries for older versions of a file share
        # the path key and differ in the identity key.
        self._prefix = f"{path_key}-"
        self._identity_key = hashlib.sha256(identity).hexdigest()[:12]
        self._kind = kind
        suffix = f".{kind}" if kind else ""
        self.entry_dir = os.path.join(self.root, f"{path_key}-{self._identity_key}-{stem}{suffix}")

    # ---- lookup ---------------------------------------------------------------------------------

    def lookup(self) -> str | None:
        """The entry folder if it exists and checks out; a bad entry is deleted (warning)."""
        if not os.path.isdir(self.entry_dir):
            return None
        problem = self._verify()
        if problem is None:
            return self.entry_dir
        logger.warning(
            "GGUF cache entry %s is invalid (%s); rebuilding it", self.entry_dir, problem
        )
        shutil.rmtree(self.entry_dir, ignore_errors=True)
        return None

    def _verify(self) -> str | None:
        try:
            with open(os.path.join(self.entry_dir, MANIFEST_FILE), encoding="utf-8") as f:
                manifest = json.load(f)
        except (OSError, ValueError) as e:
            return f"unreadable manifest: {e}"
        if not isinstance(manifest, dict) or manifest.get("format_version") != CACHE_FORMAT_VERSION:
            return "format version differs"
        if manifest.get("source") != self.source:
            return "made from a different source file"
        files = manifest.get("files")
        if not isinstance(files, dict) or not files:
            return "manifest lists no files"
        for name, expected in files.items():
            path = os.path.join(self.entry_dir, name)
            try:
                size = os.path.getsize(path)
            except OSError:
                return f"{name} is missing"
            if size != expected.get("size"):
                return f"{name} has {size} bytes, manifest says {expected.get('size')}"
            if _file_checksum(path) != expected.get("sha256"):
                return f"{name} checksum differs"
        return None

    # ---- build ----------------------------------------------------------------------------------

    def build(self, write_entry: Callable[[str], None]) -> str:
        """Fill a new entry with `write_entry(folder)`, then publish it atomically; returns it."""
        os.makedirs(self.root, exist_ok=True)
        with self._lock():
            found = self.lookup()  # another process may have built it while we waited
            if found is not None:
                return found
            self._remove_stale_entries()
            tmp_dir = tempfile.mkdtemp(prefix=f".tmp-{self._prefix}", dir=self.root)
            try:
                with progress.long_step(**self._describe_build()):
                    write_entry(tmp_dir)
                    self._write_manifest(tmp_dir)
                os.chmod(tmp_dir, 0o755)  # mkdtemp made it private; the entry is plain data
                os.rename(tmp_dir, self.entry_dir)
            except BaseException:
                shutil.rmtree(tmp_dir, ignore_errors=True)
                raise
        return self.entry_dir

    def _describe_build(self) -> dict[str, Any]:
        """`progress.long_step`'s arguments: a big file converts for minutes."""
        name = os.path.basename(self.source_path)
        if self._kind == "tokenizer":  # seconds: worth a line only where it drags on
            return dict(
                what=f"caching the tokenizer of {name}",
                done=f"cached the tokenizer of {name}",
                after_s=2.0,
            )
        gigabytes = self.source["size"] / 1e9
        seconds = max(5, round(gigabytes * _CONVERT_SECONDS_PER_GB / 5) * 5)
        span = f"{seconds} s" if seconds < 120 else f"{round(seconds / 60)} minutes"
        return dict(
            what=f"converting {name} into float weights in the GGUF cache {self.entry_dir}",
            done=f"converted {name}",
            estimate=f"once per file; roughly {span} for its {gigabytes:.1f} GB",
        )

    def _write_manifest(self, folder: str) -> None:
        files = {}
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            files[name] = {"size": os.path.getsize(path), "sha256": _file_checksum(path)}
        manifest: dict[str, Any] = {
            "format_version": CACHE_FORMAT_VERSION,
            "source": self.source,
            "files": files,
        }
        with open(os.path.join(folder, MANIFEST_FILE), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)

    def _remove_stale_entries(self) -> None:
        now = time.time()
        for name in os.listdir(self.root):
            path = os.path.join(self.root, name)
            if name.startswith(".tmp-"):
                if now - os.path.getmtime(path) > _STALE_TMP_SECONDS:
                    shutil.rmtree(path, ignore_errors=True)  # left by a crashed build
            elif not os.path.isdir(path):
                continue
            elif name.startswith(self._prefix):
                if not name[len(self._prefix) :].startswith(f"{self._identity_key}-"):
                    logger.warning(
                        "GGUF cache entry %s is stale (source file changed); deleting it", path
                    )
                    shutil.rmtree(path, ignore_errors=True)
            elif (source := _entry_source(path)) is not None and not os.path.exists(source):
                logger.info("GGUF cache entry %s: %s no longer exists; deleting it", path, source)
                shutil.rmtree(path, ignore_errors=True)
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.root, f"{name.split('-', 1)[0]}-lock"))

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        with open(os.path.join(self.root, f"{self._prefix}lock"), "a") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)


def _entry_source(entry: str) -> str | None:
    """The GGUF file an entry was made from, per its manifest; None where that is unreadable."""
    try:
        with open(os.path.join(entry, MANIFEST_FILE), encoding="utf-8") as f:
            source = json.load(f)["source"]["path"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return source if isinstance(source, str) else None
