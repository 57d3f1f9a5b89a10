"""`hybridllm plan`: prints stages, memory per device and predictions; flags reach the planner."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybridllm.entrypoints.cli_plan import main
from hybridllm.loader.gguf_cache import cache_root

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
    max_position_embeddings=8192, rms_norm_eps=1e-5,
)  # fmt: skip


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One fresh hardware-profile cache for the module: the CPU is measured once. Its
    `cpu_kernels` is the session's, so a subprocess loads the built library instead of
    building its own (minutes on 2 cores, near the subprocess's timeout)."""
    path = tmp_path_factory.mktemp("hybridllm_cache")
    shared = Path(cache_root()) / "cpu_kernels"
    shared.mkdir(parents=True, exist_ok=True)
    (path / "cpu_kernels").symlink_to(shared, target_is_directory=True)
    return str(path)


@pytest.fixture(scope="module")
def llama8b_folder(tmp_path_factory):
    """A config-only Llama-3-8B-shaped folder: planning never reads weights."""
    folder = tmp_path_factory.mktemp("llama3_8b_shaped")
    (folder / "config.json").write_text(json.dumps(LLAMA3_8B))
    return str(folder)


def stage_devices(output: str) -> list[str]:
    """'stage N: ...' headers' first worker devices, in order."""
    devices, in_stage = [], False
    for line in output.splitlines():
        if line.lstrip().startswith("stage "):
            in_stage = True
        elif in_stage and line.lstrip().startswith("rank "):
            devices.append(re.search(r"rank \d+: (\S+)", line).group(1))
            in_stage = False
    return devices


def test_plan_subprocess_splits_a_model_too_big_for_the_gpu(cache_dir, llama8b_folder):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridllm.entrypoints.cli_plan",
            llama8b_folder,
            "--fake-gpu",
            "H100:8",
            "--fake-ram-gib",
            "64",
        ],  # fmt: skip
        cwd=REPO_ROOT,
        text=True,
        capture_output=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": REPO_ROOT, "HYBRIDLLM_CACHE_DIR": cache_dir},
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "cuda:0: H100, 8.00 GiB (simulated); nominal" in out
    assert "llama, 32 layers, bfloat16, 14.96 GiB of weights" in out
    # The LM head sits on the GPU, the CPU stage takes the first layers and the embedding.
    assert re.search(r"stage 0: embedding \+ layers \[0, (\d+)\)\n", out)
    assert re.search(r"stage 1: layers \[\d+, 32\) \+ final norm \+ LM head \+ sampling", out)
    assert stage_devices(out) == ["cpu", "cuda:0"]
    assert re.search(r"cuda:0 +7\.20 GiB .* tokens", out)
    for batch in (1, 8, 64):
        assert re.search(rf"decode batch +{batch}: +[\d,.]+ tokens/s", out)
    assert re.search(r"prefill: +[\d,.]+ tokens/s", out)
    assert set(os.listdir(cache_dir)) - {"cpu_kernels"}  # the measured CPU rates were cached


def run_plan(capsys, monkeypatch, cache_dir, *argv: str) -> tuple[int, str, str]:
    monkeypatch.setenv("HYBRIDLLM_CACHE_DIR", cache_dir)
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_plan_of_the_default_model_fits_the_gpu(capsys, monkeypatch, cache_dir):
    code, out, _ = run_plan(capsys, monkeypatch, cache_dir, "--fake-gpu", "H200:141")
    assert code == 0
    assert "SmolLM2-135M-Instruct" in out and "llama, 30 layers" in out
    assert "stage 0: embedding + layers [0, 30) + final norm + LM head + sampling" in out
    assert stage_devices(out) == ["cuda:0"]


@pytest.mark.parametrize(
    "flags, devices, first_stage",
    [
        (["--fake-gpu", "H100:80", "--max-gpu-memory", "8GiB"], ["cpu", "cuda:0"], None),
        (["--fake-gpu", "H100:80", "--gpu-layers", "10"], ["cpu", "cuda:0"], "[0, 22)"),
        (["--fake-gpu", "H100:80", "--device", "heterogeneous", "--layer-split", "12,20"],
         ["cuda:0", "cpu"], "[0, 12)"),
        (["--device", "cpu", "-pp", "2", "--dtype", "bfloat16"], ["cpu", "cpu"], "[0, 16)"),
    ],
)  # fmt: skip
def test_plan_flags_reach_the_planner(capsys, monkeypatch, cache_dir, llama8b_folder, flags,
                                      devices, first_stage):  # fmt: skip
    code, out, err = run_plan(capsys, monkeypatch, cache_dir, llama8b_folder, *flags)
    assert code == 0, err
    assert stage_devices(out) == devices
    if first_stage:
        assert f"stage 0: embedding + layers {first_stage}" in out


def test_plan_errors_are_one_clear_line(capsys, monkeypatch, cache_dir, llama8b_folder):
    code, _, err = run_plan(capsys, monkeypatch, cache_dir, llama8b_folder, "--device", "cuda")
    assert code == 2 and "hybridllm plan: error: device 'cuda' was asked for but no CUDA GPU" in err
    code, _, err = run_plan(
        capsys, monkeypatch, cache_dir, llama8b_folder, "--fake-gpu", "H100:8", "--gpu-layers", "30"
    )
    assert code == 2 and re.search(r"cuda:0 needs .* short by .*lower --gpu-layers", err)
    with pytest.raises(SystemExit):
        main([llama8b_folder, "--max-gpu-memory", "8 parsecs"])
    assert "cannot read memory size '8 parsecs'" in capsys.readouterr().err


def test_plan_shows_where_cpu_stages_stream_and_the_crossover(capsys, monkeypatch, cache_dir,
                                                              llama8b_folder):  # fmt: skip
    args = ("--fake-gpu", "RTX3060:12", "--fake-ram-gib", "64")
    code, out, err = run_plan(capsys, monkeypatch, cache_dir, llama8b_folder, *args)
    assert code == 0, err
    assert stage_devices(out) == ["cpu", "cuda:0"]
    line = next(x for x in out.splitlines() if "streaming to" in x)
    assert re.search(r"streaming to cuda:0 (for steps of >= [\d,]+ tokens|never)", line), line
    assert "dense bfloat16 copies of the layers" in line and "cost-model crossover: decode" in line
    code, out, _ = run_plan(
        capsys, monkeypatch, cache_dir, llama8b_folder, *args, "--stream-threshold", "-1"
    )
    assert code == 0 and "streaming to" not in out


def test_plan_json_and_svg_describe_the_same_plan_as_the_text(
    capsys, monkeypatch, cache_dir, llama8b_folder, tmp_path
):
    flags = [llama8b_folder, "--fake-gpu", "H100:80", "--gpu-layers", "10"]
    code, text, _ = run_plan(capsys, monkeypatch, cache_dir, *flags)
    assert code == 0
    picture = tmp_path / "plan.svg"
    code, out, _ = run_plan(capsys, monkeypatch, cache_dir, *flags, "--json", "--svg", str(picture))
    assert code == 0
    report = json.loads(out)  # --json prints JSON only
    # the same plan (the free RAM, and so the KV capacity, may move between the two runs)
    assert stage_devices(report["text"]) == stage_devices(text) == ["cpu", "cuda:0"]
    stages = [
        (s["layer_start"], s["layer_end"], s["workers"][0]["device"]) for s in report["stages"]
    ]
    assert stages == [(0, 22, "cpu"), (22, 32, "cuda:0")]
    assert [d["device"] for d in report["devices"]] == ["cpu", "cuda:0"]
    assert report["hardware"]["gpus"][0]["simulated"] is True
    assert report["prediction"]["decode"][0]["batch"] == 1
    svg = picture.read_text()
    assert svg.count('class="layer cpu"') == 22 and svg.count('class="layer gpu"') == 10
