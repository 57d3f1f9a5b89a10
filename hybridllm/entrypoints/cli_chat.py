"""`hybridllm chat`: an interactive chat with streaming replies and history, in process."""

from __future__ import annotations

import argparse
import itertools
import sys

from hybridllm.engine_args import EngineArgs
from hybridllm.entrypoints.cli_sampling import (
    add_sampling_args,
    load_engine,
    sampling_params_from_args,
    stream_text,
)
from hybridllm.entrypoints.cli_serve import add_model_arg
from hybridllm.entrypoints.logging_config import LOG_LEVELS, configure_logging

HELP = "commands: /exit or /quit to leave, /reset to forget the conversation, /help"


def add_subparser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "chat",
        help="chat with a model interactively",
        description="Chat in this process (no server): replies stream as they are generated "
        f"and the conversation is kept. {HELP}.",
    )
    add_model_arg(parser)
    parser.add_argument("--system", default=None, help="system prompt of the conversation")
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=None,
        help="logging level (default: $HYBRIDLLM_LOGGING_LEVEL or warning)",
    )
    add_sampling_args(parser, max_tokens=512)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, default="warning")
    params = sampling_params_from_args(args)
    engine = load_engine(args)
    tokenizer = engine.get_tokenizer()
    system = [{"role": "system", "content": args.system}] if args.system else []
    history = list(system)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"chatting with {engine.model_config.model} ({HELP})")
    try:
        for turn in itertools.count():
            try:
                line = input("> " if interactive else "")
            except EOFError:
                break
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                break
            if text == "/reset":
                history = list(system)
                print("(conversation cleared)")
                continue
            if text == "/help":
                print(HELP)
                continue
            history.append({"role": "user", "content": text})
            prompt = tokenizer.apply_chat_template(
                history, tokenize=False, add_generation_prompt=True
            )
            prompt_ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
            reply = ""
            try:
                for delta, output in stream_text(engine, f"turn-{turn}", prompt_ids, params):
                    sys.stdout.write(delta)
                    sys.stdout.flush()
                    reply = output.outputs[0].text
            except ValueError as exc:  # e.g. the history outgrew the context
                history.pop()
                print(f"error: {exc} (use /reset to start over)", file=sys.stderr)
                continue
            except KeyboardInterrupt:  # Ctrl-C stops the reply, not the chat
                print("\n(interrupted)")
            sys.stdout.write("\n")
            history.append({"role": "assistant", "content": reply})
    finally:
        engine.shutdown()
    return 0
