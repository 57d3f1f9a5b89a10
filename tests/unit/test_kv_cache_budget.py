"""KV cache budgets of GPU and CPU workers under utilization and memory caps."""

from __future__ import annotations

import pytest

from hybridllm.worker.kv_cache_budget import GiB, cpu_kv_budget, gpu_kv_budget, profile_spans


def test_gpu_budget_from_utilization():
    # 80 GiB card, 10 GiB in use (this worker's 8 GiB of weights + 2 GiB context/others)
    budget = gpu_kv_budget(80 * GiB, 70 * GiB, 0.9, GiB, 8 * GiB, None)
    assert budget == int(80 * GiB * 0.9) - 10 * GiB - GiB


def test_gpu_budget_respects_max_gpu_memory():
    # the cap holds weights + activations + KV of this worker, whatever the card has free
    budget = gpu_kv_budget(80 * GiB, 70 * GiB, 0.9, GiB, 8 * GiB, 12 * GiB)
    assert budget == 12 * GiB - 8 * GiB - GiB
    assert 8 * GiB + GiB + budget <= 12 * GiB
    # a cap looser than the card's own budget changes nothing
    loose = gpu_kv_budget(80 * GiB, 70 * GiB, 0.9, GiB, 8 * GiB, 200 * GiB)
    assert loose == gpu_kv_budget(80 * GiB, 70 * GiB, 0.9, GiB, 8 * GiB, None)


def test_gpu_budget_can_be_negative_when_weights_exceed_the_cap():
    assert gpu_kv_budget(80 * GiB, 70 * GiB, 0.9, GiB, 8 * GiB, 8 * GiB) < 0


def test_cpu_default_budget_is_shared_between_workers():
    one = cpu_kv_budget(20 * GiB, 1, None, None, 0)
    assert one == min(4 * GiB, int(20 * GiB * 0.3))
    assert cpu_kv_budget(20 * GiB, 2, None, None, 0) == one // 2


def test_cpu_explicit_budget_and_its_error():
    assert cpu_kv_budget(20 * GiB, 2, 6 * GiB, None, 0) == 3 * GiB
    with pytest.raises(ValueError, match="kv_cache_memory .* exceeds available RAM"):
        cpu_kv_budget(2 * GiB, 1, 6 * GiB, None, 0)


def test_cpu_default_budget_fits_under_max_cpu_memory():
    # 10 GiB cap with 9 GiB of CPU-resident weights leaves 1 GiB of KV for two workers
    assert cpu_kv_budget(100 * GiB, 2, None, 10 * GiB, 9 * GiB) == GiB // 2


def test_profile_spans_cover_the_whole_step_budget():
    # chunked prefill off: the budget is >= max_model_len and may exceed 4096 (no cap)
    assert profile_spans(8192, 8192, 256) == [(0, 8192, 8192)]
    # several whole prompts when one cannot hold the budget, the last one shorter
    assert profile_spans(8192, 3000, 256) == [(0, 3000, 3000), (0, 3000, 3000), (0, 2192, 2192)]
    # never more sequences than max_num_seqs, so never more tokens than they hold
    assert profile_spans(8192, 1000, 2) == [(0, 1000, 1000), (0, 1000, 1000)]


def test_profile_spans_chunked_prefill_attends_to_a_whole_context():
    # a 2048-token chunk can be the last of a 32k prompt: it attends to all 32k positions
    assert profile_spans(2048, 32768, 256) == [(30720, 2048, 32768)]
    for budget, max_len, seqs in [(2048, 32768, 256), (8192, 3000, 256), (7, 5, 3)]:
        spans = profile_spans(budget, max_len, seqs)
        assert sum(q for _, q, _ in spans) == min(budget, seqs * max_len)
        assert all(start + q == ctx <= max_len for start, q, ctx in spans)
