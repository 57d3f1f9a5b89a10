"""The `hybridllm` command: one entry point with serve / generate / chat / bench / plan subcommands."""

from __future__ import annotations

import argparse
import sys
import textwrap

from hybridllm import envs
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
    add_environment_help(parser)
    return parser


class LineHelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, except that texts keep their line breaks (each line is wrapped on
    its own): the epilog lists one environment variable a line."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        lines = []
        for line in text.splitlines():
            body = line.lstrip()
            lead = indent + line[: len(line) - len(body)]
            hanging = lead + line[: len(line) - len(body)]  # an indented line's wrap goes deeper
            lines.append(textwrap.fill(body, width, initial_indent=lead, subsequent_indent=hanging))
        return "\n".join(lines)


def add_environment_help(parser: argparse.ArgumentParser) -> None:
    """End the --help of `parser` and of every subcommand under it with the environment
    variables the engine reads (hybridllm/envs.py)."""
    listing = "\n".join(f"  {line}" for line in envs.describe().splitlines())
    parser.epilog = f"environment variables:\n{listing}"
    parser.formatter_class = LineHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                add_environment_help(sub)


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
