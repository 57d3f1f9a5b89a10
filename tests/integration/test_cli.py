"""The `hybridllm` command: every flag documented; generate, chat and offline benches run."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from hybridllm.entrypoints.cli import build_parser, main
from tests.integration.openai_server import REPO_ROOT

TINY_ENGINE = ["--max-model-len", "256", "--max-num-seqs", "8"]
GREEDY_6 = ["--max-tokens", "6", "--temperature", "0"]


@pytest.fixture(scope="module")
def offline_llm():
    """The offline API on the CLI's engine settings: the reference for its greedy text."""
    from hybridllm import LLM

    llm = LLM(max_model_len=256, max_num_seqs=8, use_tqdm=False)
    yield llm
    llm.shutdown()


def greedy_6():
    from hybridllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=6)


def run_cli(*args: str, stdin: str | None = None, timeout: float = 240):
    return subprocess.run(
        [sys.executable, "-m", "hybridllm", *args],
        cwd=REPO_ROOT,
        input=stdin,
        text=True,
        capture_output=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
    )


def _subparsers(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name, sub
                for inner_name, inner in _subparsers(sub):
                    yield f"{name} {inner_name}", inner


def test_every_subcommand_and_flag_has_help():
    commands = dict(_subparsers(build_parser()))
    assert {
        "serve",
        "generate",
        "chat",
        "bench",
        "bench serve",
        "bench throughput",
        "bench latency",
        "plan",
    } <= set(commands)
    for name, parser in commands.items():
        assert parser.description, name
        for action in parser._actions:
            if action.option_strings or action.dest == "model":
                assert action.help and action.help != argparse.SUPPRESS, (name, action.dest)


@pytest.mark.parametrize("command", [["--help"], ["serve", "--help"], ["bench", "serve", "--help"]])
def test_help_exits_zero(command, capsys):
    with pytest.raises(SystemExit) as info:
        main(command)
    assert info.value.code == 0
    assert "usage: hybridllm" in capsys.readouterr().out


def test_serve_flags_reach_engine_args():
    from hybridllm.engine_args import EngineArgs

    args = build_parser().parse_args(
        [
            "serve",
            "/models/x",
            "--port",
            "9001",
            "--max-model-len",
            "512",
            "--api-key",
            "k",
            "--served-model-name",
            "a",
            "b",
            "--pooling",
            "mean",
            "--no-enable-prefix-caching",
        ]
    )
    assert (args.port, args.api_key, args.served_model_name, args.pooling) == (
        9001,
        "k",
        ["a", "b"],
        "mean",
    )
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.model == "/models/x" and engine_args.max_model_len == 512
    assert engine_args.enable_prefix_caching is False
    assert build_parser().parse_args(["serve"]).host == "127.0.0.1"


def test_bad_flag_values_are_one_line_errors(capsys):
    assert main(["generate", "--max-tokens", "4"]) == 2  # neither --prompt nor --prompts-file
    assert "exactly one of --prompt or --prompts-file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["serve", "--port", "eighty"])
    assert info.value.code == 2


@pytest.mark.slow
def test_generate_one_prompt_and_a_file(tmp_path, offline_llm):
    expected = [
        out.outputs[0].text
        for out in offline_llm.generate(["The capital of France is", "1, 2, 3,"], greedy_6())
    ]
    assert all(expected), expected
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The capital of France is\n\n" + json.dumps({"prompt": "1, 2, 3,"}) + "\n")
    one = run_cli("generate", "--prompt", "The capital of France is", *GREEDY_6, *TINY_ENGINE)
    assert one.returncode == 0, one.stderr
    # The streamed deltas add up to the offline API's greedy text, then a newline.
    assert one.stdout == expected[0] + "\n"
    many = run_cli("generate", "--prompts-file", str(prompts), *GREEDY_6, *TINY_ENGINE)
    assert many.returncode == 0, many.stderr
    # Each prompt's header, then its text, in the order they finish.
    blocks = [
        f"=== [0] 'The capital of France is'\n{expected[0]}\n",
        f"=== [1] '1, 2, 3,'\n{expected[1]}\n",
    ]
    assert many.stdout in (blocks[0] + blocks[1], blocks[1] + blocks[0]), many.stdout


@pytest.mark.slow
def test_chat_streams_replies_and_handles_commands(offline_llm):
    from hybridllm.entrypoints.cli_chat import HELP

    session = "Name a fruit.\n/help\nAnd a color?\n/reset\nHello\n/exit\nnot read\n"
    result = run_cli("chat", "--system", "Be brief.", *GREEDY_6, *TINY_ENGINE, stdin=session)
    assert result.returncode == 0, result.stderr
    # The replies the offline API gives the same conversations: /reset keeps the system
    # prompt and drops the rest; "not read" after /exit gets none.
    system = {"role": "system", "content": "Be brief."}

    def reply(*turns):
        messages = [system]
        for i, turn in enumerate(turns):
            messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": turn})
        [out] = offline_llm.chat([messages], greedy_6())
        assert out.outputs[0].text and len(out.outputs[0].token_ids) <= 6
        return out.outputs[0].text

    fruit = reply("Name a fruit.")
    color = reply("Name a fruit.", fruit, "And a color?")
    hello = reply("Hello")
    assert color != reply("And a color?")  # the history really changes the second reply
    expected = f"{fruit}\n{HELP}\n{color}\n(conversation cleared)\n{hello}\n"
    assert result.stdout == expected


@pytest.mark.slow
def test_offline_throughput_and_latency_benches(tmp_path):
    out = tmp_path / "throughput.json"
    result = run_cli(
        "bench",
        "throughput",
        "--num-prompts",
        "4",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--output-json",
        str(out),
        *TINY_ENGINE,
    )
    assert result.returncode == 0, result.stderr
    assert "output tokens/s" in result.stdout
    record = json.loads(out.read_text())
    assert record["num_prompts"] == 4 and record["output_tokens_per_s"] > 0
    # 40-token prompts: two full KV blocks each, which the prefix cache serves from the second
    # run on unless every run draws fresh prompts
    for fresh in (False, True):
        out = tmp_path / f"latency-{fresh}.json"
        result = run_cli(
            "bench",
            "latency",
            "--batch-size",
            "2",
            "--input-len",
            "40",
            "--output-len",
            "4",
            "--num-iters",
            "2",
            "--num-iters-warmup",
            "1",
            "--output-json",
            str(out),
            *(["--fresh-prompts"] if fresh else []),
            *TINY_ENGINE,
        )
        assert result.returncode == 0, result.stderr
        record = json.loads(out.read_text())
        assert len(record["latencies_s"]) == 2 and record["avg_latency_s"] > 0
        assert record["fresh_prompts"] is fresh
        cached = record["cached_prompt_tokens"]
        assert cached == [0, 0] if fresh else all(c >= 2 * 32 for c in cached), cached
