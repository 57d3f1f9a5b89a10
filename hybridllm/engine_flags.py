"""The engine's command-line flags, defined once: serve, generate, chat and bench take them all;
plan takes those that decide the placement, with the same names, defaults and help."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hybridllm.config import (
    SUPPORTED_DEVICES,
    SUPPORTED_DTYPES,
    SUPPORTED_EXECUTOR_BACKENDS,
    SUPPORTED_GGUF_ACTIVATIONS,
    SUPPORTED_KV_CACHE_DTYPES,
    SUPPORTED_QUANTIZATION,
)
from hybridllm.engine_args import EngineArgs, parse_layer_split
from hybridllm.plan.placement_args import parse_memory_size

GROUPS = {
    "engine": None,
    "kernels": "what CPU workers compute with (each flag defaults to its environment variable)",
    "parallelism": "where the layers run: the planner decides what is not given",
}


@dataclass(frozen=True)
class Flag:
    """One flag: its names, help, argument group, whether `plan` takes it, argparse keywords."""

    names: tuple[str, ...]
    help: str
    group: str = "engine"
    plan: bool = False
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def dest(self) -> str:
        return self.options.get("dest") or self.names[0].removeprefix("--").replace("-", "_")


def _memory_size(text: str) -> int:
    try:
        return parse_memory_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _layer_split(text: str) -> tuple[int, ...]:
    try:
        return tuple(parse_layer_split(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _speculative_config(text: str) -> dict:
    from hybridllm.json_limits import loads_strict

    try:
        value = loads_strict(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _flag(*names: str, help: str, group: str = "engine", plan: bool = False, **options) -> Flag:
    return Flag(names, help, group, plan, options)


FLAGS: tuple[Flag, ...] = (
    _flag("--tokenizer", help="tokenizer folder (default: the model's)"),
    _flag(
        "--dtype",
        choices=SUPPORTED_DTYPES,
        plan=True,
        help="compute dtype of weights and activations; auto: bfloat16 when a GPU runs layers, "
        "else float32, or a bfloat16 checkpoint's own bfloat16 where this CPU has bf16 dot "
        "products and its measured bf16 GEMM beats fp32. Linears CPU workers keep as GGUF "
        "blocks compute in fp32 (or int8, see --gguf-activations) whatever the dtype",
    ),
    _flag(
        "--quantization",
        choices=SUPPORTED_QUANTIZATION,
        plan=True,
        help="auto: CPU workers compute a GGUF file's linears straight from its blocks (Q4_0 to "
        "Q8_0, the K-quants, the IQ types; F16/BF16/MXFP4 are dequantized at load); none: "
        "dequantize every weight at load; q8_0/q4_0/q4_1: as auto, and CPU workers quantize a "
        "checkpoint's float linears and MoE experts into that type at load (the LM head into Q8_0), "
        "cached in $HYBRIDLLM_CACHE_DIR. Blocks need the native CPU kernels (--cpu-kernels)",
    ),
    _flag(
        "--device",
        choices=SUPPORTED_DEVICES,
        plan=True,
        help="where the model runs; auto: the GPU when the model fits, else GPU + CPU (CPU "
        "alone without a GPU); cuda: GPUs only; heterogeneous: ranks beyond the GPUs are CPU "
        "workers",
    ),
    _flag(
        "--max-model-len",
        type=int,
        plan=True,
        help="context length (prompt + output); default: the model's. The plan reserves KV "
        "cache for min(max-model-len, 256 x --max-num-seqs) tokens beside the weights",
    ),
    _flag(
        "--gpu-memory-utilization",
        type=float,
        plan=True,
        help="fraction of each GPU's memory for weights, activations and KV cache (default 0.9)",
    ),
    _flag(
        "--kv-cache-memory",
        type=_memory_size,
        help="CPU workers' KV cache together, e.g. 2GiB (default: 30%% of free RAM, at most "
        "4 GiB, within --max-cpu-memory)",
    ),
    _flag(
        "--kv-cache-dtype",
        choices=SUPPORTED_KV_CACHE_DTYPES,
        plan=True,
        help="CPU workers' KV cache dtype; auto: float16 where they compute in float32 from "
        "GGUF blocks with int8 activations (--gguf-activations int8), else the compute dtype; "
        "float16 or bfloat16 under float32 compute halves the cache and the bytes decode reads "
        "(GPU workers keep the compute dtype)",
    ),
    _flag("--block-size", type=int, help="tokens per KV cache block (default 16)"),
    _flag(
        "--no-enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="turn off hash-based prefix caching",
    ),
    _flag(
        "--no-enable-chunked-prefill",
        dest="enable_chunked_prefill",
        action="store_false",
        plan=True,
        help="schedule each prompt whole in one step (the step budget then defaults to "
        "--max-model-len when that is larger)",
    ),
    _flag(
        "--max-num-batched-tokens",
        type=int,
        plan=True,
        help="token budget of one engine step; sizes each device's activation workspace "
        "(default 2048)",
    ),
    _flag(
        "--max-num-seqs", type=int, plan=True, help="most requests running at once (default 128)"
    ),
    _flag(
        "--cpu-threads",
        type=int,
        plan=True,
        help="threads of each CPU worker (default: a machine's usable cores divided among the "
        "CPU workers on it)",
    ),
    _flag("--seed", type=int, help="engine seed (default 0)"),
    _flag(
        "--cpu-kernels",
        action=argparse.BooleanOptionalAction,
        group="kernels",
        plan=True,
        help="the native CPU kernels (GGUF linears from their blocks, decode attention, fused "
        "layers), built once per machine; off: the torch paths, and GGUF weights dequantized "
        "at load (default: $HYBRIDLLM_CPU_KERNELS, else on)",
    ),
    _flag(
        "--gguf-activations",
        choices=SUPPORTED_GGUF_ACTIVATIONS,
        group="kernels",
        plan=True,
        help="what CPU workers' GGUF linears compute with: int8 activations (integer dot "
        "products, faster decode, approximate) or fp32 (exact up to fp32 rounding) "
        "(default: $HYBRIDLLM_GGUF_ACTIVATIONS, else int8)",
    ),
    _flag(
        "--native-decode-layer",
        action=argparse.BooleanOptionalAction,
        group="kernels",
        help="CPU workers decode a whole layer in one native call where each of its parts has "
        "a native form; off: part by part (default: $HYBRIDLLM_NATIVE_DECODE_LAYER, else on)",
    ),
    _flag(
        "--speculative-config",
        type=_speculative_config,
        metavar="JSON",
        plan=True,  # method "mtp" puts the MTP layer beside the last stage
        help='speculative decoding, as vLLM\'s: \'{"method": "ngram", "num_speculative_tokens": '
        "4}' drafts each request's next tokens from its own prompt and output (keys "
        'prompt_lookup_max, prompt_lookup_min, disable_by_batch_size); \'{"model": PATH, '
        '"num_speculative_tokens": 4}\' drafts with a smaller model of the same vocabulary (key '
        'quantization: the draft\'s); \'{"method": "mtp", "num_speculative_tokens": 1}\' '
        "drafts with the checkpoint's own MTP layer (DeepSeek-V3, GLM-4.5 folders); greedy and "
        "seeded outputs stay those of plain decoding (default: off)",
    ),
    _flag(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        group="parallelism",
        plan=True,
        help="pipeline stages (each runs a contiguous range of layers)",
    ),
    _flag(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        group="parallelism",
        plan=True,
        help="workers that split each stage's layers between them",
    ),
    _flag(
        "--gpu-layers",
        "-ngl",
        type=int,
        group="parallelism",
        plan=True,
        help="like llama.cpp's -ngl: the last N decoder layers, the final norm and the LM head "
        "on the GPU, the layers before them on the CPU",
    ),
    _flag(
        "--stream-threshold",
        type=int,
        metavar="N",
        group="parallelism",
        plan=True,
        help="CPU stages beside a GPU compute steps of at least N tokens on the GPU, streaming "
        "their weights to it (0: always, -1: never; default: the cost model's crossover, "
        "which `hybridllm plan` prints)",
    ),
    _flag(
        "--stream-device",
        group="parallelism",
        plan=True,
        help="where CPU stages stream to (default: the plan's GPU); 'cpu' runs the streaming "
        "path on the host, to check it on a machine without a GPU",
    ),
    _flag(
        "--cpu-moe",
        action="store_true",
        group="parallelism",
        plan=True,
        help="mixtures of experts: every layer's routed experts on the CPU, the rest of each "
        "layer (attention, router, shared expert) on the GPU, like llama.cpp's --cpu-moe",
    ),
    _flag(
        "--n-cpu-moe",
        type=int,
        metavar="N",
        group="parallelism",
        plan=True,
        help="mixtures of experts: the routed experts of the first N layers on the CPU "
        "(default: only when the model does not fit the GPU, as few as needed)",
    ),
    _flag(
        "--max-gpu-memory",
        type=_memory_size,
        group="parallelism",
        plan=True,
        help="cap on weights + activations + KV cache per GPU worker, e.g. 8GiB (default: the "
        "GPU's memory times --gpu-memory-utilization, at most its free memory)",
    ),
    _flag(
        "--max-cpu-memory",
        type=_memory_size,
        group="parallelism",
        plan=True,
        help="cap on weights + activations + KV cache of all CPU workers together, e.g. 32GiB "
        "(default: 90%% of the available RAM)",
    ),
    _flag(
        "--distributed-executor-backend",
        choices=SUPPORTED_EXECUTOR_BACKENDS,
        group="parallelism",
        plan=True,
        help="uni: workers in the engine process; mp: one process per worker; ray: one Ray "
        "actor per worker, each stage on one machine of a Ray cluster (plan lists its nodes) "
        "(default: uni for one worker, else mp)",
    ),
    _flag(
        "--ray-address",
        metavar="HOST:PORT",
        group="parallelism",
        plan=True,
        help="with --distributed-executor-backend ray: the Ray cluster to join, e.g. "
        "10.0.0.1:6379 (default: RAY_ADDRESS, else a cluster started with `ray start` on this "
        "machine, else a new local one)",
    ),
    _flag(
        "--layer-split",
        type=_layer_split,
        group="parallelism",
        plan=True,
        help="layers per pipeline stage, comma-separated, e.g. 10,22 (default: the planner "
        "decides)",
    ),
)


def add_engine_flags(parser: argparse.ArgumentParser, plan_only: bool = False) -> None:
    """Add the engine's flags to `parser` in their groups; `plan_only`: those `plan` takes."""
    defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    groups = {
        name: parser.add_argument_group(name, description) for name, description in GROUPS.items()
    }
    for flag in FLAGS:
        if plan_only and not flag.plan:
            continue
        options = dict(flag.options)
        if options.get("action") not in ("store_true", "store_false"):
            options.setdefault("default", defaults[flag.dest])
        groups[flag.group].add_argument(*flag.names, help=flag.help, **options)
