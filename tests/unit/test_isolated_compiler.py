"""Grammar compiles in child processes: errors, deadlines that kill, crashes, small-first."""

from __future__ import annotations

import json
import signal
import time

import psutil
import pytest

from hybridllm.loader import default_model_path
from hybridllm.loader.open_model import load_tokenizer
from hybridllm.structured.backend import GrammarError
from hybridllm.structured.isolated_compiler import SMALL_GRAMMAR_CHARS, IsolatedCompiler


def optional_properties(n: int, tag: str = "") -> str:
    """A schema whose compile time grows with the square of n (0.6 s at 2,000, 2.4 s at 4,000,
    10.8 s at 16,000 on a loaded 2-core machine)."""
    props = {f"{tag}p{i}": {"type": "integer"} for i in range(n)}
    return json.dumps({"type": "object", "properties": props})


def compile_children() -> list[psutil.Process]:
    return [
        p
        for p in psutil.Process().children()
        if "hybridllm.structured.compile_child" in " ".join(p.cmdline())
    ]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def compiler(tokenizer):
    compiler = IsolatedCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], 1.0)
    yield compiler
    compiler.shutdown()
    assert not compile_children()


def test_compiles_and_reports_errors(compiler):
    assert compiler.submit("regex", "[0-9]{4}").result(60) is None
    with pytest.raises(GrammarError, match="regex"):
        compiler.submit("regex", "(unclosed").result(60)
    # the same child goes on after an error
    assert compiler.submit("choice", '["yes", "no"]').result(60) is None


def test_a_compile_past_its_deadline_is_killed(compiler):
    big = optional_properties(10000)
    assert len(big) > SMALL_GRAMMAR_CHARS
    compiler.submit("regex", "a").result(60)  # both children are started on demand
    start = time.monotonic()
    with pytest.raises(GrammarError, match="did not compile within 1 s"):
        compiler.submit("json", big).result(60)
    assert time.monotonic() - start < 5
    # a fresh child takes the next grammar
    assert compiler.submit("json", optional_properties(10)).result(60) is None


def test_a_crashing_compile_fails_only_its_grammar(compiler):
    compiler.submit("json", optional_properties(1000, "up")).result(60)  # the child is ready
    slow = compiler.submit("json", optional_properties(10000, "crash"))
    time.sleep(0.5)
    children = compile_children()
    for child in children:  # a compiler crash, as a segfault would end it
        child.send_signal(signal.SIGKILL)
    with pytest.raises(GrammarError, match="crashed"):
        slow.result(60)
    psutil.wait_procs(children, timeout=10)
    # the other child died idle: the next grammar goes to a fresh one, whether or not the
    # dispatcher has seen that death yet
    assert compiler.submit("regex", "b+").result(60) is None


def test_small_grammars_do_not_wait_behind_a_large_one(compiler):
    compiler.submit("regex", "a").result(60)
    large = [compiler.submit("json", optional_properties(10000, f"t{i}")) for i in range(3)]
    time.sleep(0.2)
    start = time.monotonic()
    assert compiler.submit("regex", "[a-z]+").result(60) is None
    assert time.monotonic() - start < 1.5
    assert not all(f.done() for f in large)
    for f in large:  # each runs into its deadline in turn, one child after another
        with pytest.raises(GrammarError, match="did not compile"):
            f.result(60)
