"""Routed experts on the host beside their stage (--cpu-moe, --n-cpu-moe): tokens equal transformers'.

There is no GPU here, so the stage's device is the CPU too; the split path still runs: the
experts are built on their own `experts_device`, hidden states and router logits are moved to
it and the routed sum moved back.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from hybridllm import LLM
from hybridllm.loader.quantized_tensor import QuantizedTensor
from hybridllm.models.moe import SparseMoeBlock
from tests.integration.test_moe_models_vs_hf import ENGINE_KWARGS, PARAMS, make_prompts
from tests.kernel_helpers import require_cpu_kernels
from tests.model_helpers import StepSequence, allocate_kv_caches, load_our_model, make_step
from tests.moe_helpers import build_tiny_moe_model, hf_greedy, make_tiny_moe_model, write_moe_gguf

ARCHS = (
    "mixtral",
    "qwen2_moe",
)  # top-2 of 5 experts; top-3 of 7 with a shared expert, a dense layer


@pytest.fixture(scope="module", params=ARCHS)
def moe_model(request, tmp_path_factory):
    """(arch, saved HF folder, HF model, HF's greedy tokens for every prompt)."""
    arch = request.param
    hf = build_tiny_moe_model(arch)
    path = make_tiny_moe_model(arch, tmp_path_factory.mktemp(arch))
    return arch, path, hf, [hf_greedy(hf, p, PARAMS.max_tokens) for p in make_prompts()]


def generate(model: str, **kwargs) -> tuple[list[list[int]], tuple[int, ...]]:
    """Greedy tokens of every prompt, and each stage's `cpu_expert_layers` in the plan."""
    llm = LLM(model, **{**ENGINE_KWARGS, **kwargs})
    try:
        plan = llm.llm_engine.config.plan
        outs = llm.generate([{"prompt_token_ids": p} for p in make_prompts()], PARAMS)
        return [list(o.outputs[0].token_ids) for o in outs], tuple(
            s.cpu_expert_layers for s in plan.stages
        )
    finally:
        llm.shutdown()


def test_cpu_moe_single_worker_matches_hf(moe_model):
    _, path, _, want = moe_model
    got, cpu_experts = generate(str(path), cpu_moe=True)
    assert cpu_experts == (3,)
    assert got == want


def test_n_cpu_moe_pipeline_parallel_mp_matches_hf(moe_model):
    # stage 0 [0, 1) keeps its one layer's experts on the host, stage 1 [1, 3) only layer 1's
    _, path, _, want = moe_model
    got, cpu_experts = generate(
        str(path), n_cpu_moe=2, layer_split="1,2", distributed_executor_backend="mp"
    )
    assert cpu_experts == (1, 1)
    assert got == want


def test_host_experts_take_the_split_path_and_match_the_plain_model(monkeypatch):
    hf = build_tiny_moe_model("qwen2_moe")
    plain = load_our_model(hf)
    cls = type(plain)
    split = cls(hf.config, torch.float32, torch.device("cpu"), 0, None, cpu_expert_layers=2)
    split.load_weights((n, t) for n, t in hf.state_dict().items() if split.owns_weight(n))
    blocks = [layer.mlp for layer in split.layers]
    # layer 0 sparse with host experts, layer 1 dense (mlp_only_layers), layer 2 sparse, local
    assert blocks[0].experts_device == torch.device("cpu")
    assert not isinstance(blocks[1], SparseMoeBlock)
    assert blocks[2].experts_device is None
    moved = []
    to = torch.Tensor.to

    def spy(tensor, *args, **kwargs):
        moved.append(tuple(tensor.shape))
        return to(tensor, *args, **kwargs)

    tokens = make_prompts()[0]
    ids, positions, meta = make_step([StepSequence(tokens, 0, list(range(8)))], 4)
    with torch.inference_mode():
        want = plain.compute_logits(plain(ids, positions, allocate_kv_caches(plain, 16, 4), meta))
        monkeypatch.setattr(torch.Tensor, "to", spy)
        got = split.compute_logits(split(ids, positions, allocate_kv_caches(split, 16, 4), meta))
        monkeypatch.undo()
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    n, hidden = len(tokens), hf.config.hidden_size
    # hidden states and logits out, the routed sum back: for layer 0 only
    assert moved.count((n, hidden)) >= 2 and (n, hf.config.num_experts) in moved


def test_gguf_host_experts_keep_their_blocks_and_match(tmp_path):
    require_cpu_kernels()
    # Mixtral as a `llama` file: Q8_0 gate/up and Q4_0 down experts, Q8_0 attention
    Q = gguf.GGMLQuantizationType
    quantize = {"ffn_gate_exps": Q.Q8_0, "ffn_up_exps": Q.Q8_0, "ffn_down_exps": Q.Q4_0,
                "attn_q": Q.Q8_0}  # fmt: skip
    model = build_tiny_moe_model("mixtral", intermediate_size=64)  # whole 32-weight blocks
    path = str(write_moe_gguf(tmp_path / "mixtral.gguf", model, quantize))
    plain, _ = generate(path, enable_prefix_caching=False)
    llm = LLM(path, **{**ENGINE_KWARGS, "enable_prefix_caching": False, "n_cpu_moe": 2})
    try:
        layers = llm.llm_engine.executor.workers[0].model_runner.model.layers
        assert [layer.mlp.experts_device for layer in layers] == [torch.device("cpu")] * 2 + [None]
        assert layers[0].mlp.experts.w13.ggml_type == Q.Q8_0  # the native op reads the blocks
        outs = llm.generate([{"prompt_token_ids": p} for p in make_prompts()], PARAMS)
        assert [list(o.outputs[0].token_ids) for o in outs] == plain
    finally:
        llm.shutdown()


def test_a_gpu_stage_decodes_every_block_but_its_host_experts():
    # the model of a GPU stage with host experts is given the CPU's blocks: only the experts of
    # its host layers may keep them (checked here on the filter itself; no GPU on this machine)
    model = build_tiny_moe_model("mixtral")
    ours = type(load_our_model(model))(
        model.config, torch.float32, torch.device("cpu"), 1, 3, cpu_expert_layers=1
    )
    raw = np.zeros((4, 34), dtype=np.uint8)  # 4 rows of one Q8_0 block (32 weights)
    blocks = QuantizedTensor(raw, gguf.GGMLQuantizationType.Q8_0, (4, 32))
    names = [
        "model.layers.1.mlp.experts.gate_proj.weight",  # host experts: blocks stay
        "model.layers.2.mlp.experts.gate_proj.weight",  # experts on the stage's device
        "model.layers.1.self_attn.q_proj.weight",
    ]
    out = dict(ours._blocks_for_host_experts_only((n, blocks) for n in names))
    assert isinstance(out[names[0]], QuantizedTensor)
    assert all(isinstance(out[n], torch.Tensor) for n in names[1:])
