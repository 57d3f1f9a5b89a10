"""Sampler: greedy, truncation filters, temperature statistics, seeds, penalties, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from hybridllm.sample import Sampler, SamplerOutput, SamplingMetadata, compute_prompt_logprobs
from hybridllm.sample.penalties import apply_penalties
from hybridllm.sample.truncation import logits_to_probs
from hybridllm.sampling_params import SamplingParams

EOS = 2
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
    ),
]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    device: str = "cpu",
):
    """Build metadata and sample on `device`; results come back on the CPU."""
    rows = len(params)
    metadata = SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[0]] * rows,
        outputs if outputs is not None else [[]] * rows,
        device,
        eos_token_ids={EOS},
    )
    out = Sampler()(logits.to(device), metadata)
    assert out.sampled_token_ids.device.type == torch.device(device).type
    return SamplerOutput(
        sampled_token_ids=out.sampled_token_ids.cpu(),
        logprobs=out.logprobs,
        num_logprobs=out.num_logprobs,
    )


def test_greedy_is_argmax_and_keeps_input(device: str) -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 100)
    before = logits.clone()
    out = sample(logits, [SamplingParams(temperature=0.0)] * 8, device=device)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None and out.logprobs_list() == [None] * 8
    assert torch.equal(logits, before)


def test_mixed_batch_greedy_rows_are_argmax(device: str) -> None:
    torch.manual_seed(1)
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0) for i in range(6)]
    out = sample(logits, params, device=device)
    argmax = logits.argmax(dim=-1)
    assert torch.equal(out.sampled_token_ids[1::2], argmax[1::2])


@pytest.mark.parametrize(
    "params",
    [SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(top_k=1, top_p=0.5)],
    ids=["top_k=1", "top_p_tiny", "top_k=1+top_p"],
)
def test_degenerate_truncation_is_greedy(params: SamplingParams, device: str) -> None:
    torch.manual_seed(2)
    logits = torch.randn(16, 200) * 3
    for _ in range(5):
        out = sample(logits, [params] * 16, device=device)
        assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


def probs_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()


@pytest.mark.parametrize(
    ("kwargs", "support"),
    [
        ({"top_k": 2}, {0, 1}),
        ({"top_p": 0.7}, {0, 1}),
        ({"top_p": 0.85}, {0, 1, 2}),
        ({"min_p": 0.5}, {0, 1}),  # threshold 0.25
        ({"min_p": 0.2}, {0, 1, 2}),  # threshold 0.1
        ({"top_k": 3, "min_p": 0.5}, {0, 1}),
    ],
)
def test_truncation_support(kwargs: dict, support: set[int], device: str) -> None:
    logits = probs_logits([0.5, 0.3, 0.15, 0.05])
    params = SamplingParams(**kwargs)
    metadata = SamplingMetadata.build([params], [[0]], [[]], "cpu")
    probs = logits_to_probs(logits, metadata)[0]
    assert {i for i in range(4) if probs[i] > 0} == support
    torch.manual_seed(3)
    out = sample(logits.expand(400, 4), [params] * 400, device=device)
    assert set(out.sampled_token_ids.tolist()) == support


def test_top_k_per_row_with_disabled_rows() -> None:
    logits = probs_logits([0.4, 0.3, 0.2, 0.1]).expand(3, 4)
    params = [SamplingParams(top_k=1), SamplingParams(), SamplingParams(top_k=3)]
    metadata = SamplingMetadata.build(params, [[0]] * 3, [[]] * 3, "cpu")
    support = (logits_to_probs(logits, metadata) > 0).tolist()
    assert support == [[True, False, False, False], [True] * 4, [True, True, True, False]]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_statistics(temperature: float, device: str) -> None:
    # p = [0.25, 0.75] at T=1; at T the odds become 3 ** (1 / T).
    logits = torch.tensor([[0.0, math.log(3.0)]]).expand(4000, 2)
    torch.manual_seed(4)
    out = sample(logits, [SamplingParams(temperature=temperature)] * 4000, device=device)
    odds = 3.0 ** (1.0 / temperature)
    expected = odds / (1.0 + odds)
    assert abs(out.sampled_token_ids.float().mean().item() - expected) < 0.03


def seeded_tokens(
    seed: int, row: int, batch: list[SamplingParams], steps: int, device: str
) -> list[int]:
    """Tokens drawn for `seed` at `row` of `batch` over steps 0..steps-1 (same logits)."""
    logits = torch.zeros(len(batch), 1000)
    tokens = []
    for step in range(steps):
        params = list(batch)
        params[row] = SamplingParams(seed=seed)
        outputs = [[7] * step] * len(batch)
        tokens.append(
            sample(logits, params, outputs=outputs, device=device).sampled_token_ids[row].item()
        )
    return tokens


def test_seed_reproducible_alone_and_in_any_batch(device: str) -> None:
    alone = seeded_tokens(42, 0, [SamplingParams()], steps=8, device=device)
    torch.manual_seed(123)  # the default generator must not matter
    batch = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(seed=7), None]
    in_batch = seeded_tokens(42, 3, batch, steps=8, device=device)
    all_seeded = seeded_tokens(42, 1, [SamplingParams(seed=1), None], steps=8, device=device)
    assert alone == in_batch == all_seeded
    assert len(set(alone)) > 1  # the draw depends on the step, not just the seed
    assert seeded_tokens(43, 0, [SamplingParams()], steps=8, device=device) != alone


def test_seed_is_stateless_across_recompute(device: str) -> None:
    # After preemption the request comes back with the same output length: same draw.
    logits = torch.zeros(1, 1000)
    params = [SamplingParams(seed=5, temperature=0.9, top_p=0.95)]
    first = sample(logits, params, outputs=[[1, 2, 3]], device=device).sampled_token_ids
    sample(logits, params, outputs=[[1, 2, 3, 4]], device=device)
    again = sample(logits, params, outputs=[[9, 9, 9]], device=device).sampled_token_ids
    assert torch.equal(first, again)


def reference_penalties(
    logits: list[float], prompt: list[int], output: list[int], rep: float, freq: float, pres: float
) -> list[float]:
    result = []
    for tok, logit in enumerate(logits):
        if tok in prompt or tok in output:
            logit = logit / rep if logit > 0 else logit * rep
        count = output.count(tok)
        result.append(logit - freq * count - pres * (count > 0))
    return result


def test_penalties_match_hand_computed_reference() -> None:
    torch.manual_seed(5)
    logits = torch.randn(3, 12) * 2
    prompts = [[1, 3, 3, 5], [0], [4, 11]]
    outputs = [[3, 7, 7, 7], [], [2, 2, 4]]
    penalties = [(1.5, 0.5, 0.3), (1.0, 0.0, 0.0), (0.8, -0.4, 1.2)]
    params = [
        SamplingParams(repetition_penalty=r, frequency_penalty=f, presence_penalty=p)
        for r, f, p in penalties
    ]
    metadata = SamplingMetadata.build(params, prompts, outputs, "cpu")
    penalized = logits.clone()
    apply_penalties(penalized, metadata)
    for row, (r, f, p) in enumerate(penalties):
        expected = reference_penalties(logits[row].tolist(), prompts[row], outputs[row], r, f, p)
        torch.testing.assert_close(penalized[row], torch.tensor(expected))
    assert torch.equal(penalized[1], logits[1])


def test_repetition_penalty_changes_greedy_choice(device: str) -> None:
    logits = torch.tensor([[0.0, 4.0, 3.0, -1.0]])
    prompt, output = [[1]], [[]]
    plain = sample(logits, [SamplingParams(temperature=0.0)], prompt, output, device=device)
    assert plain.sampled_token_ids.item() == 1
    penalized = sample(
        logits, [SamplingParams(temperature=0.0, repetition_penalty=2.0)], prompt, output, device
    )
    assert penalized.sampled_token_ids.item() == 2  # 4 / 2 < 3
    freq = sample(
        logits,
        [SamplingParams(temperature=0.0, frequency_penalty=0.6)],
        [[0]],
        [[1, 1]],
        device=device,
    )
    assert freq.sampled_token_ids.item() == 2  # 4 - 1.2 < 3


def test_logit_bias(device: str) -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0, 2.0]]).expand(2, 4)
    params = [
        SamplingParams(temperature=0.0, logit_bias={2: 10.0}),
        SamplingParams(temperature=0.0, logit_bias={0: -4.5, 1: 3.0}),
    ]
    assert sample(logits, params, device=device).sampled_token_ids.tolist() == [2, 1]  # 5-4.5 < 1+3


def test_min_tokens_masks_eos_and_stop_tokens(device: str) -> None:
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0, 7.0]])  # EOS=2 best, then 3, then 4
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[3])
    assert sample(logits, [params], outputs=[[1, 1]], device=device).sampled_token_ids.item() == 4
    assert (
        sample(logits, [params], outputs=[[1, 1, 1]], device=device).sampled_token_ids.item() == 2
    )
    ignore = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)
    assert sample(logits, [ignore], outputs=[[]], device=device).sampled_token_ids.item() == 2
    random = SamplingParams(min_tokens=1, stop_token_ids=[3])
    tokens = sample(logits.expand(200, 5), [random] * 200, device=device).sampled_token_ids
    assert not ({2, 3} & set(tokens.tolist()))


def test_logprobs_from_raw_logits(device: str) -> None:
    torch.manual_seed(6)
    logits = torch.randn(4, 30)
    params = [
        SamplingParams(temperature=0.7, logprobs=3, repetition_penalty=1.3),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=0, logit_bias={5: 100.0}),
        SamplingParams(top_k=4, logprobs=5),
    ]
    out = sample(logits, params, prompts=[[1, 2]] * 4, device=device)
    reference = torch.log_softmax(logits, dim=-1)
    entries = out.logprobs_list()
    assert entries[1] is None
    assert out.sampled_token_ids[2].item() == 5
    for row, k in [(0, 3), (2, 0), (3, 5)]:
        entry = entries[row]
        token = out.sampled_token_ids[row].item()
        top = reference[row].topk(k)
        assert entry.token_ids == [token, *top.indices.tolist()]
        torch.testing.assert_close(
            torch.tensor(entry.logprobs), torch.cat([reference[row, token : token + 1], top.values])
        )
        rank = int((reference[row] > reference[row, token]).sum()) + 1
        assert entry.ranks == [rank, *range(1, k + 1)]
    assert entries[2].ranks[0] > 1  # biased token: its raw rank, not 1


def test_prompt_logprobs_match_log_softmax() -> None:
    torch.manual_seed(7)
    logits = torch.randn(600, 40)  # > one chunk of positions
    next_ids = torch.randint(0, 40, (600,))
    result = compute_prompt_logprobs(logits, next_ids, k=2)
    reference = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(result.token_logprobs, reference.gather(1, next_ids[:, None])[:, 0])
    ranks = (reference > reference.gather(1, next_ids[:, None])).sum(-1) + 1
    assert torch.equal(result.token_ranks, ranks)
    torch.testing.assert_close(result.topk_logprobs, reference.topk(2).values)
    entries = result.to_list([2] * 600)
    assert entries[10].token_ids[0] == next_ids[10].item() and len(entries[10].token_ids) == 3


def test_empty_batch_and_bad_inputs(device: str) -> None:
    out = sample(torch.empty(0, 10), [], device=device)
    assert out.sampled_token_ids.shape == (0,)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingMetadata.build(
            [SamplingParams(logit_bias={50: 1.0})], [[0]], [[]], "cpu", vocab_size=10
        )
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingMetadata.build(
            [SamplingParams(stop_token_ids=[10])], [[0]], [[]], "cpu", vocab_size=10
        )
    with pytest.raises(ValueError, match="num_rows"):
        sample(torch.zeros(3, 10), [SamplingParams()] * 2, device=device)
