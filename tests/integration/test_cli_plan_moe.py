"""`hybridllm plan` of a mixture of experts: --cpu-moe, --n-cpu-moe and the automatic split under --fake-gpu."""

from __future__ import annotations

import json
import re

import pytest

from hybridllm.plan import hardware_profile
from hybridllm.plan.hardware_profile import CpuRates, HardwareProfile, nominal_gpu_rates
from tests.integration.test_cli_plan import run_plan, stage_devices

# Qwen3-30B-A3B's shape: 57 GiB of bf16 weights, 54 GiB of them routed experts
QWEN3_30B = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
    intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
    num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6, norm_topk_prob=True,
    tie_word_embeddings=False,
)  # fmt: skip


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """Fixed device rates instead of measuring this busy machine (the CLI reads them at run)."""

    def profile(hw, refresh=False):
        cpu = CpuRates(read_bandwidth=50e9, fp32_flops=1e12, bf16_flops=1e12, threads=32)
        return HardwareProfile(cpu, tuple(nominal_gpu_rates(g.name) for g in hw.gpus))

    monkeypatch.setattr(hardware_profile, "load_or_measure_profile", profile)
    return str(tmp_path)


@pytest.fixture(scope="module")
def qwen3_moe_folder(tmp_path_factory):
    """A config-only folder: planning never reads weights."""
    folder = tmp_path_factory.mktemp("qwen3_30b_a3b_shaped")
    (folder / "config.json").write_text(json.dumps(QWEN3_30B))
    return str(folder)


def experts_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("routed experts"))


@pytest.mark.parametrize(
    "flags, host_layers, gpu_experts",
    [
        (["--fake-gpu", "H100:80"], None, "cuda:0: 48 layers x 128"),  # fits whole
        (["--fake-gpu", "H100:80", "--cpu-moe"], "[0, 48)", None),
        (["--fake-gpu", "H100:80", "--n-cpu-moe", "10"], "[0, 10)", "cuda:0: 38 layers x 128"),
        (["--fake-gpu", "RTX4090:24"], "automatic", "cuda:0"),  # too big: experts move first
    ],
)
def test_plan_places_routed_experts(
    capsys, monkeypatch, cache_dir, qwen3_moe_folder, flags, host_layers, gpu_experts
):
    argv = (qwen3_moe_folder, "--fake-ram-gib", "256", *flags)
    code, out, err = run_plan(capsys, monkeypatch, cache_dir, *argv)
    assert code == 0, err
    assert "qwen3_moe, 48 layers" in out and stage_devices(out) == ["cuda:0"]
    line = experts_line(out)
    assert line.startswith("routed experts (top-8 of 128):")
    if host_layers is None:
        assert "cpu:" not in line and "on cpu" not in out
    elif host_layers == "automatic":
        match = re.search(r"routed experts of layers \[0, (\d+)\) on cpu", out)
        assert match and 0 < int(match.group(1)) < 48
    else:
        assert f"routed experts of layers {host_layers} on cpu" in out
        assert re.search(r"^  cpu .*GiB", out, re.M)  # the host's memory row holds them
    if gpu_experts:
        assert gpu_experts in line
    assert re.search(r"decode batch   1: +[\d,.]+ tokens/s", out)


def test_cpu_moe_on_a_dense_model_is_one_clear_error(capsys, monkeypatch, cache_dir, tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(dict(QWEN3_30B, architectures=["Qwen3ForCausalLM"], model_type="qwen3"))
    )
    code, _, err = run_plan(
        capsys, monkeypatch, cache_dir, str(tmp_path), "--fake-gpu", "H100:80", "--cpu-moe"
    )
    assert code == 2 and "not a mixture-of-experts model" in err


@pytest.mark.parametrize(
    "quantization, bytes_per_param", [("q4_0", 18 / 32), ("q8_0", 34 / 32), ("none", 2)]
)
def test_plan_counts_host_experts_at_the_onload_type(
    capsys, monkeypatch, cache_dir, qwen3_moe_folder, quantization, bytes_per_param
):
    """--quantization q8_0|q4_0|q4_1 quantizes the routed experts at load too: the host holds
    them at the block type's bytes (Q4_0: 18 bytes per 32 weights), not the checkpoint's bf16."""
    from hybridllm.plan import cpu_dtype

    monkeypatch.setattr(cpu_dtype, "cpu_kernels_built", lambda asked: True)
    argv = (qwen3_moe_folder, "--fake-ram-gib", "256", "--fake-gpu", "RTX4090:24", "--cpu-moe")
    code, out, err = run_plan(capsys, monkeypatch, cache_dir, *argv, "--quantization", quantization)
    assert code == 0, err
    c = QWEN3_30B
    experts = c["num_hidden_layers"] * c["num_experts"] * 3 * c["hidden_size"]
    experts *= c["moe_intermediate_size"]
    expected_gib = experts * bytes_per_param / 2**30  # q4_0: 15.19 GiB, bf16: 54.00 GiB
    match = re.search(r"routed experts of layers \[0, 48\) on cpu \(([\d.]+) GiB\)", out)
    assert match, out
    assert float(match.group(1)) == pytest.approx(expected_gib, abs=0.01)
    assert f"cpu: 48 layers x 128 ({match.group(1)} GiB)" in experts_line(out)


# DeepSeek-V3's shape with fewer layers (planning reads the config alone)
DEEPSEEK_V3 = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=7168,
    intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256,
    n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, num_hidden_layers=8,
    first_k_dense_replace=3, num_attention_heads=128, num_key_value_heads=128,
    kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, vocab_size=129280, max_position_embeddings=163840, rms_norm_eps=1e-6,
    tie_word_embeddings=False, num_nextn_predict_layers=1, torch_dtype="bfloat16",
)  # fmt: skip
GiB = 1 << 30


def test_plan_counts_the_mtp_layer_beside_the_last_stage(capsys, monkeypatch, cache_dir, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    flags = [str(tmp_path), "--fake-gpu", "H100:80", "--fake-ram-gib", "512", "--cpu-moe"]
    mtp = json.dumps({"method": "mtp", "num_speculative_tokens": 1})
    _, plain, _ = run_plan(capsys, monkeypatch, cache_dir, *flags, "--json")
    code, out, err = run_plan(capsys, monkeypatch, cache_dir, *flags, "--json",
                              "--speculative-config", mtp)  # fmt: skip
    assert code == 0, err
    before, after = json.loads(plain), json.loads(out)
    gpu = [d for d in after["devices"] if d["device"] == "cuda:0"][0]
    gpu_before = [d for d in before["devices"] if d["device"] == "cuda:0"][0]
    cpu = [d for d in after["devices"] if d["device"] == "cpu"][0]
    cpu_before = [d for d in before["devices"] if d["device"] == "cpu"][0]
    # its routed experts on the host, as the last layer's: 256 x 3 x 7168 x 2048 bf16
    assert cpu["weight_bytes"] - cpu_before["weight_bytes"] == 256 * 3 * 7168 * 2048 * 2
    # on the GPU its attention, router and shared expert, 3 norms, eh_proj, embedding and head
    extra = gpu["weight_bytes"] - gpu_before["weight_bytes"]
    own = 2 * 129280 * 7168 * 2 + 2 * 7168 * 7168 * 2
    assert own < extra < own + 0.5 * GiB
    # one more layer's latent a token: 576 values at bf16
    assert gpu["kv_bytes_per_token"] - gpu_before["kv_bytes_per_token"] == 576 * 2
    assert "+ the MTP layer (speculative decoding's drafts) on cuda:0" in after["text"]
    assert after["mtp"] == {
        "device": "cuda:0",
        "weight_bytes": extra,
        "cpu_expert_bytes": 256 * 3 * 7168 * 2048 * 2,
    }
    assert before["mtp"] is None


def test_plan_refuses_mtp_for_a_model_without_the_layer(capsys, monkeypatch, cache_dir, tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({**DEEPSEEK_V3, "num_nextn_predict_layers": 0})
    )
    mtp = json.dumps({"method": "mtp", "num_speculative_tokens": 1})
    code, _, err = run_plan(
        capsys, monkeypatch, cache_dir, str(tmp_path), "--speculative-config", mtp
    )
    assert code == 2 and "num_nextn_predict_layers is 0" in err
