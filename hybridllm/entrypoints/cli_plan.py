"""`hybridllm plan [MODEL]`: print the placement plan, memory per device and predicted tokens/s."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from hybridllm import envs
from hybridllm.config import SUPPORTED_EXECUTOR_BACKENDS, SUPPORTED_QUANTIZATION
from hybridllm.engine_args import add_moe_cli_args, add_ray_cli_args, add_stream_cli_args
from hybridllm.entrypoints.logging_config import LOG_LEVELS, configure_logging
from hybridllm.plan.placement_args import (
    PLACEMENT_DEVICES,
    PLACEMENT_DTYPES,
    PlacementArgs,
    parse_memory_size,
)
from hybridllm.platforms.discovery import GpuInfo, HardwareInfo

GiB = 1 << 30


def add_plan_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plan",
        help="show where each layer would run and the predicted speed",
        description="Print the placement plan for a model on this machine: per pipeline stage "
        "and worker the device, layer range, embedding/LM head and tensor-parallel shard; per "
        "device the weights, activation workspace and KV-cache capacity; and the predicted "
        "decode tokens/s at batch 1, 8 and 64 and prefill tokens/s. Device rates are measured "
        "once per machine (about 3 s) and cached in $HYBRIDLLM_CACHE_DIR or ~/.cache/hybridllm.",
    )
    add_plan_args(parser)
    parser.set_defaults(run=run_plan)
    return parser


add_subparser = add_plan_parser  # the name the other subcommand modules use


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="HF model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--device",
        choices=PLACEMENT_DEVICES,
        default="auto",
        help="auto: the GPU when there is one (layers that do not fit go to the CPU); "
        "heterogeneous: ranks beyond the GPU count run on the CPU",
    )
    parser.add_argument(
        "--quantization",
        choices=SUPPORTED_QUANTIZATION,
        default="auto",
        help="auto: CPU workers keep a GGUF file's Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K linears as blocks "
        "(counted at block size); none: every weight at the dtype's size; q8_0/q4_0/q4_1: "
        "a checkpoint's float linears counted as quantized at load into that type",
    )
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="TP ranks")
    parser.add_argument(
        "--pipeline-parallel-size", "-pp", type=int, default=1, help="pipeline stages"
    )
    parser.add_argument(
        "--gpu-layers",
        "-ngl",
        type=int,
        default=None,
        help="like llama.cpp -ngl: the last N layers and the LM head on the GPU, the rest on the CPU",
    )
    add_stream_cli_args(parser)
    add_moe_cli_args(parser)
    parser.add_argument(
        "--max-gpu-memory", type=_parse_memory_size, default=None, help="cap per GPU, e.g. 8GiB"
    )
    parser.add_argument(
        "--max-cpu-memory",
        type=_parse_memory_size,
        default=None,
        help="cap for all CPU workers (default: 90%% of available RAM)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of each GPU's memory the plan may use",
    )
    parser.add_argument(
        "--layer-split",
        type=_parse_layer_split,
        default=None,
        help="layers per pipeline stage, e.g. 10,22",
    )
    parser.add_argument(
        "--dtype",
        choices=PLACEMENT_DTYPES,
        default="auto",
        help="weights dtype; auto: bf16 when a GPU runs layers, fp32 on the CPU only",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=PLACEMENT_DTYPES,
        default="auto",
        help="CPU workers' KV cache, as the engine's flag: auto = float16 beside int8 "
        "activations over GGUF blocks, else the compute dtype",
    )
    parser.add_argument("--cpu-threads", type=int, default=None, help="threads per CPU worker")
    parser.add_argument(
        "--kv-reserve-tokens",
        type=int,
        default=4096,
        help="KV-cache tokens (all sequences together) that must fit beside the weights",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="tokens per step; sizes the activation workspace",
    )
    parser.add_argument(
        "--context-len",
        type=int,
        default=1024,
        help="context each decoding sequence attends over, for the predictions",
    )
    parser.add_argument(
        "--refresh-profile",
        action="store_true",
        help="measure the device rates again instead of reading the cache",
    )
    parser.add_argument(
        "--distributed-executor-backend",
        choices=SUPPORTED_EXECUTOR_BACKENDS,
        default=None,
        help="ray: plan for the machines of a Ray cluster (lists its nodes with their devices "
        "and puts each stage on one); otherwise for this machine",
    )
    add_ray_cli_args(parser)
    parser.add_argument("--log-level", choices=LOG_LEVELS, default=None, help="logging level")
    # Hidden: plan for GPUs this machine does not have (tests, docs). Their rates are the
    # nominal spec-sheet numbers of hybridllm.plan.hardware_profile.
    parser.add_argument(
        "--fake-gpu",
        action="append",
        type=_parse_fake_gpu,
        default=None,
        help="plan for a simulated GPU NAME:MEM_GIB instead of the real ones (repeatable; "
        "nominal H100/H200 rates), e.g. H100:80",
    )
    parser.add_argument(
        "--fake-ram-gib",
        type=float,
        default=None,
        help="plan as if the host had this much RAM (GiB)",
    )


def run_plan(args: argparse.Namespace) -> int:
    from hybridllm.loader import default_model_path, open_model_source
    from hybridllm.loader.block_sizes import cpu_block_sizes
    from hybridllm.plan.cost_model import CostModel
    from hybridllm.plan.cpu_dtype import auto_dtype_for, cpu_kernels_built
    from hybridllm.plan.describe import describe_hardware, describe_plan
    from hybridllm.plan.hardware_profile import load_or_measure_profile
    from hybridllm.plan.memory_budget import memory_budgets
    from hybridllm.plan.planner import build_plan, plan_model_size
    from hybridllm.platforms.discovery import discover_hardware

    configure_logging(args.log_level, default="warning")
    path = args.model or default_model_path()
    source = open_model_source(path)
    hf_config = source.hf_config
    # HYBRIDLLM_CPU_KERNELS=0 turns the kernels off; blocks are kept only where they are built
    cpu_blocks = cpu_block_sizes(
        source, hf_config, args.quantization, lambda: cpu_kernels_built(True)
    )
    int8_blocks = cpu_blocks is not None and envs.read(envs.GGUF_ACTIVATIONS) == "int8"
    placement = dataclasses.replace(placement_args_from_cli(args), int8_blocks=int8_blocks)
    nodes = None
    if args.distributed_executor_backend == "ray":
        from hybridllm.executor import ray_cluster
        from hybridllm.plan.cluster import cluster_hardware, describe_cluster

        ray_cluster.connect(args.ray_address)
        nodes = ray_cluster.cluster_nodes()
        hw = _with_fakes(cluster_hardware(nodes), args)
    else:
        hw = _with_fakes(discover_hardware(include_gpus=not args.fake_gpu), args)
    profile = load_or_measure_profile(hw, refresh=args.refresh_profile)
    if args.dtype == "auto":  # what "auto" means if the plan ends CPU-only, as the engine decides
        rates = (profile.cpu.fp32_flops, profile.cpu.bf16_flops)
        auto = auto_dtype_for(hf_config, args.quantization, cpu_blocks, lambda: rates)
        placement = dataclasses.replace(placement, cpu_auto_dtype=auto)
    cost = CostModel(profile, context_len=args.context_len)
    plan = build_plan(hf_config, placement, hw, cost, cpu_blocks)
    size = plan_model_size(hf_config, placement, hw, cpu_blocks)
    names = None
    if nodes is not None:
        from hybridllm.plan.cluster import assign_nodes

        plan = assign_nodes(plan, nodes, args.cpu_threads)
        names = {n.node_id: n.name for n in nodes}
        print(describe_cluster(nodes))
    print(describe_hardware(hw, profile))
    prediction = cost.predict(plan, size)
    budgets = memory_budgets(hw, placement)
    print(describe_plan(plan, size, budgets, prediction, path, node_names=names))
    return 0


def placement_args_from_cli(args: argparse.Namespace) -> PlacementArgs:
    return PlacementArgs(
        device=args.device,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        gpu_layers=args.gpu_layers,
        max_gpu_memory=args.max_gpu_memory,
        max_cpu_memory=args.max_cpu_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        layer_split=args.layer_split,
        cpu_threads=args.cpu_threads,
        kv_reserve_tokens=args.kv_reserve_tokens,
        max_num_batched_tokens=args.max_num_batched_tokens,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        stream_threshold=args.stream_threshold,
        stream_device=args.stream_device,
        cpu_moe=args.cpu_moe,
        n_cpu_moe=args.n_cpu_moe,
    )


def _with_fakes(hw: HardwareInfo, args: argparse.Namespace) -> HardwareInfo:
    if args.fake_gpu:
        gpus = tuple(
            GpuInfo(i, name, int(gib * GiB), int(gib * GiB), simulated=True)
            for i, (name, gib) in enumerate(args.fake_gpu)
        )
        hw = dataclasses.replace(hw, gpus=gpus)
    if args.fake_ram_gib is not None:
        ram = int(args.fake_ram_gib * GiB)
        hw = dataclasses.replace(hw, total_ram=ram, available_ram=ram)
    return hw


def _parse_memory_size(text: str) -> int:
    try:
        return parse_memory_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parse_layer_split(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"layer split must be comma-separated layer counts, e.g. 10,22; got {text!r}"
        ) from None


def _parse_fake_gpu(text: str) -> tuple[str, float]:
    name, _, gib = text.rpartition(":")
    try:
        return name or "GPU", float(gib)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"fake GPU must be NAME:MEM_GIB, e.g. H100:80; got {text!r}"
        ) from None


def main(argv: list[str] | None = None) -> int:
    """Run `plan` on its own (before it is wired into the `hybridllm` command)."""
    from hybridllm.entrypoints.cli import add_environment_help

    parser = argparse.ArgumentParser(prog="hybridllm")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    add_environment_help(parser)
    args = parser.parse_args(["plan", *(sys.argv[1:] if argv is None else argv)])
    try:
        return run_plan(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"hybridllm plan: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
