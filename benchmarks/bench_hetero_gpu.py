"""GPU benchmark of heterogeneous (GPU + CPU) execution on a Llama-3-8B-shaped random bf16 model.

Writes the model on the spot (no downloads), caps the GPU so that about half the decoder layers
run on the CPU, and measures these parts (--part; each fits one 10-minute call with the 8b
shape, and one call writes the model once, whatever parts it runs): `hybrid`, hybridllm with
device="heterogeneous" and max_gpu_memory = the budget, beside the floor (bytes each device reads
per token / its measured bandwidth, for hybridllm's plan); `accelerate`, Hugging Face accelerate's
device_map="auto" under the same budget; `streaming`, CPU-resident layers copied from pinned
memory to the GPU every forward; `no_cap`, device="heterogeneous" must choose GPU-only and decode
within 5% of device="cuda"; `hybrid_policies`, hybridllm under the same budget with its CPU stage
never streaming (--stream-threshold -1) and always streaming (0), against which `hybrid`'s
per-step choice is checked. Decode tokens/s per batch = tokens generated after the first over
the time after it; TTFT is that of one --prompt-len prompt. Progress goes to stderr, the JSON of
the results to stdout and --json (rewritten after every part, so a call cut short keeps what
it measured); --combine merges the JSON files of separate calls and checks the targets.

    python benchmarks/bench_hetero_gpu.py --part hybrid --json hybrid.json  # then accelerate, ...
    python benchmarks/bench_hetero_gpu.py --combine hybrid.json accelerate.json streaming.json
    python benchmarks/bench_hetero_gpu.py --shape tiny  # every part, quickly, on a GPU machine
    python benchmarks/bench_hetero_gpu.py --shape tiny --allow-cpu --batches 1,2 --new-tokens 8
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer

from hybridllm.loader.safetensors_writer import write_safetensors
from hybridllm.plan.memory_budget import stream_kv_tokens, stream_staging_bytes
from hybridllm.plan.model_size import ModelSize, model_size
from hybridllm.plan.placement_args import parse_memory_size
from hybridllm.platforms.discovery import discover_hardware

# The random model gets the tests' small trained tokenizer (tests/model_helpers.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.model_helpers import make_tiny_tokenizer  # noqa: E402

SHAPES: dict[str, dict[str, int]] = {
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, intermediate_size=14336, vocab_size=128256),
    "tiny": dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=2, intermediate_size=896, vocab_size=4096),
}  # fmt: skip
# Prompts are token ids, so the tokenizer only has to load: ids beyond its vocabulary decode to "".
TOKENIZER_VOCAB = 512
SHARD_BYTES = 2 << 30
BLOCK_SIZE = 16  # hybridllm's default KV block
BATCHED_TOKENS = 2048  # hybridllm's default step budget: it sizes the activation workspace
TARGETS = {
    "batch1_vs_floor": 0.8,
    "batch1_vs_accelerate": 5.0,
    "no_cap_vs_cuda": 0.95,
    # weight streaming (issue 15): the per-step choice against its two fixed policies
    "ttft_vs_accelerate": 10.0,  # accelerate's TTFT / ours
    "choice_vs_best_policy": 0.9,  # ours / the better of always-CPU and always-streaming
    "batch1_vs_always_streaming": 3.0,
}
PARTS = ("hybrid", "accelerate", "streaming", "no_cap", "hybrid_policies")
_request_ids = itertools.count()
# (prompts, new tokens) -> (time to first token, decode tokens/s after it)
Generate = Callable[[list[list[int]], int], tuple[float, float | None]]


def log(message: str) -> None:
    """Progress on stderr, so that stdout holds only the JSON."""
    print(f"[bench_hetero_gpu] {message}", file=sys.stderr, flush=True)


# --- the model ------------------------------------------------------------------------------


def llama_config(shape: str) -> dict[str, Any]:
    """config.json of a Llama-3-8B-shaped (or tiny) LlamaForCausalLM in bf16."""
    dims = SHAPES[shape]
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **dims,
        "head_dim": dims["hidden_size"] // dims["num_attention_heads"], "hidden_act": "silu",
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    }  # fmt: skip


def tensor_shapes(c: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a LlamaForCausalLM checkpoint, in file order."""
    h, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    shapes = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(c["num_hidden_layers"]):
        shapes += [(f"model.layers.{i}.{name}.weight", shape) for name, shape in (
            ("input_layernorm", (h,)), ("self_attn.q_proj", (q, h)), ("self_attn.k_proj", (kv, h)),
            ("self_attn.v_proj", (kv, h)), ("self_attn.o_proj", (h, q)),
            ("post_attention_layernorm", (h,)), ("mlp.gate_proj", (inter, h)),
            ("mlp.up_proj", (inter, h)), ("mlp.down_proj", (h, inter)),
        )]  # fmt: skip
    return shapes + [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]


def random_tensor(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Norm weights are ones, matrices N(0, 0.02); filled in parallel chunks (normal_ is serial)."""
    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.bfloat16)
    tensor = torch.empty(shape, dtype=torch.bfloat16)
    chunks = tensor.view(-1).chunk(os.cpu_count() or 1)

    def fill(i: int) -> None:
        chunks[i].normal_(0.0, 0.02, generator=torch.Generator().manual_seed(seed * 4096 + i))

    with ThreadPoolExecutor() as pool:  # torch releases the GIL inside normal_
        list(pool.map(fill, range(len(chunks))))
    return tensor


def write_random_model(path: Path, shape: str) -> None:
    """An HF folder: tokenizer, safetensors shards streamed one tensor at a time, config last."""
    path.mkdir(parents=True, exist_ok=True)
    make_tiny_tokenizer(TOKENIZER_VOCAB).save_pretrained(path)
    cfg = llama_config(shape)
    shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
    for name, shape_ in tensor_shapes(cfg):
        if sum(math.prod(s) * 2 for _, s, _ in shards[-1]) + math.prod(shape_) * 2 > SHARD_BYTES:
            shards.append([])
        shards[-1].append((name, shape_, torch.bfloat16))
    weight_map, seeds = {}, itertools.count()
    for n, specs in enumerate(shards, 1):
        file = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        # A generator: the writer holds one tensor (and the one it is writing), never a shard.
        tensors = ((name, random_tensor(shape_, next(seeds))) for name, shape_, _ in specs)
        write_safetensors(str(path / file), specs, tensors)
        weight_map.update(dict.fromkeys((name for name, _, _ in specs), file))
        log(f"wrote {file}")
    total = sum(math.prod(s) * 2 for _, s in tensor_shapes(cfg))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    # config.json last: its presence marks a complete folder that later runs reuse.
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


def ensure_model(args: argparse.Namespace) -> str:
    """--model-dir when it holds a model, else a random model written there (or in the temp dir)."""
    default = Path(tempfile.gettempdir()) / f"hybridllm-bench-llama3-{args.shape}"
    path = Path(args.model_dir) if args.model_dir else default
    if (path / "config.json").is_file():
        log(f"reusing the model in {path}")
    else:
        log(f"writing a random {args.shape} model to {path}")
        write_random_model(path, args.shape)
    return str(path)


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """`n` prompts of random token ids above the special ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


# --- the machine ----------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """GPU, CPU model, cores, RAM and library versions."""
    import transformers

    hw = discover_hardware(include_gpus=False)
    return {
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cpu": hw.cpu_model, "cores": hw.logical_cores, "ram_gib": round(hw.total_ram / 2**30, 1),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "transformers": transformers.__version__, "python": platform.python_version(),
    }  # fmt: skip


def bandwidth_gbs(device: str) -> float:
    """Read bandwidth of a large fp32 sum on `device` (best of 10); on the CPU with every core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or threads)  # a CPU worker uses every core too
    x = torch.ones(1 << (30 if device == "cuda" else 28), device=device)  # 4 GiB / 1 GiB
    best = math.inf
    for _ in range(11):  # the first is a warm-up that the minimum discards
        t = time.perf_counter()
        x.sum().item()  # .item() waits for the GPU
        best = min(best, time.perf_counter() - t)
    torch.set_num_threads(threads)
    return x.numel() * 4 / best / 1e9


def gpu_used_bytes() -> int | None:
    """Bytes in use on GPU 0 by every process (hybridllm's workers may be other processes)."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info(0)
    return total - free


def release_memory() -> None:
    """Free what a finished run left, before the next one loads."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- hybridllm ------------------------------------------------------------------------------


def plan_summary(llm: Any) -> dict[str, Any]:
    """The engine's plan: its stages, and per kind of device the layers and weight bytes."""
    from hybridllm.plan.memory_budget import worker_weight_bytes

    config = llm.llm_engine.config
    size = model_size(config.model_config.hf_config, config.model_config.dtype)
    out: dict[str, Any] = {"stages": []}
    for key in ("layers", "resident_bytes", "bytes_per_token"):
        out.update({f"gpu_{key}": 0, f"cpu_{key}": 0})
    for stage in config.plan.stages:
        # Per token a decode step reads every weight of the stage except the embedding table,
        # of which it gathers a row: the table is resident but not part of the floor.
        read = size.stage_bytes(stage.layer_start, stage.layer_end, False, stage.has_lm_head)
        for tp_rank, worker in enumerate(stage.workers):
            kind = "cpu" if worker.is_cpu else "gpu"
            out[f"{kind}_resident_bytes"] += worker_weight_bytes(size, stage, tp_rank)
            out[f"{kind}_bytes_per_token"] += int(read * stage.tp_share(tp_rank))
        out["cpu_layers" if stage.workers[0].is_cpu else "gpu_layers"] += stage.num_layers
        devices = [w.device for w in stage.workers]
        layers = [stage.layer_start, stage.layer_end]
        out["stages"].append({"devices": devices, "layers": layers, "lm_head": stage.has_lm_head})
    return out


def run_engine(llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, float | None]:
    """Run `prompts` together: (time until all have a token, decode tokens/s after that)."""
    from hybridllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine = llm.llm_engine
    t0 = time.perf_counter()
    for prompt in prompts:
        engine.add_request(f"bench-{next(_request_ids)}", {"prompt_token_ids": prompt}, params)
    counts: dict[str, int] = {}
    t_first, tokens_at_first = math.nan, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.error:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            counts[out.request_id] = len(out.outputs[0].token_ids)
        if math.isnan(t_first) and len(counts) == len(prompts) and all(counts.values()):
            # A batch's prefill may span steps: decode timing starts once every request has a token.
            t_first, tokens_at_first = time.perf_counter(), sum(counts.values())
    after = sum(counts.values()) - tokens_at_first
    return t_first - t0, (after / (time.perf_counter() - t_first) if after else None)


def measure(
    name: str, generate: Generate, args: argparse.Namespace, batches: list[int], n: int, ttft: bool
) -> dict[str, Any]:
    """The same runs for every engine: a warm-up, the TTFT of one long prompt, decode per batch."""
    generate(random_prompts(1, args.prompt_len, args.vocab, seed=1), 2)
    result: dict[str, Any] = {"decode_tok_s": {}}
    if ttft:
        result["ttft_s"] = generate(random_prompts(1, args.prompt_len, args.vocab, seed=2), 1)[0]
    for b in batches:
        prompts = random_prompts(b, args.decode_prompt_len, args.vocab, seed=100 + b)
        rate = result["decode_tok_s"][str(b)] = generate(prompts, n)[1]
        log(f"{name} batch {b}: {rate:.1f} decode tokens/s")
    return result


def bench_hybrid(
    args: argparse.Namespace, batches: list[int], ttft: bool, **engine: Any
) -> dict[str, Any]:
    """hybridllm with `engine` keywords: its plan, the GPU memory it took, then `measure`."""
    from hybridllm import LLM

    before = gpu_used_bytes()
    llm = LLM(model=args.model_dir, dtype="bfloat16", use_tqdm=False, **engine)
    try:
        result: dict[str, Any] = {"plan": plan_summary(llm)}
        if before is not None:
            result["gpu_memory_used_bytes"] = gpu_used_bytes() - before
        name = f"hybridllm device={engine['device']}"
        run = partial(run_engine, llm)
        return {**result, **measure(name, run, args, batches, args.new_tokens, ttft)}
    finally:
        llm.shutdown()
        release_memory()


# --- Hugging Face baselines -----------------------------------------------------------------


class TokenClock(BaseStreamer):
    """A generate() streamer that notes when each put() comes: the prompt, then every step.

    generate() hands it `tokens.cpu()`, which waits for the GPU, so the times are real."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_generate(model: Any, prompts: list[list[int]], n: int) -> tuple[float, float | None]:
    """One greedy generate() of `n` tokens: (time to first token, decode tokens/s after it)."""
    ids = torch.tensor(prompts, device="cuda" if torch.cuda.is_available() else "cpu")
    clock = TokenClock()
    t0 = time.perf_counter()
    with torch.inference_mode():
        mask = torch.ones_like(ids)
        model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, streamer=clock)
    if len(clock.times) != n + 1:
        raise RuntimeError(f"generate() made {len(clock.times) - 1} tokens, not {n}")
    first, last = clock.times[1], clock.times[-1]
    return first - t0, (len(prompts) * (n - 1) / (last - first) if n > 1 else None)


def bench_hf(name: str, model: Any, args: argparse.Namespace, batches: list[int]) -> dict[str, Any]:
    """`measure` an HF model's generate()."""
    # Random weights may sample the EOS id: generation must run its full length.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return measure(name, partial(hf_generate, model), args, batches, args.hf_new_tokens, True)


def load_accelerate(model_dir: str, budget: int) -> tuple[Any, int]:
    """accelerate's device_map="auto" under the GPU budget: (model, decoder layers on the GPU)."""
    from transformers import AutoModelForCausalLM

    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") * 8 // 10
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, device_map="auto", max_memory={0: budget, "cpu": host}, dtype=torch.bfloat16
    ).eval()
    # a module name, or a prefix of it, -> its device; transformers 5 sets no map where the
    # whole model landed on one device
    placed = getattr(model, "hf_device_map", None) or {"": next(model.parameters()).device.type}

    def device_of(name: str) -> Any:
        return placed[max((k for k in placed if name.startswith(k + ".") or not k), key=len)]

    layers = [device_of(f"model.layers.{i}.") for i in range(model.config.num_hidden_layers)]
    return model, sum(d not in ("cpu", "disk") for d in layers)


def stream_layers(layers: list[torch.nn.Module]) -> None:
    """Weight streaming, written plainly: every forward copies each layer to the GPU first.

    Each layer's weights live in one flat pinned host buffer; a forward pre-hook copies it
    (non_blocking, so the host does not wait) into one GPU buffer shared by all streamed layers
    and points the layer's parameters at views of it, so the HF layer code runs unchanged. The
    copy and the layer's kernels queue on the same stream, so a copy never overwrites weights
    that an earlier layer still reads. Copies do not overlap compute: at these batch sizes a
    layer's PCIe copy takes over ten times its compute, so double-buffering would gain little.
    """
    params = [list(layer.parameters()) for layer in layers]
    sizes = [p.numel() for p in params[0]]
    buffer = torch.empty(sum(sizes), dtype=params[0][0].dtype, device="cuda")
    views = [v.view(p.shape) for v, p in zip(buffer.split(sizes), params[0])]
    for layer, layer_params in zip(layers, params):
        host = torch.empty(sum(sizes), dtype=buffer.dtype, pin_memory=True)
        for view, p in zip(host.split(sizes), layer_params):
            view.copy_(p.data.view(-1))
            p.data = view.view(p.shape)  # drops the pageable copy

        def before(_module: Any, _args: Any, host: torch.Tensor = host, ps: list = layer_params):
            buffer.copy_(host, non_blocking=True)
            for p, view in zip(ps, views):
                p.data = view

        layer.register_forward_pre_hook(before)


def load_streaming(model_dir: str, resident: int) -> Any:
    """The HF model with layers [0, resident) on the GPU and the rest streamed every forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    layers = list(model.model.layers)
    # Take the streamed layers out while the rest (embedding, resident layers, norm, LM head,
    # rotary tables) moves to the GPU, then put them back.
    model.model.layers = torch.nn.ModuleList(layers[:resident])
    model.cuda()
    model.model.layers = torch.nn.ModuleList(layers)
    if resident < len(layers):
        stream_layers(layers[resident:])
    return model


# --- the run --------------------------------------------------------------------------------


def default_gpu_budget(size: ModelSize, kv_tokens: int) -> int:
    """Half the layers and the LM head, their KV for these runs, activations and the CPU stage's
    weight-streaming staging buffers (the planner keeps room for them on the GPU), plus 2%."""
    half = size.num_layers // 2
    need = size.stage_bytes(0, half, False, True) + kv_tokens * size.kv_bytes_per_token(half)
    staging = stream_staging_bytes(size, stream_kv_tokens(BATCHED_TOKENS), size.layer_bytes)
    return int((need + size.activation_bytes(BATCHED_TOKENS) + staging) * 1.02)


def streaming_resident_layers(size: ModelSize, budget: int, kv_tokens: int, prompt: int) -> int:
    """Layers that fit the budget beside embedding, LM head, the copy buffer, KV and activations."""
    fixed = size.embedding_bytes + size.lm_head_bytes + size.final_norm_bytes + size.layer_bytes
    fixed += kv_tokens * size.kv_bytes_per_token(size.num_layers) + size.activation_bytes(prompt)
    return int(max(0, min(size.num_layers, (budget - fixed) // size.layer_bytes)))


def check(value: float | None, target: float) -> dict[str, Any]:
    """A result beside its target."""
    return {"value": value, "target": target, "met": value is not None and value >= target}


def targets(results: dict[str, Any]) -> dict[str, Any]:
    """Batch-1 decode vs the floor and vs accelerate; no cap vs device="cuda"."""
    out: dict[str, Any] = {}
    b1 = results.get("hybridllm", {}).get("decode_tok_s", {}).get("1")
    if b1 and "floor" in results:
        floor = results["floor"]["batch1_tok_s"]
        out["batch1_vs_floor"] = check(b1 / floor, TARGETS["batch1_vs_floor"])
        acc = results.get("accelerate", {}).get("decode_tok_s", {}).get("1")
        if acc:
            out["batch1_vs_accelerate"] = check(b1 / acc, TARGETS["batch1_vs_accelerate"])
    ours = results.get("hybridllm", {})
    acc_ttft = results.get("accelerate", {}).get("ttft_s")
    if ours.get("ttft_s") and acc_ttft:
        out["ttft_vs_accelerate"] = check(acc_ttft / ours["ttft_s"], TARGETS["ttft_vs_accelerate"])
    policies = results.get("hybrid_policies", {})
    for b, rate in ours.get("decode_tok_s", {}).items():
        fixed = [policies.get(p, {}).get("decode_tok_s", {}).get(b) for p in ("never", "always")]
        if rate and all(fixed):
            out[f"batch{b}_choice_vs_best_policy"] = check(
                rate / max(fixed), TARGETS["choice_vs_best_policy"]
            )
    always_b1 = policies.get("always", {}).get("decode_tok_s", {}).get("1")
    if b1 and always_b1:
        out["batch1_vs_always_streaming"] = check(
            b1 / always_b1, TARGETS["batch1_vs_always_streaming"]
        )
    if "ratio" in results.get("no_cap", {}):
        out["no_cap_gpu_only"] = {"met": results["no_cap"]["gpu_only"]}
        for b, ratio in results["no_cap"]["ratio"].items():
            out[f"no_cap_batch{b}_vs_cuda"] = check(ratio, TARGETS["no_cap_vs_cuda"])
    return out


def parse_args() -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = ap.add_argument
    add("--shape", choices=sorted(SHAPES), default="8b", help="model shape (default 8b)")
    add("--model-dir", help="model folder: reused if it has a config.json, else written there")
    add("--gpu-budget", help="GPU cap, e.g. 9GiB (default: half the layers + LM head + KV room)")
    add("--batches", default="1,8,64", help="decode batch sizes (default 1,8,64)")
    add("--new-tokens", type=int, default=64, help="tokens per decode request, hybridllm")
    add("--hf-new-tokens", type=int, default=32, help="the same for the slow HF baselines")
    add("--prompt-len", type=int, default=1024, help="prompt length of the TTFT run")
    add("--decode-prompt-len", type=int, default=64, help="prompt length of the decode runs")
    add("--backend", choices=("uni", "mp"), help="hybridllm's executor (default: its choice)")
    add(
        "--part",
        default="all",
        help=f"comma-separated parts to run: {', '.join(PARTS)} (default all)",
    )
    add("--skip-accelerate", action="store_true", help="no accelerate baseline")
    add("--skip-streaming", action="store_true", help="no weight-streaming baseline")
    add("--skip-no-cap", action="store_true", help="no uncapped heterogeneous vs cuda run")
    add("--allow-cpu", action="store_true", help="with --shape tiny and no GPU: hybridllm on CPU")
    add("--json", help="also write the results to this file (after every part)")
    add(
        "--combine",
        nargs="+",
        metavar="JSON",
        help="merge the --json files of earlier runs, check the targets, run nothing",
    )
    args = ap.parse_args()
    if min(args.new_tokens, args.hf_new_tokens) < 2:
        ap.error("a decode rate needs at least 2 new tokens")
    parts = PARTS if args.part == "all" else tuple(args.part.split(","))
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"unknown --part {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    skipped = {p for p in ("accelerate", "streaming", "no_cap") if getattr(args, f"skip_{p}")}
    args.parts = [p for p in PARTS if p in parts and p not in skipped]
    return args  # fmt: skip


def combine(paths: list[str]) -> dict[str, Any]:
    """The results of several runs (one part each, say) as one, with the targets rechecked."""
    merged: dict[str, Any] = {}
    for path in paths:
        part = json.loads(Path(path).read_text())
        part.pop("targets", None)
        for key, value in part.items():
            merged.setdefault(key, value)  # machine and config: the first file's
    merged["targets"] = targets(merged)
    return merged


def save(results: dict[str, Any], path: str | None) -> None:
    """Write the results so far (a call stopped at its time limit keeps them)."""
    if path:
        Path(path).write_text(json.dumps(results, indent=2) + "\n")


def main() -> None:
    """Write or reuse the model (once per run), run the chosen parts, print (and write) the JSON."""
    args = parse_args()
    if args.combine:
        results = combine(args.combine)
        save(results, args.json)
        print(json.dumps(results, indent=2))
        return
    cuda = torch.cuda.is_available()
    if not cuda and not (args.shape == "tiny" and args.allow_cpu):
        sys.exit(
            "bench_hetero_gpu: no CUDA GPU found; this benchmark needs one. To smoke-test the "
            "script on a CPU, run it with --shape tiny --allow-cpu."
        )
    batches = [int(b) for b in args.batches.split(",")]
    args.model_dir = ensure_model(args)
    from transformers import AutoConfig

    size = model_size(AutoConfig.from_pretrained(args.model_dir), "bfloat16")
    args.vocab = size.vocab_size
    # KV the runs need at most: the largest decode batch, or the TTFT prompt.
    seq = args.decode_prompt_len + max(args.new_tokens, args.hf_new_tokens)
    kv_tokens = max(max(batches) * seq, args.prompt_len + 2)
    blocks = max(max(batches) * -(-seq // BLOCK_SIZE), -(-(args.prompt_len + 2) // BLOCK_SIZE))
    common = dict(
        max_model_len=max(args.prompt_len + 2, seq) + BLOCK_SIZE, max_num_seqs=max(batches),
        enable_prefix_caching=False, distributed_executor_backend=args.backend,
        # hybridllm sizes the GPU KV cache from gpu_memory_utilization, not max_gpu_memory:
        # a block count keeps it to what these runs use (a spare block per sequence).
        num_gpu_blocks_override=blocks + max(batches),
    )  # fmt: skip
    budget = default_gpu_budget(size, kv_tokens)
    budget = parse_memory_size(args.gpu_budget) if args.gpu_budget else budget
    config = {k: v for k, v in vars(args).items() if not k.startswith(("skip", "combine"))}
    config.update(common, batches=batches, gpu_budget_bytes=budget if cuda else None)
    results: dict[str, Any] = {"machine": machine_info(), "config": config}

    def hybrid() -> None:
        bandwidth = {"cpu": bandwidth_gbs("cpu"), "gpu": bandwidth_gbs("cuda") if cuda else None}
        results["bandwidth_gbs"] = bandwidth
        log(f"memory bandwidth, GB/s: {bandwidth}")
        if cuda:
            capped = dict(device="heterogeneous", max_gpu_memory=budget)
        else:
            log("no CUDA GPU: hybridllm runs on the CPU only and the GPU parts are skipped")
            capped = dict(device="cpu")
        run = results["hybridllm"] = bench_hybrid(args, batches, True, **capped, **common)
        seconds = run["plan"]["cpu_bytes_per_token"] / (bandwidth["cpu"] * 1e9)
        if run["plan"]["gpu_bytes_per_token"]:
            seconds += run["plan"]["gpu_bytes_per_token"] / (bandwidth["gpu"] * 1e9)
        results["floor"] = {"batch1_tok_s": 1 / seconds, "seconds_per_token": seconds}

    def accelerate() -> None:
        model, on_gpu = load_accelerate(args.model_dir, budget)
        results["accelerate"] = {
            "gpu_layers": on_gpu,
            **bench_hf("accelerate", model, args, batches),
        }

    def streaming() -> None:
        resident = streaming_resident_layers(size, budget, kv_tokens, args.prompt_len)
        model = load_streaming(args.model_dir, resident)
        results["streaming"] = {
            "gpu_layers": resident,
            **bench_hf("streaming", model, args, batches),
        }

    def no_cap() -> None:
        few = [b for b in (1, 8) if b <= max(batches)]
        # cuda before and after: whatever the first engine of the process pays once (kernel
        # compiles, allocator growth) falls on neither side; the better cuda run is the reference
        ref = bench_hybrid(args, few, False, device="cuda", **common)
        het = bench_hybrid(args, few, False, device="heterogeneous", **common)
        again = bench_hybrid(args, few, False, device="cuda", **common)
        for b, rate in again["decode_tok_s"].items():
            ref["decode_tok_s"][b] = max(rate, ref["decode_tok_s"][b])
        ratio = {b: het["decode_tok_s"][b] / ref["decode_tok_s"][b] for b in ref["decode_tok_s"]}
        gpu_only = het["plan"]["cpu_layers"] == 0
        log(f"no cap: GPU-only plan {gpu_only}; heterogeneous / cuda decode tokens/s {ratio}")
        results["no_cap"] = dict(gpu_only=gpu_only, ratio=ratio, heterogeneous=het, cuda=ref)

    def hybrid_policies() -> None:
        # The per-step choice ("hybrid") against never streaming and always streaming.
        results["hybrid_policies"] = {
            name: bench_hybrid(
                args,
                batches,
                True,
                device="heterogeneous",
                max_gpu_memory=budget,
                stream_threshold=threshold,
                **common,
            )  # fmt: skip
            for name, threshold in (("never", -1), ("always", 0))
        }

    runs = {
        "hybrid": hybrid,
        "accelerate": accelerate,
        "streaming": streaming,
        "no_cap": no_cap,
        "hybrid_policies": hybrid_policies,
    }
    for name in args.parts:
        if not cuda and name != "hybrid":
            continue
        started = time.perf_counter()
        try:
            runs[name]()
        except Exception as e:  # one part failing must not lose the others' results
            log(f"{name} failed: {type(e).__name__}: {e}")
            results[name if name != "hybrid" else "hybridllm"] = {
                "error": f"{type(e).__name__}: {e}"
            }
        log(f"{name} took {time.perf_counter() - started:.0f} s")
        release_memory()
        results["targets"] = targets(results)
        save(results, args.json)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
