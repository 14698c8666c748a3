"""Triton kernels against the float64 torch references (under TRITON_INTERPRET=1 on CPU, natively on a GPU).

Unused blocks and the unfilled tail of each request's last block hold NaN, so any read the block table or
sequence length does not allow turns the output into NaN."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import cdiv
from kernels.decode_attention import decode_attention
from kernels.prefill_attention import prefill_attention
from kernels.reference import ref_decode_attention, ref_prefill_attention, ref_store_kv
from kernels.store_kv import store_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def make_cache(seq_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
               seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pool with spare blocks, shuffled block tables, and NaN everywhere no request's tokens live."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [cdiv(n, block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + 7
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    width = max(blocks_needed)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    for r, n in enumerate(seq_lens):
        mine = [ids.pop() for _ in range(blocks_needed[r])]
        tables[r, : len(mine)] = torch.tensor(mine, dtype=torch.int32)
        tables[r, len(mine):] = ids[0]  # padding entries point at a NaN block: they must never be read
        for t in range(n):
            b, o = mine[t // block_size], t % block_size
            k_cache[b, o] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
            v_cache[b, o] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
    return k_cache.to(DEVICE), v_cache.to(DEVICE), tables.to(DEVICE)


# (batch contexts, group, head_dim, block_size, dtype): together they cover batch sizes 1..8, contexts 1,
# block_size - 1, block_size, block_size + 1 and a few hundred, GQA 1/3/4/8, head_dim 64/128, blocks 16/32.
DECODE_CASES = [
    ([1], 1, 64, 16, torch.float32),
    ([15, 16, 17], 3, 64, 16, torch.float32),
    ([300, 1, 31, 33], 4, 128, 32, torch.float32),
    ([32, 16, 17, 15, 1], 8, 64, 16, torch.float16),
    ([257, 5, 64, 100, 31, 32], 3, 128, 16, torch.float16),
    ([1, 2, 3, 4, 5, 6, 7], 1, 128, 32, torch.float16),
    ([33, 64, 65, 1, 300, 17, 15, 16], 4, 64, 32, torch.float32),
    ([129, 300], 8, 128, 16, torch.float16),
    ([16, 17, 70], 4, 64, 16, torch.bfloat16),  # loaded as bf16, computed in fp32
]


@pytest.mark.parametrize(("seq_lens", "group", "head_dim", "block_size", "dtype"), DECODE_CASES)
def test_decode_attention_matches_reference(seq_lens, group, head_dim, block_size, dtype):
    num_kv_heads = 2
    k_cache, v_cache, tables = make_cache(seq_lens, num_kv_heads, head_dim, block_size, dtype, seed=len(seq_lens))
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim).to(dtype).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    expected = ref_decode_attention(q.cpu(), k_cache.cpu(), v_cache.cpu(), tables.cpu(), lens.cpu(), scale)
    outs = [decode_attention(q, k_cache, v_cache, tables, lens, scale, num_splits=s) for s in (1, 3)]
    for out in outs:
        assert not out.isnan().any()
        torch.testing.assert_close(out.cpu().double(), expected, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=TOL[dtype], rtol=TOL[dtype])


PREFILL_CASES = [
    # (query lengths, cached prefix lengths, group, head_dim, block_size, dtype)
    ([5], [0], 1, 64, 16, torch.float32),
    ([17, 1, 16], [0, 40, 15], 3, 64, 16, torch.float32),
    ([33, 20], [31, 0], 4, 128, 32, torch.float16),
    ([1, 2, 40], [300, 17, 64], 8, 64, 16, torch.float16),
    ([9, 16], [16, 3], 3, 64, 32, torch.bfloat16),
]


@pytest.mark.parametrize(("query_lens", "cached", "group", "head_dim", "block_size", "dtype"), PREFILL_CASES)
def test_prefill_attention_matches_reference(query_lens, cached, group, head_dim, block_size, dtype):
    num_kv_heads = 2
    seq_lens = [c + n for c, n in zip(cached, query_lens, strict=True)]
    k_cache, v_cache, tables = make_cache(seq_lens, num_kv_heads, head_dim, block_size, dtype, seed=7)
    q = torch.randn(sum(query_lens), num_kv_heads * group, head_dim).to(dtype).to(DEVICE)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    expected = ref_prefill_attention(q.cpu(), k_cache.cpu(), v_cache.cpu(), tables.cpu(), qsl.cpu(), lens.cpu(),
                                     scale)
    out = prefill_attention(q, k_cache, v_cache, tables, qsl, lens, max(query_lens), scale)
    assert not out.isnan().any()
    torch.testing.assert_close(out.cpu().double(), expected, atol=TOL[dtype], rtol=TOL[dtype])


def test_prefill_with_one_token_chunks_equals_decode():
    seq_lens = [1, 16, 17, 90]
    k_cache, v_cache, tables = make_cache(seq_lens, 2, 64, 16, torch.float32, seed=3)
    q = torch.randn(len(seq_lens), 6, 64, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=DEVICE)
    decode = decode_attention(q, k_cache, v_cache, tables, lens, 0.125, num_splits=2)
    prefill = prefill_attention(q, k_cache, v_cache, tables, qsl, lens, 1, 0.125)
    torch.testing.assert_close(prefill, decode, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("dtype, cache_dtype", [  # the last: kv_cache_dtype="bfloat16" under an fp32 model
    (torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16),
])
def test_store_kv_writes_slots_and_skips_padding(dtype, cache_dtype):
    num_blocks, block_size, kv_heads, head_dim = 6, 16, 2, 64
    k = torch.randn(5, kv_heads, head_dim).to(dtype).to(DEVICE)
    v = torch.randn(5, kv_heads, head_dim).to(dtype).to(DEVICE)
    k[0, 0, :3] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)])  # ties, rounded to even by torch's cast
    slots = torch.tensor([3, 17, -1, 95, 40], dtype=torch.int64, device=DEVICE)
    caches = [torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=cache_dtype, device=DEVICE)
              for _ in range(4)]
    store_kv(k, v, caches[0], caches[1], slots)
    ref_store_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].view(-1, kv_heads, head_dim)[95].equal(k[3].to(cache_dtype))
    assert caches[0].abs().sum(dim=(2, 3)).count_nonzero() == 4  # the -1 lane wrote nothing


def test_pages_or_heads_under_16_are_refused_for_a_gpu():
    """tl.dot on a GPU needs dimensions >= 16 (the interpreter computes smaller ones; an H100 got them wrong)."""
    from kernels.online_softmax import check_dot_shapes

    cuda = torch.device("cuda")
    for block_size, head_dim in ((8, 64), (4, 128), (16, 8)):
        with pytest.raises(ValueError, match="block_size and head_dim >= 16"):
            check_dot_shapes(block_size, head_dim, cuda)
    check_dot_shapes(16, 64, cuda)
    check_dot_shapes(4, 8, torch.device("cpu"))
