"""A CPU stage that streams its layers' weights computes the same tokens as one that does not.

Without a GPU the "accelerator" is the host itself (`stream_device="cpu"`): the staging
slots, the double-buffered copies, the compact KV cache and the write-back of the step's K/V
all run, so their logic is checked; on a GPU the same code runs with a copy stream and events.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from hybridllm import LLM, SamplingParams
from tests.gguf_helpers import tiny_hf_model, write_gguf
from tests.model_helpers import make_tiny_model

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
COMMON = dict(dtype="float32", use_tqdm=False, max_model_len=128, block_size=4)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 300, (13,), generator=g).tolist()
    tails = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (2, 9, 21)]
    # a shared prefix: later prompts hit the prefix cache, so streamed steps read cached blocks
    return [{"prompt_token_ids": shared + t} for t in tails] + [{"prompt_token_ids": [5, 7]}]


def _generate(path, prompts, **kwargs):
    llm = LLM(path, **COMMON, **kwargs)
    try:
        # a sliding-window group keeps a null block aside: compare with the count at the start
        free = llm.llm_engine.get_stats().num_free_blocks
        outs = llm.generate(prompts, PARAMS)
        first = (
            llm.llm_engine.executor.workers[0]
            if hasattr(llm.llm_engine.executor, "workers")
            else None
        )
        streamer = None if first is None else first.model_runner.model.execution.weight_streamer
        steps = None if streamer is None else streamer.num_streamed_steps
        assert llm.llm_engine.get_stats().num_free_blocks == free
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], steps


@pytest.fixture(scope="module")
def expected(model_path, prompts):
    return _generate(model_path, prompts)[0]


STREAMING = dict(pipeline_parallel_size=2, stream_device="cpu", distributed_executor_backend="uni")


@pytest.mark.parametrize(
    ("threshold", "extra"),
    [
        (0, {}),  # every step streams
        (8, {}),  # prefills stream, decode steps of 4 sequences compute on the CPU
        (8, {"max_num_batched_tokens": 16}),  # chunked prefills stream chunk by chunk
        (-1, {}),  # never
    ],
)
def test_streamed_steps_give_the_single_worker_tokens(
    model_path, prompts, expected, threshold, extra
):
    tokens, steps = _generate(model_path, prompts, stream_threshold=threshold, **STREAMING, **extra)
    assert tokens == expected
    if threshold < 0:
        assert steps is None  # no streamer at all
    elif threshold == 0:
        assert steps >= PARAMS.max_tokens  # every step of stage 0
    else:
        decode_steps = PARAMS.max_tokens - 1
        assert 1 <= steps < decode_steps  # the prefill steps only


def test_streaming_under_mp_workers(model_path, prompts, expected):
    kwargs = dict(STREAMING, distributed_executor_backend="mp")
    tokens, _ = _generate(model_path, prompts, stream_threshold=0, **kwargs)
    assert tokens == expected


def test_a_gguf_stage_streams_its_blocks(tmp_path):
    model = tiny_hf_model("llama")
    quantize = {
        f"model.layers.{i}.{name}.weight": kind
        for i in range(model.config.num_hidden_layers)
        for name, kind in (
            ("self_attn.q_proj", Q.Q4_0), ("self_attn.k_proj", Q.Q4_0),
            ("self_attn.v_proj", Q.Q8_0), ("self_attn.o_proj", Q.Q4_1),
            ("mlp.gate_proj", Q.Q4_1), ("mlp.up_proj", Q.Q4_1), ("mlp.down_proj", Q.Q8_0),
        )
    }  # fmt: skip
    path = str(write_gguf(tmp_path / "tiny.gguf", model, quantize=quantize))
    prompts = [{"prompt_token_ids": [5, 17, 42, 99, 7, 63]}, {"prompt_token_ids": [3, 8]}]
    want, _ = _generate(path, prompts)
    got, steps = _generate(path, prompts, stream_threshold=0, **STREAMING)
    assert got == want and steps >= PARAMS.max_tokens
    # the blocks cross as blocks (the accelerator decodes them), not as dense copies
    llm = LLM(path, **COMMON, stream_threshold=0, **STREAMING)
    try:
        streamer = llm.llm_engine.executor.workers[0].model_runner.model.execution.weight_streamer
        kinds = {p.ggml_type for p in streamer.pieces[0] if p.entry.name == "weight"}
        assert {int(Q.Q4_0), int(Q.Q8_0), int(Q.Q4_1)} <= kinds
        dense = sum(e.numel for e in streamer.entries) * 4  # fp32 values
        assert streamer.host_bytes_per_layer < dense / 3
    finally:
        llm.shutdown()


def test_a_step_whose_kv_does_not_fit_the_staging_buffers_computes_on_the_cpu(
    model_path, prompts, expected
):
    llm = LLM(model_path, **COMMON, stream_threshold=0, **STREAMING)
    try:
        streamer = llm.llm_engine.executor.workers[0].model_runner.model.execution.weight_streamer
        streamer.kv_tokens = 8  # two blocks: no step of these prompts fits
        outs = llm.generate(prompts, PARAMS)
        assert streamer.num_streamed_steps == 0
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_gemma3_streams_with_one_rotary_table_per_layer_kind(tmp_path, prompts):
    # Gemma 3's local and global layers rotate by different tables (PerKindRotary): the
    # streamer's copy of them must be recast like a single table (the first H200 run failed
    # to load this model under --device heterogeneous)
    path = str(make_tiny_model("gemma3", tmp_path))
    want, _ = _generate(path, prompts)
    got, steps = _generate(path, prompts, stream_threshold=0, **STREAMING)
    assert got == want and steps >= PARAMS.max_tokens
