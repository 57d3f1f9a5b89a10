"""Speculative decoding with the checkpoint's own MTP layer (method "mtp"): greedy output equal
to plain decoding, and every draft the MTP layer made equal to transformers' computation of it."""

from __future__ import annotations

import json

import pytest

from hybridllm import LLM
from tests.deepseek_helpers import make_tiny_deepseek_model, make_tiny_mtp_model
from tests.integration.test_moe_models_vs_hf import ENGINE_KWARGS, PARAMS, make_prompts

pytestmark = pytest.mark.slow

MTP = {"method": "mtp", "num_speculative_tokens": 1}
# a draft is checked where the reference's best token leads by this much (no near-ties)
TIE_MARGIN = 1e-3


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe"])
def mtp_model(request, tmp_path_factory):
    """(saved folder, MTP reference) for one MLA and one GQA architecture."""
    return make_tiny_mtp_model(request.param, tmp_path_factory.mktemp(request.param))


def generate(path, record: list | None = None, **kwargs):
    """Greedy tokens of every prompt, and the engine's stats; `record` collects (request's
    tokens, draft) for every draft the MTP layer returned."""
    llm = LLM(str(path), **{**ENGINE_KWARGS, **kwargs})
    try:
        drafter = llm.llm_engine.drafter
        if record is not None:
            observe = drafter.observe

            def recording(output, requests):
                for req_id, drafts in (output.draft_token_ids if output else {}).items():
                    request = requests.get(req_id)
                    if request is not None:
                        record.append((list(request.all_token_ids), drafts))
                observe(output, requests)

            drafter.observe = recording
        prompts = [{"prompt_token_ids": p} for p in make_prompts()]
        outs = llm.generate(prompts, PARAMS)
        return [list(o.outputs[0].token_ids) for o in outs], llm.llm_engine.get_stats()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_drafts_are_the_mtp_layers_and_greedy_output_is_unchanged(mtp_model, k):
    path, reference = mtp_model
    plain, _ = generate(path)
    drafts: list = []
    got, stats = generate(path, drafts, speculative_config={**MTP, "num_speculative_tokens": k})
    assert got == plain
    assert stats.spec_num_draft_tokens > 0  # drafts were verified, not only made
    checked = chained = 0
    for tokens, made in drafts:
        for j, logits in enumerate(reference(tokens, made)):
            top2 = logits.topk(2).values
            if top2[0] - top2[1] < TIE_MARGIN:
                break  # the chain after a near-tie is not comparable
            assert made[j] == int(logits.argmax()), f"draft {j + 1} after {len(tokens)} tokens"
            checked += 1
            chained += j > 0
    assert checked >= len(drafts) * 0.9 and checked > 20, (checked, len(drafts))
    if k > 1:
        assert sum(len(made) == k for _, made in drafts) >= 0.5 * len(drafts)  # chains of k
        assert chained > 20


def test_mtp_with_the_target_split_into_two_stages(mtp_model):
    path, _ = mtp_model
    plain, _ = generate(path)
    got, stats = generate(
        path,
        speculative_config=MTP,
        pipeline_parallel_size=2,
        distributed_executor_backend="mp",
    )
    assert got == plain and stats.spec_num_draft_tokens > 0


def test_mtp_refusals_name_the_problem(tmp_path):
    plain = make_tiny_deepseek_model("deepseek_v3", tmp_path / "no_mtp")
    config = json.loads((plain / "config.json").read_text())

    def says_mtp_layers(n: int) -> None:
        (plain / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": n}))

    says_mtp_layers(0)
    with pytest.raises(ValueError, match="num_nextn_predict_layers is 0"):
        LLM(str(plain), **ENGINE_KWARGS, speculative_config=MTP)
    with pytest.raises(ValueError, match="num_speculative_tokens must be at most 8"):
        LLM(str(plain), **ENGINE_KWARGS, speculative_config={**MTP, "num_speculative_tokens": 9})
    says_mtp_layers(1)  # the config says there is an MTP layer; the weights do not hold it
    with pytest.raises(Exception, match="MTP layer is incomplete"):
        LLM(str(plain), **ENGINE_KWARGS, speculative_config=MTP)


def test_mtp_on_an_architecture_without_one_is_refused(tmp_path):
    from tests.model_helpers import make_tiny_model

    path = make_tiny_model("llama", tmp_path / "llama")
    with pytest.raises(ValueError, match="has no multi-token-prediction layer"):
        LLM(str(path), dtype="float32", speculative_config=MTP)


def test_mtp_from_a_gguf_file_drafts_as_from_its_folder():
    # llama.cpp's converter keeps GLM-4.5's MTP layer (blk.3.*, blk.3.nextn.*): the F32 file
    # drafts exactly what its folder does; its Q8_0 form computes the layer from its blocks
    from tests.gguf_deepseek_helpers import converter_paths, tiny_files

    if converter_paths() is None:
        pytest.skip("llama.cpp's convert_hf_to_gguf.py and llama-quantize are not built")
    files = tiny_files("glm4_moe", quant="Q8_0")
    spec = {**MTP, "num_speculative_tokens": 2}
    from_folder: list = []
    generate(files["hf"], from_folder, speculative_config=spec)
    for type_name in ("F32", "Q8_0"):
        plain, _ = generate(files[type_name])
        drafts: list = []
        got, stats = generate(files[type_name], drafts, speculative_config=spec)
        assert got == plain and stats.spec_num_draft_tokens > 0, type_name
        if type_name == "F32":
            assert drafts == from_folder


def test_an_mtp_layer_without_its_own_head_shares_the_models(tmp_path):
    # GLM-4.5's MTP layer carries no embedding or LM head: it uses the model's own modules
    # (held once), and drafts as transformers computes them with those
    path, reference = make_tiny_mtp_model("deepseek_v3", tmp_path, own_head=False)
    llm = LLM(str(path), **ENGINE_KWARGS, speculative_config={**MTP, "num_speculative_tokens": 2})
    try:
        runner = llm.llm_engine.executor.workers[0].model_runner
        assert runner.mtp.head is runner.model.lm_head
        assert runner.mtp.embed_tokens is runner.model.embed_tokens
    finally:
        llm.shutdown()
    drafts: list = []
    got, _ = generate(path, drafts, speculative_config={**MTP, "num_speculative_tokens": 2})
    assert got == generate(path)[0]
    for tokens, made in drafts[:20]:
        logits = reference(tokens, made)[0]
        if logits.topk(2).values.diff().abs() > TIE_MARGIN:
            assert made[0] == int(logits.argmax())
