"""A server on the `mp` executor with two CPU pipeline stages answers like a single worker."""

from __future__ import annotations

from hybridllm import LLM, SamplingParams
from tests.integration.openai_server import RemoteServer

PROMPTS = ["The capital of France is", "List three colors:", "def add(a, b):"]
MAX_TOKENS = 12


def test_mp_pipeline_server_matches_single_worker():
    llm = LLM(dtype="float32", max_model_len=512, use_tqdm=False)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        expected = [o.outputs[0].text for o in llm.generate(PROMPTS, params)]
    finally:
        llm.shutdown()

    args = [
        "--pipeline-parallel-size", "2",
        "--distributed-executor-backend", "mp",
        "--max-model-len", "512",
    ]  # fmt: skip
    with RemoteServer(args) as server:
        client = server.client()
        model = client.models.list().data[0].id
        batch = client.completions.create(
            model=model, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        texts = [c.text for c in sorted(batch.choices, key=lambda c: c.index)]
        assert texts == expected
        stream = client.completions.create(
            model=model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected[0]
