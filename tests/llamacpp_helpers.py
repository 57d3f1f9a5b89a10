"""llama.cpp's own tools for tests: the built bin folder, tiny GGUF files its `llama-quantize`
made (benchmarks/make_gguf_files.py), and greedy tokens with their logprobs from `llama-server`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def make_gguf_files_module():
    """benchmarks/make_gguf_files.py (benchmarks/ imports as a namespace package from the repo
    root, as the benchmarks import each other)."""
    from benchmarks import make_gguf_files

    return make_gguf_files


def llamacpp_bin() -> Path | None:
    """llama.cpp's bin folder when it is built (nothing is built here), else None."""
    bin_dir = make_gguf_files_module().find_llamacpp_bin(build=False)
    if bin_dir is None or not (bin_dir / "llama-server").is_file():
        return None
    return bin_dir


def gguf_files_root() -> Path:
    """Where make_gguf_files.py's files are: $HYBRIDLLM_GGUF_FILES, else /work/gguf-files when
    it exists or can be made, else ~/.cache/hybridllm/gguf-files."""
    env = os.environ.get("HYBRIDLLM_GGUF_FILES")
    if env:
        return Path(env)
    default = Path("/work/gguf-files")
    try:
        default.mkdir(parents=True, exist_ok=True)
        if os.access(default, os.W_OK):
            return default
    except OSError:
        pass
    return Path.home() / ".cache" / "hybridllm" / "gguf-files"


def tiny_gguf_files(types: list[str], bin_dir: Path) -> dict[str, Path]:
    """The tiny model's files of `types` (made once by llama.cpp's tools, then reused)."""
    mk = make_gguf_files_module()
    root = gguf_files_root()
    paths = {t: mk.quant_path(root, mk.SHAPES["tiny"], t) for t in types}
    if all(p.is_file() for p in paths.values()):
        return paths
    made = mk.make_files("tiny", root, [t for t in types if t != "F16"], bin_dir)
    return {t: made[t] for t in types}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 60) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


@contextmanager
def llama_server(bin_dir: Path, model: Path, threads: int = 1, ctx: int = 512, timeout: float = 60):
    """A `llama-server` on `model` (one slot), yielding its base URL; stopped on exit."""
    port = free_port()
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = f"{bin_dir}:{env.get('LD_LIBRARY_PATH', '')}".rstrip(":")
    cmd = [
        str(bin_dir / "llama-server"),
        "-m",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-c",
        str(ctx),
        "-np",
        "1",
        "--no-warmup",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                out = proc.stdout.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"llama-server exited ({proc.returncode}):\n{out}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"llama-server on {model} not ready in {timeout} s")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def llamacpp_greedy(
    url: str, prompt: list[int], new_tokens: int, n_probs: int
) -> tuple[list[int], list[dict[int, float]]]:
    """llama.cpp's greedy continuation of `prompt` (token ids) and, for each generated token,
    the logprobs of its `n_probs` most likely tokens, from the raw logits (softmax over the whole
    vocabulary: `post_sampling_probs: false`)."""
    body = {
        "prompt": prompt, "n_predict": new_tokens, "temperature": 0, "n_probs": n_probs,
        "post_sampling_probs": False, "cache_prompt": False, "ignore_eos": True,
        "return_tokens": True, "samplers": ["top_k"], "top_k": 1,
    }  # fmt: skip
    out = _post(url + "/completion", body)
    probs = out["completion_probabilities"]
    tokens = [p["id"] for p in probs]
    tops = [{t["id"]: t["logprob"] for t in p["top_logprobs"]} for p in probs]
    return tokens, tops
