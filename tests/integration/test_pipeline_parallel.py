"""Pipeline parallelism in one process (`uni`): stages in sequence give a single worker's tokens."""

from __future__ import annotations

import pytest
import torch

from hybridllm import LLM, SamplingParams
from hybridllm.engine_args import EngineArgs, parse_layer_split
from tests.model_helpers import make_tiny_model

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
ENGINE_KWARGS = dict(
    dtype="float32",
    max_model_len=128,
    block_size=4,
    max_num_batched_tokens=16,  # prompts of 20+ tokens are chunked over several steps
    kv_cache_memory="16MiB",
    use_tqdm=False,
    distributed_executor_backend="uni",
)


def make_prompts() -> list[dict]:
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 300, (18,), generator=g).tolist()
    # A shared prefix (prefix-cache hits) and lengths from 1 to 29 tokens.
    tails = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (11, 2, 7)]
    single = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (1, 9, 29)]
    return [{"prompt_token_ids": shared + t} for t in tails] + [
        {"prompt_token_ids": p} for p in single
    ]


def generate(llm: LLM, prompts: list[dict]) -> list[tuple[list[int], list]]:
    outs = llm.generate(prompts, PARAMS)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def assert_same_generation(got, want) -> None:
    """Identical greedy tokens, and logprobs equal up to float rounding."""
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    for (_, got_lps), (_, want_lps) in zip(got, want):
        for g, w in zip(got_lps, want_lps):
            assert g.keys() == w.keys()
            for tid in g:
                assert g[tid].logprob == pytest.approx(w[tid].logprob, abs=1e-4)


@pytest.fixture(scope="module", params=["llama", "opt"])
def model_path(request, tmp_path_factory):
    # Llama passes (hidden, residual) between stages; OPT folds the residual in.
    return str(make_tiny_model(request.param, tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope="module")
def reference(model_path):
    llm = LLM(model_path, **ENGINE_KWARGS)
    try:
        assert llm.llm_engine.config.plan.world_size == 1
        prompts = make_prompts()
        embeds = llm.llm_engine.embed([p["prompt_token_ids"] for p in prompts[:3]])
        return generate(llm, prompts), embeds
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "pp, layer_split", [(2, None), (2, "2,1"), (3, None)], ids=["pp2", "pp2-split-2-1", "pp3"]
)
def test_pipeline_matches_single_worker(model_path, reference, pp, layer_split):
    want_tokens, want_embeds = reference
    llm = LLM(model_path, pipeline_parallel_size=pp, layer_split=layer_split, **ENGINE_KWARGS)
    try:
        engine = llm.llm_engine
        assert engine.config.distributed_executor_backend == "uni"
        stages = engine.config.plan.stages
        want_split = parse_layer_split(layer_split) or {2: [2, 1], 3: [1, 1, 1]}[pp]
        assert [s.num_layers for s in stages] == want_split
        # Each stage builds only its own layers; only the last has the LM head.
        for stage, worker in zip(stages, engine.executor.workers):
            model = worker.model_runner.model
            assert (model.start_layer, model.end_layer) == (stage.layer_start, stage.layer_end)
            assert (model.lm_head is not None) == stage.has_lm_head
        assert_same_generation(generate(llm, make_prompts()), want_tokens)
        embeds = engine.embed([p["prompt_token_ids"] for p in make_prompts()[:3]])
        assert torch.allclose(torch.tensor(embeds), torch.tensor(want_embeds), atol=1e-5)
    finally:
        llm.shutdown()


def test_micro_batches_overlap_and_abort_in_flight(model_path, reference):
    """With P stages, P steps are in flight at once; aborting one mid-flight is safe."""
    want_tokens, _ = reference
    prompts = make_prompts()
    llm = LLM(model_path, pipeline_parallel_size=3, **ENGINE_KWARGS)
    try:
        engine = llm.llm_engine
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, PARAMS)
        extra = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, prompt_logprobs=1)
        engine.add_request("doomed", {"prompt_token_ids": list(range(5, 45))}, extra)
        finished, max_in_flight = {}, 0
        for step in range(500):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
            # steps still in flight after the oldest was collected
            max_in_flight = max(max_in_flight, len(engine._in_flight))
            if step == 3:
                engine.abort_request("doomed")  # its prefill chunks may be in flight
        assert max_in_flight == 2
        assert finished["doomed"].outputs[0].finish_reason == "abort"
        got = [
            (finished[f"r{i}"].outputs[0].token_ids, finished[f"r{i}"].outputs[0].logprobs)
            for i in range(len(prompts))
        ]
        assert_same_generation(got, want_tokens)
        assert engine.scheduler.block_manager.num_free_blocks == engine.num_blocks
    finally:
        llm.shutdown()


def test_profile_forward_runs_on_every_stage(model_path):
    """The forward a GPU worker profiles for its memory peak (the biggest step, then the
    sampler's costliest path on the last stage) runs on any stage and drops its KV cache."""
    llm = LLM(model_path, pipeline_parallel_size=2, **ENGINE_KWARGS)
    try:
        runners = [w.model_runner for w in llm.llm_engine.executor.workers]
        assert [r.profile_forward() for r in runners] == [16, 16]  # max_num_batched_tokens
        assert all(r.kv_caches == [] for r in runners)
    finally:
        llm.shutdown()


def test_parallel_flags_build_the_plan(model_path):
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["-pp", "3", "-tp", "1", "--layer-split", "1,1,1"])
    args = EngineArgs.from_cli_args(ns)
    args.model = model_path
    config = args.create_engine_config()
    assert config.plan.pipeline_parallel_size == 3
    assert config.distributed_executor_backend == "mp"  # default for more than one worker
    assert [(s.layer_start, s.layer_end) for s in config.plan.stages] == [(0, 1), (1, 2), (2, 3)]
    single = EngineArgs(model=model_path).create_engine_config()
    assert single.plan.world_size == 1 and single.distributed_executor_backend == "uni"
    with pytest.raises(ValueError, match="layer_split"):
        EngineArgs(
            model=model_path, pipeline_parallel_size=2, layer_split="1,1,1"
        ).create_engine_config()
    with pytest.raises(ValueError, match="tensor parallelism needs one process per rank"):
        EngineArgs(
            model=model_path, tensor_parallel_size=2, distributed_executor_backend="uni"
        ).create_engine_config()
    with pytest.raises(ValueError, match="3 layers"):
        EngineArgs(model=model_path, pipeline_parallel_size=4).create_engine_config()
