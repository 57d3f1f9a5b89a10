"""KV cache budgets of GPU and CPU workers under utilization and memory caps."""

from __future__ import annotations

import pytest

from hybridllm.worker.kv_cache_budget import GiB, cpu_kv_budget, gpu_kv_budget


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
