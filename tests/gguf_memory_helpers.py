"""Large random GGUF files written straight from random blocks (no HF model in memory), and a child
process that loads one and reports its resident memory: for the memory tests and measurements."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np

from tests.gguf_helpers import CHAT_TEMPLATE, add_test_tokenizer

Q = gguf.GGMLQuantizationType


def random_blocks(rows: int, cols: int, qtype: gguf.GGMLQuantizationType, seed: int) -> np.ndarray:
    """Random blocks of `qtype` [rows, cols / block * bytes] with small fp16 scales (decoded
    weights stay small and finite); every other byte random."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // block, type_size), dtype=np.uint8)

    def small_f16(count: int) -> np.ndarray:
        return rng.uniform(1e-5, 1e-4, size=(len(raw), count)).astype(np.float16).view(np.uint8)

    if qtype == Q.Q6_K:  # d last
        raw[:, -2:] = small_f16(1)
    elif qtype in (Q.Q4_K, Q.Q5_K, Q.Q4_1, Q.Q5_1):  # d, dmin / d, m first
        raw[:, :4] = small_f16(2)
    elif qtype in (Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q3_K, Q.Q2_K):
        if qtype in (Q.Q8_0, Q.Q4_0, Q.Q5_0):
            raw[:, :2] = small_f16(1)
        elif qtype == Q.Q3_K:  # d last
            raw[:, -2:] = small_f16(1)
        else:  # Q2_K: d, dmin last
            raw[:, -4:] = small_f16(2)
    else:
        raise ValueError(f"no random blocks for {qtype.name}")
    return raw.reshape(rows, -1)


def write_random_llama_gguf(
    path: Path,
    hidden: int = 2048,
    layers: int = 16,
    intermediate: int = 8192,
    vocab: int = 49152,
    heads: int = 32,
    kv_heads: int = 8,
    base: gguf.GGMLQuantizationType = Q.Q4_K,
    more_bits: gguf.GGMLQuantizationType = Q.Q6_K,
    embedding: gguf.GGMLQuantizationType = Q.Q6_K,
) -> Path:
    """A random Llama laid out as llama-quantize's Q4_K_M: q/k/o and gate/up `base`, v and
    down `more_bits`, a tied embedding in `embedding`, F32 norms; the tests' small tokenizer
    (token ids beyond it are never produced by it but exist in the vocabulary)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    tokens = add_test_tokenizer(writer)
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    kv = hidden // heads * kv_heads
    seed = 0

    def add(name: str, rows: int, cols: int, qtype: gguf.GGMLQuantizationType) -> None:
        nonlocal seed
        seed += 1
        blocks = random_blocks(rows, cols, qtype, seed)
        writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)

    add("token_embd.weight", vocab, hidden, embedding)
    for i in range(layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(p + "ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        add(p + "attn_q.weight", hidden, hidden, base)
        add(p + "attn_k.weight", kv, hidden, base)
        add(p + "attn_v.weight", kv, hidden, more_bits)
        add(p + "attn_output.weight", hidden, hidden, base)
        add(p + "ffn_gate.weight", intermediate, hidden, base)
        add(p + "ffn_up.weight", intermediate, hidden, base)
        add(p + "ffn_down.weight", hidden, intermediate, more_bits)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Run in a child: load the model, report the resident memory after loading and after decoding.
_CHILD = r"""
import json, os, sys
def status():
    out = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(value.split()[0]) * 1024
    # the model file's own resident pages (RssFile also counts torch's and the kernels' libraries)
    model, mapped, total = os.path.realpath(args["llm"]["model"]), False, 0
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):
            mapped = len(fields) >= 6 and os.path.realpath(fields[-1]) == model
        elif mapped and fields[:1] == ["Rss:"]:
            total += int(fields[1]) * 1024
    out["ModelFileRss"] = total
    return out
args = json.loads(sys.argv[1])
import torch
from hybridllm import LLM, SamplingParams
base = status()
llm = LLM(**args["llm"])
loaded = status()
llm.generate(["hello world"], SamplingParams(max_tokens=args["tokens"], temperature=0))
served = status()
print("RESULT " + json.dumps({"base": base, "loaded": loaded, "served": served}))
"""


def resident_memory(model: str, tokens: int = 4, **llm_kwargs) -> dict:
    """{"base", "loaded", "served"}: /proc/self/status byte counts (VmHWM peak, VmRSS, RssAnon,
    RssFile) and the model file's resident mapped pages (ModelFileRss, from smaps) of a fresh
    process before `LLM(model=...)`, after it, and after decoding `tokens`."""
    args = {"llm": {"model": model, **llm_kwargs}, "tokens": tokens}
    env = {**os.environ, "HYBRIDLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(args)],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"child failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
