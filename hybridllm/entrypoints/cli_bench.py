"""`hybridllm bench serve|throughput|latency`: online and offline benchmarks."""

from __future__ import annotations

import argparse

from hybridllm.engine_args import EngineArgs
from hybridllm.entrypoints.cli_serve import add_model_arg
from hybridllm.entrypoints.logging_config import LOG_LEVELS, configure_logging


def add_subparser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="benchmark a server (serve) or the engine in process (throughput, latency)",
        description="Benchmarks. 'serve' loads any OpenAI-compatible server over HTTP; "
        "'throughput' and 'latency' run the engine in this process.",
    )
    kinds = parser.add_subparsers(dest="bench_kind", metavar="KIND", required=True)

    serve = kinds.add_parser(
        "serve",
        help="request and token throughput, TTFT, TPOT and ITL of a running server",
        description="Send --num-prompts requests (random or from --dataset-path) to an "
        "OpenAI-compatible server's --endpoint (/v1/completions or /v1/chat/completions) at "
        "--request-rate (Poisson) with at most --max-concurrency in flight, each on a fresh "
        "connection unless --keep-alive; report throughput, TTFT / TPOT / ITL / E2E latency "
        "(mean, median, p99) and the failed requests by reason (never retried).",
    )
    from hybridllm.benchmarks import serve as bench_serve

    bench_serve.add_cli_args(serve)
    serve.set_defaults(run=lambda args: _run("serve", args))

    for kind, help_text in (
        ("throughput", "offline tokens/s of a batch of random prompts"),
        ("latency", "offline end-to-end latency of one batch, repeated"),
    ):
        sub = kinds.add_parser(kind, help=help_text, description=f"Benchmark: {help_text}.")
        add_model_arg(sub)
        module = _offline_module(kind)
        module.add_cli_args(sub)
        sub.add_argument(
            "--log-level",
            choices=LOG_LEVELS,
            default=None,
            help="logging level (default: $HYBRIDLLM_LOGGING_LEVEL or warning)",
        )
        EngineArgs.add_cli_args(sub)
        sub.set_defaults(run=lambda args, kind=kind: _run(kind, args))


def _offline_module(kind: str):
    if kind == "throughput":
        from hybridllm.benchmarks import throughput

        return throughput
    from hybridllm.benchmarks import latency

    return latency


def _run(kind: str, args: argparse.Namespace) -> int:
    configure_logging(getattr(args, "log_level", None), default="warning")
    if kind == "serve":
        from hybridllm.benchmarks import serve as bench_serve

        return bench_serve.main(args)
    return _offline_module(kind).main(args)
