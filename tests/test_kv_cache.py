"""The host KV pool: one mapping, advised onto 2 MiB pages before its first touch, each layer's K and V a zeroed view
of their own (engine/kv_cache.py)."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import KVCache, KVCacheSpec, host_pools
from kernels.cpu.pages import HUGE_PAGE
from tests.test_pages import THP_OFF, smaps_field


def test_the_pools_are_zeroed_disjoint_views_of_one_mapping():
    mapping, pools = host_pools(5, (7, 4, 3, 8), torch.float32)
    assert len(pools) == 5 and all(p.shape == (7, 4, 3, 8) and p.is_contiguous() for p in pools)
    assert all(not p.any() for p in pools)
    assert pools[0].data_ptr() % HUGE_PAGE == 0
    for i, p in enumerate(pools):
        p.fill_(i + 1)
    assert [float(p.sum()) for p in pools] == [(i + 1) * 7 * 4 * 3 * 8 for i in range(5)]  # no two overlap
    spans = sorted((p.data_ptr(), p.data_ptr() + p.nbytes) for p in pools)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))


@pytest.mark.skipif(THP_OFF, reason="transparent huge pages are off on this machine")
def test_a_cpu_kv_cache_lies_on_huge_pages():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.bfloat16)
    cache = KVCache(spec, num_blocks=2048, device=torch.device("cpu"))  # 4 pools of 12 MiB
    k0 = cache.layers[0][0]
    assert sum(t.nbytes for pair in cache.layers for t in pair) == cache.num_bytes
    assert smaps_field(k0.data_ptr(), "AnonHugePages") >= 0.9 * cache.num_bytes
