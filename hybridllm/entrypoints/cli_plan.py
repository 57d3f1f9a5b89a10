"""`hybridllm plan [MODEL]`: print the placement plan, memory per device and predicted tokens/s."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from hybridllm.engine_args import EngineArgs
from hybridllm.engine_flags import add_engine_flags
from hybridllm.entrypoints.logging_config import LOG_LEVELS, configure_logging
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
    add_engine_flags(parser, plan_only=True)  # the engine's own flags: the same plan
    g = parser.add_argument_group("plan")
    g.add_argument(
        "--kv-reserve-tokens",
        type=int,
        default=None,
        help="KV-cache tokens (all sequences together) that must fit beside the weights "
        "(default: what the engine reserves, min(--max-model-len, 256 x --max-num-seqs))",
    )
    g.add_argument(
        "--context-len",
        type=int,
        default=1024,
        help="context each decoding sequence attends over, for the predictions",
    )
    g.add_argument(
        "--refresh-profile",
        action="store_true",
        help="measure the device rates again instead of reading the cache",
    )
    g.add_argument("--log-level", choices=LOG_LEVELS, default=None, help="logging level")
    # Plan for GPUs this machine does not have (tests, docs). Their rates are the nominal
    # spec-sheet numbers of hybridllm.plan.hardware_profile.
    g.add_argument(
        "--fake-gpu",
        action="append",
        type=_parse_fake_gpu,
        default=None,
        help="plan for a simulated GPU NAME:MEM_GIB instead of the real ones (repeatable; "
        "nominal H100/H200 rates), e.g. H100:80",
    )
    g.add_argument(
        "--fake-ram-gib",
        type=float,
        default=None,
        help="plan as if the host had this much RAM (GiB)",
    )


def run_plan(args: argparse.Namespace) -> int:
    from hybridllm.loader import default_model_path, open_model_source
    from hybridllm.loader.fp8_block import onload_quantization
    from hybridllm.plan.cost_model import CostModel
    from hybridllm.plan.cpu_dtype import auto_dtype_for
    from hybridllm.plan.describe import describe_hardware, describe_plan
    from hybridllm.plan.hardware_profile import load_or_measure_profile
    from hybridllm.plan.memory_budget import memory_budgets
    from hybridllm.plan.planner import build_plan, plan_model_size
    from hybridllm.platforms.discovery import discover_hardware
    from hybridllm.worker.kv_cache_budget import cpu_kv_budget

    configure_logging(args.log_level, default="warning")
    engine_args = EngineArgs.from_cli_args(args)
    kernels = engine_args.kernel_config()
    path = args.model or default_model_path()
    source = open_model_source(path)
    hf_config = source.hf_config
    # The context and step budget the engine would run with decide the KV and workspace.
    max_model_len = engine_args.resolve_max_model_len(hf_config)
    batched = engine_args.resolve_max_num_batched_tokens(max_model_len)
    cpu_blocks = engine_args.kept_cpu_blocks(source, hf_config, kernels)
    int8_blocks = kernels.int8_over_blocks(cpu_blocks)
    placement = engine_args.placement_args(max_model_len, batched, int8_blocks=int8_blocks)
    if args.kv_reserve_tokens is not None:
        placement = dataclasses.replace(placement, kv_reserve_tokens=args.kv_reserve_tokens)
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
        quantization = onload_quantization(args.quantization, source)  # fp8 folders: q8_0
        auto = auto_dtype_for(hf_config, quantization, cpu_blocks, lambda: rates)
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
    # the KV cache the CPU workers would allocate (resident as it fills), as the engine sizes it
    host_kv = cpu_kv_budget(hw.available_ram, 1, None, None, 0)
    print(describe_plan(plan, size, budgets, prediction, path, names, host_kv))
    return 0


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
