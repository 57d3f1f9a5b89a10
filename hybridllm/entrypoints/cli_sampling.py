"""Sampling flags shared by `generate` and `chat`, and the in-process streaming helper they use."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

from hybridllm.outputs import RequestOutput
from hybridllm.sampling_params import SamplingParams


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument(
        "--max-tokens",
        type=int,
        default=max_tokens,
        help=f"most tokens to generate per reply (default {max_tokens})",
    )
    g.add_argument(
        "--temperature",
        type=float,
        default=0.7,
        help="softmax temperature; 0 is greedy (default 0.7)",
    )
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens; 0: all")
    g.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="drop tokens below min_p times the top probability (default 0)",
    )
    g.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="> 1 discourages repeating prompt and output tokens (default 1.0)",
    )
    g.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="OpenAI presence penalty in [-2, 2] (default 0)",
    )
    g.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="OpenAI frequency penalty in [-2, 2] (default 0)",
    )
    g.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="stop when this text is generated (repeatable)",
    )
    g.add_argument(
        "--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token"
    )
    g.add_argument(
        "--sampling-seed",
        type=int,
        default=None,
        help="seed of this run's sampling (reproducible output at temperature > 0)",
    )


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        stop=list(args.stop),
        ignore_eos=args.ignore_eos,
        seed=args.sampling_seed,
    )


def stream_text(
    engine: Any, request_id: str, prompt: str | list[int], params: SamplingParams
) -> Iterator[tuple[str, RequestOutput]]:
    """Run one request on an idle engine, yielding (new text, output) after every step."""
    engine.add_request(request_id, prompt, params)
    shown = 0
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id != request_id:
                    continue
                text = output.outputs[0].text
                yield text[shown:], output
                shown = len(text)
                if output.finished:
                    return
    finally:
        # Ctrl-C or a closed pipe mid-reply: drop the request so the engine is idle again.
        if engine.has_unfinished_requests():
            engine.abort_request(request_id)
            while engine.has_unfinished_requests():
                engine.step()


def load_engine(args: argparse.Namespace) -> Any:
    from hybridllm.engine.llm_engine import LLMEngine
    from hybridllm.engine_args import EngineArgs

    return LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
