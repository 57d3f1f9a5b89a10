"""The OpenAI-compatible server as a real subprocess, driven with the official `openai` client."""

from __future__ import annotations

import asyncio
import base64
import json
import math
import os
import struct
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.openai_server import REPO_ROOT, RemoteServer, parse_metrics

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 1024
MAX_REQUEST_BYTES = 65536
MAX_NUM_SEQS = 4  # few slots: the concurrency test queues most of its streams
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server():
    args = [
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-request-bytes",
        str(MAX_REQUEST_BYTES),
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
    ]
    with RemoteServer(args) as srv:
        yield srv


@pytest.fixture(scope="module")
def tokenizer():
    from hybridllm.loader import default_model_path, open_model_source

    return open_model_source(default_model_path()).load_tokenizer()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def greedy(client, model, prompt=PROMPT, max_tokens=8, **kwargs):
    return client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, **kwargs
    )


def test_models_health_version(server, client, model):
    assert model == "SmolLM2-135M-Instruct"  # the embedded model by its short name
    card = client.models.list().data[0]
    assert card.max_model_len == MAX_MODEL_LEN
    assert httpx.get(f"{server.root}/health").status_code == 200
    assert httpx.get(f"{server.root}/version").json()["version"]


def test_completion_usage_matches_tokenizer(client, model, tokenizer):
    result = greedy(client, model, max_tokens=8, logprobs=0)
    choice = result.choices[0]
    assert choice.finish_reason == "length"
    assert result.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert result.usage.completion_tokens == 8 == len(choice.logprobs.tokens)
    assert result.usage.total_tokens == result.usage.prompt_tokens + 8
    assert "Paris" in choice.text


def test_completion_streaming_matches_non_streaming(client, model):
    whole = greedy(client, model, max_tokens=10)
    chunks = list(
        greedy(client, model, max_tokens=10, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    # Without include_usage no chunk carries usage.
    plain = list(greedy(client, model, max_tokens=4, stream=True))
    assert all(c.usage is None for c in plain)


def test_chat_streaming_and_not(client, model, tokenizer):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a color."},
    ]
    whole = client.chat.completions.create(
        model=model, messages=messages, max_tokens=12, temperature=0
    )
    expected_ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    if not isinstance(expected_ids, list):  # BatchEncoding in newer transformers
        expected_ids = expected_ids["input_ids"]
    assert whole.usage.prompt_tokens == len(expected_ids)
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # max_completion_tokens is the newer name of max_tokens.
    short = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_completion_tokens=3
    )
    assert short.usage.completion_tokens <= 3


def test_several_prompts_and_echo(client, model):
    result = client.completions.create(
        model=model, prompt=["One", "Two", "Three"], max_tokens=3, temperature=0, echo=True
    )
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert [c.text[:3] for c in result.choices] == ["One", "Two", "Thr"]
    assert result.usage.completion_tokens == 9
    chunks = list(
        client.completions.create(
            model=model, prompt=["One", "Two"], max_tokens=3, temperature=0, stream=True
        )
    )
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert "One" + texts[0] == result.choices[0].text
    assert "Two" + texts[1] == result.choices[1].text


def test_n2_returns_two_choices(client, model):
    result = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, n=2, temperature=1.0, seed=7
    )
    assert sorted(c.index for c in result.choices) == [0, 1]
    assert result.usage.completion_tokens == 12  # ignore EOS not needed: 6 tokens rarely end
    chat = client.chat.completions.create(
        model=model,
        n=2,
        max_tokens=4,
        temperature=1.0,
        messages=[{"role": "user", "content": "Hi"}],
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]
    stream = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, n=2, seed=7, temperature=1.0, stream=True
    )
    finished = [choice.index for c in stream for choice in c.choices if choice.finish_reason]
    assert sorted(finished) == [0, 1]


def test_stop_string_ends_the_text(client, model):
    text = greedy(client, model, max_tokens=12).choices[0].text
    words = text.split()
    assert len(words) >= 2, text
    stop = words[1]
    stopped = greedy(client, model, max_tokens=12, stop=[stop]).choices[0]
    assert stopped.finish_reason == "stop"
    assert stop not in stopped.text and text.startswith(stopped.text)


def test_seed_makes_sampling_reproducible(client, model):
    def sample(seed):
        return (
            client.completions.create(
                model=model, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=seed
            )
            .choices[0]
            .text
        )

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(s) != first for s in (1, 2, 3))


def test_logprobs(client, model):
    result = greedy(client, model, max_tokens=6, logprobs=3)
    lp = result.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == result.choices[0].text
    for chosen, tops in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and len(tops) >= 3
        assert chosen == pytest.approx(max(tops.values()), abs=1e-4)  # greedy takes the top
    chat = client.chat.completions.create(
        model=model,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        messages=[{"role": "user", "content": "Hello"}],
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)


def test_extension_sampling_fields_are_accepted_together(client, model):
    result = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=5,
        temperature=0.8,
        top_p=0.9,
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"13": -100},
        extra_body={
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "min_tokens": 5,
            "ignore_eos": True,
        },
    )
    assert result.usage.completion_tokens == 5


def _single_token_id(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def test_logit_bias_forces_and_bans_tokens(client, model, tokenizer):
    # +100 on one token: every sampled token (temperature 1, three samples) is that token.
    cat = _single_token_id(tokenizer, " cat")
    forced = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=6,
        temperature=1.0,
        seed=5,
        n=3,
        logit_bias={str(cat): 100},
    )
    assert [c.text for c in forced.choices] == [tokenizer.decode([cat] * 6)] * 3
    # -100 on the greedy first token: greedy takes the runner-up instead. The reported
    # logprobs are the model's own, before the bias.
    plain = greedy(client, model, max_tokens=3, logprobs=2).choices[0].logprobs
    best, runner_up = sorted(plain.top_logprobs[0], key=plain.top_logprobs[0].get, reverse=True)
    assert plain.tokens[0] == best == " Paris"
    banned = greedy(
        client,
        model,
        max_tokens=3,
        logprobs=2,
        logit_bias={str(_single_token_id(tokenizer, best)): -100},
    ).choices[0]
    assert banned.logprobs.tokens[0] == runner_up and "Paris" not in banned.text


def test_top_k_1_and_min_p_1_sample_the_greedy_text(client, model):
    prompt = "Once upon a time"
    reference = greedy(client, model, prompt=prompt, max_tokens=12).choices[0].text

    def samples(seed, **extra):
        result = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=12,
            temperature=1.0,
            seed=seed,
            n=3,
            extra_body=extra,
        )
        return [c.text for c in result.choices]

    for seed in (11, 12):
        # Control: plain temperature-1 sampling with these seeds leaves the greedy path.
        assert any(text != reference for text in samples(seed)), seed
        assert samples(seed, top_k=1) == [reference] * 3, seed
        assert samples(seed, min_p=1.0) == [reference] * 3, seed


def test_repetition_penalty_breaks_a_repeating_pattern(client, model, tokenizer):
    prompt = "1, 2, 3, 1, 2, 3, 1, 2, 3,"
    prompt_tokens = [tokenizer.decode([t]) for t in tokenizer.encode(prompt)]

    def repeats(penalty):
        choice = greedy(
            client,
            model,
            prompt=prompt,
            max_tokens=12,
            logprobs=0,
            extra_body={"repetition_penalty": penalty, "ignore_eos": True},
        ).choices[0]
        tokens = choice.logprobs.tokens
        assert len(tokens) == 12
        seen = set(prompt_tokens)
        count = 0
        for token in tokens:
            count += token in seen
            seen.add(token)
        return choice.text, count

    plain_text, plain_repeats = repeats(1.0)
    penalized_text, penalized_repeats = repeats(1.5)
    assert plain_text.startswith(" 1, 2, 3"), plain_text  # greedy continues the pattern
    assert penalized_text != plain_text
    assert plain_repeats >= 10 and penalized_repeats <= 3, (plain_text, penalized_text)


def test_more_concurrent_streams_than_slots_complete_and_free_the_kv_cache(server, client, model):
    num_streams = 8 * MAX_NUM_SEQS
    prompts = [f"Count from {i}:" for i in (1, 5, 9, 20)]
    expected = {p: greedy(client, model, prompt=p, max_tokens=8).choices[0].text for p in prompts}
    finished_before = server.metrics()['hybridllm:request_success_total{finished_reason="length"}']

    async def one(aclient, prompt):
        stream = await aclient.completions.create(
            model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True
        )
        return prompt, "".join([c.choices[0].text async for c in stream if c.choices])

    async def watch(done: asyncio.Event, samples: list):
        async with httpx.AsyncClient(timeout=30) as http:
            while not done.is_set():
                response = await http.get(f"{server.root}/metrics")
                m = parse_metrics(response.text)
                samples.append(
                    (m["hybridllm:num_requests_running"], m["hybridllm:num_requests_waiting"])
                )
                await asyncio.sleep(0.01)

    async def main():
        done, samples = asyncio.Event(), []
        watcher = asyncio.create_task(watch(done, samples))
        aclient = server.async_client()
        async with aclient:
            results = await asyncio.gather(
                *(one(aclient, prompts[i % 4]) for i in range(num_streams))
            )
        done.set()
        await watcher
        return results, samples

    results, samples = asyncio.run(main())
    assert len(results) == num_streams
    for prompt, text in results:
        assert text == expected[prompt], prompt
    # The slots were full and requests queued behind them, never more running than slots.
    assert max(running for running, _ in samples) == MAX_NUM_SEQS, samples
    assert max(waiting for _, waiting in samples) > 0, samples
    metrics = server.metrics()
    assert (
        metrics['hybridllm:request_success_total{finished_reason="length"}']
        == finished_before + num_streams
    )
    assert metrics["hybridllm:num_requests_running"] == 0
    assert metrics["hybridllm:num_requests_waiting"] == 0
    assert metrics["hybridllm:kv_cache_free_blocks"] == metrics["hybridllm:kv_cache_total_blocks"]


def test_client_disconnect_aborts_the_request(server, client, model):
    aborted_before = server.metrics()['hybridllm:request_success_total{finished_reason="abort"}']
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 500,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        received = 0
        for line in resp.iter_lines():
            received += line.startswith("data:")
            if received == 2:
                break  # leaving the block closes the connection mid-stream
    assert received == 2
    # A non-streaming client that gives up (timeout) aborts its request too.
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.base_url}/completions", json={**body, "stream": False}, timeout=1.0)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = server.metrics()
        if (
            m['hybridllm:request_success_total{finished_reason="abort"}'] == aborted_before + 2
            and m["hybridllm:num_requests_running"] == 0
            and m["hybridllm:kv_cache_free_blocks"] == m["hybridllm:kv_cache_total_blocks"]
        ):
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"request not aborted: before={aborted_before} {m}")
    assert httpx.get(f"{server.root}/health").status_code == 200
    assert greedy(client, model, max_tokens=2).usage.completion_tokens == 2


COMPLETIONS, CHAT, EMBEDDINGS = "/v1/completions", "/v1/chat/completions", "/v1/embeddings"


def completion(**fields):
    return {"prompt": PROMPT, "max_tokens": 2, **fields}


def chat(**fields):
    return {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}


# fmt: off
BAD_REQUESTS = [
    # (name, method, path, body: dict or raw JSON text, status, expected error param)
    ("malformed json", "POST", COMPLETIONS, '{"prompt": "x",', 400, None),
    ("body not an object", "POST", COMPLETIONS, "[1, 2]", 400, None),
    ("missing prompt", "POST", COMPLETIONS, {"max_tokens": 2}, 400, "prompt"),
    ("prompt wrong type", "POST", COMPLETIONS, completion(prompt=123), 400, "prompt"),
    ("max_tokens a string", "POST", COMPLETIONS, completion(max_tokens="ten"), 400, "max_tokens"),
    ("max_tokens zero", "POST", COMPLETIONS, completion(max_tokens=0), 400, "max_tokens"),
    ("negative temperature", "POST", COMPLETIONS, completion(temperature=-1), 400, "temperature"),
    ("top_p above 1", "POST", COMPLETIONS, completion(top_p=1.5), 400, "top_p"),
    ("n zero", "POST", COMPLETIONS, completion(n=0), 400, "n"),
    ("presence_penalty 3", "POST", COMPLETIONS, completion(presence_penalty=3), 400,
     "presence_penalty"),
    ("logprobs 50", "POST", COMPLETIONS, completion(logprobs=50), 400, "logprobs"),
    ("top_k negative", "POST", COMPLETIONS, completion(top_k=-5), 400, "top_k"),
    ("min_tokens > max_tokens", "POST", COMPLETIONS, completion(min_tokens=5), 400, "min_tokens"),
    ("empty prompt", "POST", COMPLETIONS, completion(prompt=""), 400, "prompt"),
    ("empty token list", "POST", COMPLETIONS, completion(prompt=[]), 400, "prompt"),
    ("token id outside vocab", "POST", COMPLETIONS, completion(prompt=[10**7]), 400, "prompt"),
    ("prompt longer than context", "POST", COMPLETIONS, completion(prompt="hello " * 1100), 400,
     "prompt"),
    ("prompt + max_tokens over context", "POST", COMPLETIONS, completion(max_tokens=5000), 400,
     "max_tokens"),
    ("logit_bias key not a token", "POST", COMPLETIONS, completion(logit_bias={"abc": 1}), 400,
     "logit_bias"),
    ("logit_bias token outside vocab", "POST", COMPLETIONS,
     completion(logit_bias={"99999999": 1}), 400, "logit_bias"),
    ("stream_options without stream", "POST", COMPLETIONS,
     completion(stream_options={"include_usage": True}), 400, "stream_options"),
    ("unknown model", "POST", COMPLETIONS, completion(model="gpt-17"), 404, "model"),
    ("chat without messages", "POST", CHAT, {"max_tokens": 2}, 400, "messages"),
    ("chat empty messages", "POST", CHAT, chat(messages=[]), 400, "messages"),
    ("chat unknown role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400,
     "messages.0.role"),
    ("chat top_logprobs without logprobs", "POST", CHAT, chat(top_logprobs=2), 400,
     "top_logprobs"),
    ("embedding empty input", "POST", EMBEDDINGS, {"input": ""}, 400, "input"),
    ("embedding bad format", "POST", EMBEDDINGS, {"input": "x", "encoding_format": "hex"}, 400,
     "encoding_format"),
    ("body over the size limit", "POST", COMPLETIONS,
     json.dumps({"prompt": "x" * MAX_REQUEST_BYTES}), 413, None),
    ("unknown route", "GET", "/v1/nothing", None, 404, None),
    ("wrong method", "GET", COMPLETIONS, None, 405, None),
]
# fmt: on


def test_bad_requests_get_openai_errors_and_the_server_lives_on(server, client, model):
    assert len(BAD_REQUESTS) >= 20
    with httpx.Client(base_url=server.root, timeout=30) as http:
        for name, method, path, body, status, param in BAD_REQUESTS:
            if isinstance(body, dict):
                response = http.request(method, path, json=body)
            else:
                response = http.request(
                    method, path, content=body, headers={"content-type": "application/json"}
                )
            assert response.status_code == status, (name, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, name
            assert error["message"] and error["type"], name
            assert error["param"] == param, (name, error)
            if name.startswith(("prompt longer", "prompt + max_tokens")):
                assert str(MAX_MODEL_LEN) in error["message"], error
    with pytest.raises(openai.NotFoundError):
        greedy(client, "no-such-model")
    with pytest.raises(openai.BadRequestError):
        greedy(client, model, max_tokens=-1)
    assert httpx.get(f"{server.root}/health").status_code == 200
    assert greedy(client, model, max_tokens=3).usage.completion_tokens == 3


def test_embeddings(server, client, model, tokenizer):
    texts = ["hello world", "a completely different sentence about cats"]
    result = client.embeddings.create(model=model, input=texts, encoding_format="float")
    vectors = [d.embedding for d in result.data]
    assert [d.index for d in result.data] == [0, 1]
    for v in vectors:
        assert math.sqrt(sum(x * x for x in v)) == pytest.approx(1.0, abs=1e-4)
    assert vectors[0] != vectors[1]
    assert result.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in texts)
    raw = httpx.post(
        f"{server.base_url}/embeddings", json={"input": texts[0], "encoding_format": "base64"}
    ).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    decoded = struct.unpack(f"<{len(packed) // 4}f", packed)
    assert decoded == pytest.approx(vectors[0], abs=1e-6)
    ids = client.embeddings.create(
        model=model, input=[tokenizer.encode(texts[0])], encoding_format="float"
    )
    assert ids.data[0].embedding == pytest.approx(vectors[0], abs=1e-5)


def test_metrics_exposition(server):
    text = httpx.get(f"{server.root}/metrics").text
    # prometheus_client's own parser reads it; every latency and length metric is a histogram
    # whose +Inf bucket equals its count, and which has counted the requests served so far.
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        family = families[f"hybridllm:{name}"]
        assert family.type == "histogram", name
        values = {(s.name, s.labels.get("le")): s.value for s in family.samples}
        count = values[(f"hybridllm:{name}_count", None)]
        assert count > 0 and values[(f"hybridllm:{name}_bucket", "+Inf")] == count, name
    m = server.metrics()
    assert m["hybridllm:time_to_first_token_seconds_count"] > 0
    assert m["hybridllm:request_time_per_output_token_seconds_count"] > 0
    assert m['hybridllm:request_success_total{finished_reason="length"}'] > 0
    assert m['hybridllm:http_responses_total{status="200"}'] > 0
    assert m['hybridllm:worker_busy_seconds_total{worker="worker0"}'] > 0
    assert 0 <= m["hybridllm:kv_cache_usage_perc"] <= 1
    assert m["hybridllm:engine_healthy"] == 1


def test_bench_serve_against_the_server(server, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "hybridllm",
        "bench",
        "serve",
        "--base-url",
        server.root,
        "--num-prompts",
        "6",
        "--random-input-len",
        "16",
        "--random-output-len",
        "6",
        "--max-concurrency",
        "3",
        "--request-rate",
        "50",
        "--ignore-eos",
        "--save-result",
        "--result-dir",
        str(tmp_path),
        "--result-filename",
        "out.json",
        "--disable-tqdm",
    ]
    proc = subprocess.run(
        cmd,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Output token throughput (tok/s):" in proc.stdout and "P99 ITL (ms):" in proc.stdout
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["output_lens"] == [6] * 6
    assert all(abs(n - 16) <= 2 for n in result["input_lens"])
    assert result["ttft"]["mean_ms"] > 0 and result["itl"]["percentiles_ms"]["p99"] > 0
