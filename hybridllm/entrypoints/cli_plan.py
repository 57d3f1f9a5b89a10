"""`hybridllm plan [MODEL]`: print the placement plan, memory per device and predicted tokens/s."""

from __future__ import annotations

import argparse
import dataclasses
import json
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
    g.add_argument(
        "--json",
        action="store_true",
        help="print the plan as JSON (what the server's /v1/plan answers) instead of text",
    )
    g.add_argument(
        "--svg",
        metavar="FILE",
        default=None,
        help="also write the placement picture (the web page's) to FILE as SVG",
    )
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
    from hybridllm.loader.fp8_block import onload_quantization
    from hybridllm.plan.cpu_dtype import auto_dtype_for
    from hybridllm.plan.hardware_profile import load_or_measure_profile
    from hybridllm.plan.report import build_plan_report
    from hybridllm.platforms.discovery import discover_hardware

    configure_logging(args.log_level, default="warning")
    engine_args = EngineArgs.from_cli_args(args)
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

    def auto_dtype(placement, source, hf_config, cpu_blocks):
        if args.dtype != "auto":
            return placement
        # what "auto" means if the plan ends CPU-only, as the engine decides
        rates = (profile.cpu.fp32_flops, profile.cpu.bf16_flops)
        quantization = onload_quantization(args.quantization, source)  # fp8 folders: q8_0
        auto = auto_dtype_for(hf_config, quantization, cpu_blocks, lambda: rates)
        return dataclasses.replace(placement, cpu_auto_dtype=auto)

    report = build_plan_report(
        engine_args,
        hw,
        profile,
        context_len=args.context_len,
        kv_reserve_tokens=args.kv_reserve_tokens,
        nodes=nodes,
        placement_hook=auto_dtype,
    )
    data = report.to_dict() if args.svg or args.json else None
    if args.svg:
        from hybridllm.plan.svg import plan_svg

        with open(args.svg, "w", encoding="utf-8") as f:
            f.write(plan_svg(data))
    if args.json:
        print(json.dumps(data, indent=1))
        return 0
    if nodes is not None:
        print(describe_cluster(nodes))
    print(report.text())
    if args.svg:
        print(f"placement picture written to {args.svg}")
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
