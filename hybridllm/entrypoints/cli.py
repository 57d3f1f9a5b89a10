"""The `hybridllm` command: one entry point with serve / generate / chat / bench / plan subcommands."""

from __future__ import annotations

import argparse
import sys

from hybridllm.entrypoints import cli_bench, cli_chat, cli_generate, cli_plan, cli_serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridllm",
        description="Run an LLM across a GPU and the host CPU: serve it over an "
        "OpenAI-compatible API, generate, chat, or benchmark.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (cli_serve, cli_generate, cli_chat, cli_bench, cli_plan):
        module.add_subparser(subparsers)
    return parser


def _version() -> str:
    import hybridllm

    return hybridllm.__version__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args) or 0
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as exc:
        # Bad flags or files found after parsing (model path, dataset): one line, no traceback.
        print(f"hybridllm {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
