"""Rank memory measurement (novarl/distributed/memory.py) used by benchmarks/bench_memory.py."""

import pytest
import torch

from novarl.distributed.memory import current_rss_bytes, live_tensor_bytes, peak_rss_bytes, reset_peak


def test_live_tensor_bytes_counts_each_storage_once():
    before = live_tensor_bytes()
    big = torch.zeros(1_000_000)  # 4 MB
    views = [big[10:], big.view(1000, 1000), big]  # noqa: F841  (alive while measuring)
    after = live_tensor_bytes()
    assert 4_000_000 <= after - before < 4_100_000


def test_peak_is_reset_then_follows_a_transient_allocation():
    if not reset_peak():
        pytest.skip("no /proc/self/clear_refs here")
    start = current_rss_bytes()
    assert peak_rss_bytes() - start < 50e6
    transient = torch.ones(50_000_000)  # 200 MB, touched
    del transient
    assert peak_rss_bytes() - start > 150e6
