"""Engine flags defined once: every command takes them from the one table, `plan` plans what the
engine would run (--max-model-len, the kernel flags), and the kernel flags reach the config."""

from __future__ import annotations

import argparse
import re

import pytest

from hybridllm.engine_args import EngineArgs
from hybridllm.engine_flags import FLAGS
from hybridllm.entrypoints.cli import build_parser, main
from hybridllm.entrypoints.cli_plan import main as plan_main
from hybridllm.plan import cpu_dtype, hardware_profile
from hybridllm.plan.hardware_profile import CpuRates, HardwareProfile, nominal_gpu_rates

ENGINE_COMMANDS = ("serve", "generate", "chat", "bench throughput", "bench latency")


def commands() -> dict[str, argparse.ArgumentParser]:
    found = {}

    def walk(parser, prefix):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found[f"{prefix}{name}"] = sub
                    walk(sub, f"{prefix}{name} ")

    walk(build_parser(), "")
    return found


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.option_strings[0]: a for a in parser._actions if a.option_strings}


def test_every_command_takes_the_engine_flags_from_the_one_table():
    parsers = commands()
    for name in (*ENGINE_COMMANDS, "plan"):
        actions = options(parsers[name])
        for flag in FLAGS:
            if name == "plan" and not flag.plan:
                assert flag.names[0] not in actions, (name, flag.names[0])
                continue
            action = actions[flag.names[0]]
            assert (tuple(action.option_strings[: len(flag.names)]), action.help) == (
                flag.names,
                flag.help,
            ), (name, flag.names[0])
            assert action.dest == flag.dest


@pytest.fixture
def fixed_rates(monkeypatch):
    """Fixed device rates instead of measuring this busy machine, and kernels said to be built
    (the embedded model's Q4_1 linears are then kept as blocks) without building them."""

    def profile(hw, refresh=False):
        cpu = CpuRates(read_bandwidth=50e9, fp32_flops=1e12, bf16_flops=1e12, threads=32)
        return HardwareProfile(cpu, tuple(nominal_gpu_rates(g.name) for g in hw.gpus))

    monkeypatch.setattr(hardware_profile, "load_or_measure_profile", profile)
    monkeypatch.setattr(cpu_dtype, "cpu_kernels_built", lambda asked: asked)


def plan(capsys, *argv: str) -> str:
    code = plan_main(["--device", "cpu", *argv])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def kv_line(out: str) -> tuple[str, str]:
    """(KV bytes a token on the CPU, tokens reserved)."""
    per_token = re.search(r"^  cpu .* ([\d.]+ KiB) +[\d,]+ tokens$", out, re.M).group(1)
    reserved = re.search(r"KV cache: .*; ([\d,]+) reserved\)", out).group(1)
    return per_token, reserved


def test_plan_reserves_the_kv_of_max_model_len(capsys, fixed_rates):
    # The embedded model's context is 8192: 128 sequences x 256 tokens reach all of it.
    assert kv_line(plan(capsys))[1] == "8,192"
    assert kv_line(plan(capsys, "--max-model-len", "512"))[1] == "512"
    assert kv_line(plan(capsys, "--max-num-seqs", "2"))[1] == "512"
    assert kv_line(plan(capsys, "--kv-reserve-tokens", "100"))[1] == "100"
    assert plan_main(["--max-model-len", "100000"]) == 2
    assert "larger than the model's context (8192)" in capsys.readouterr().err


def test_plan_kv_dtype_follows_the_kernel_flags(capsys, fixed_rates):
    int8 = kv_line(plan(capsys, "--gguf-activations", "int8"))[0]
    fp32 = kv_line(plan(capsys, "--gguf-activations", "fp32"))[0]
    no_kernels = kv_line(plan(capsys, "--gguf-activations", "int8", "--no-cpu-kernels"))[0]
    assert (int8, fp32, no_kernels) == ("22.50 KiB", "45.00 KiB", "45.00 KiB")  # float16 / 32


def test_kernel_flags_land_in_the_config(monkeypatch):
    for name in ("HYBRIDLLM_CPU_KERNELS", "HYBRIDLLM_NATIVE_DECODE_LAYER"):
        monkeypatch.delenv(name, raising=False)
    args = build_parser().parse_args(
        ["generate", "--gguf-activations", "fp32", "--no-cpu-kernels", "--max-model-len", "256"]
    )
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.gguf_activations, engine_args.cpu_kernels) == ("fp32", False)
    assert engine_args.native_decode_layer is None  # not given: the environment decides
    config = engine_args.create_engine_config()
    kernels = config.kernel_config
    assert (kernels.gguf_activations, kernels.cpu_kernels, kernels.native_decode_layer) == (
        "fp32",
        False,
        True,
    )
    args = build_parser().parse_args(["serve", "--native-decode-layer", "--cpu-kernels"])
    assert (args.native_decode_layer, args.cpu_kernels, args.gguf_activations) == (True, True, None)


def test_a_bad_environment_value_is_one_clear_error(monkeypatch, capsys):
    monkeypatch.setenv("HYBRIDLLM_GGUF_ACTIVATIONS", "int4")
    assert main(["generate", "--prompt", "hi", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        "hybridllm generate: error: HYBRIDLLM_GGUF_ACTIVATIONS: expected one of int8, fp32, "
        "got 'int4'"
    )
    with pytest.raises(SystemExit):
        main(["generate", "--gguf-activations", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err


def test_memory_sizes_and_layer_splits_are_read_when_parsed(capsys):
    args = build_parser().parse_args(
        ["generate", "--max-cpu-memory", "2GiB", "--layer-split", "10,20", "-ngl", "4"]
    )
    assert (args.max_cpu_memory, args.layer_split, args.gpu_layers) == (2 << 30, (10, 20), 4)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--layer-split", "10,0"])
    assert "at least one layer per stage" in capsys.readouterr().err
