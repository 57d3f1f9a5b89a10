"""`hybridllm generate`: complete one prompt (streamed) or a file of prompts, in process."""

from __future__ import annotations

import argparse
import json
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


def add_subparser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate text for a prompt or a file of prompts",
        description="Generate in this process (no server). One prompt streams to the terminal; "
        "--prompts-file runs all its prompts as one batch and prints each result as it finishes.",
    )
    add_model_arg(parser)
    parser.add_argument("--prompt", "-p", default=None, help="the prompt text")
    parser.add_argument(
        "--prompts-file",
        default=None,
        help="a file of prompts: one per line, or JSON lines with a 'prompt' field",
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt as a user message in the model's chat template",
    )
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=None,
        help="logging level (default: $HYBRIDLLM_LOGGING_LEVEL or warning)",
    )
    add_sampling_args(parser)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(run=run)


def read_prompts(path: str) -> list[str]:
    prompts = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                record = json.loads(line)
                if "prompt" not in record:
                    raise ValueError(f"{path}: a JSON line has no 'prompt' field: {line[:80]}")
                prompts.append(record["prompt"])
            else:
                prompts.append(line)
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def run(args: argparse.Namespace) -> int:
    if (args.prompt is None) == (args.prompts_file is None):
        raise ValueError("give exactly one of --prompt or --prompts-file")
    configure_logging(args.log_level, default="warning")
    params = sampling_params_from_args(args)
    prompts = [args.prompt] if args.prompt is not None else read_prompts(args.prompts_file)
    engine = load_engine(args)
    try:
        inputs = [_as_input(engine, p, args.chat) for p in prompts]
        if len(inputs) == 1:
            final = None
            for delta, output in stream_text(engine, "0", inputs[0], params):
                sys.stdout.write(delta)
                sys.stdout.flush()
                final = output
            sys.stdout.write("\n")
            return _exit_code(final) if final is not None else 1
        return _run_batch(engine, prompts, inputs, params)
    finally:
        engine.shutdown()


def _as_input(engine, prompt: str, chat: bool) -> str | list[int]:
    if not chat:
        return prompt
    tokenizer = engine.get_tokenizer()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _run_batch(engine, prompts: list[str], inputs: list, params) -> int:
    failures = 0
    for i, item in enumerate(inputs):
        try:
            engine.add_request(str(i), item, params)
        except ValueError as exc:
            failures += 1
            print(f"=== [{i}] {prompts[i][:60]!r}: error: {exc}", file=sys.stderr)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                i = int(output.request_id)
                print(f"=== [{i}] {prompts[i][:60]!r}")
                print(output.outputs[0].text, flush=True)
                failures += _exit_code(output)
    return 1 if failures else 0


def _exit_code(output) -> int:
    if output.error:
        print(f"error: {output.error}", file=sys.stderr)
        return 1
    return 0
