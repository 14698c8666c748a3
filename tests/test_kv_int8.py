"""The int8 K/V pool (``kv_cache_dtype="int8"``): the rows' format (kernels/kv_int8.py), the C kernels against it,
the pool's size, and the engine against transformers with every K/V value rounded as the pool rounds it."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention import store_kv as torch_store_kv
from engine.config import EngineConfig
from engine.kv_cache import KVCacheSpec
from kernels import cpu, kv_int8
from kernels.reference import ref_decode_attention
from tests.conftest import hf_greedy
from tests.test_kernels import make_cache


def test_rows_round_to_half_a_step_of_their_largest():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=gen) * torch.tensor([1e-3, 1.0, 300.0]).view(1, 3, 1)
    x[0, 0] = 0.0  # an all-zero row: scale 0, values 0
    x[1, 1, 7] = -4 * x[1, 1].abs().max()  # the largest negative: -127 exactly
    rows = kv_int8.quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (5, 3, 64 + kv_int8.SCALE_BYTES)
    values, d = rows[..., :64], rows[..., 64:].contiguous().view(torch.float32)
    assert torch.equal(d, x.abs().amax(-1, keepdim=True) / 127)
    assert values.abs().max() == 127 and values[1, 1, 7] == -127 and not (values == -128).any()
    back = kv_int8.dequantize_rows(rows, torch.float32)
    assert torch.equal(back[0, 0], torch.zeros(64))
    assert ((back - x).abs() <= d * (0.5 + 1e-6)).all()
    assert torch.equal(kv_int8.read(rows, torch.float32), back)
    assert torch.equal(kv_int8.read(x, torch.bfloat16), x.to(torch.bfloat16))


@pytest.mark.parametrize("heads, head_dim", [(3, 64), (2, 128), (1, 32)])
def test_c_store_writes_the_torch_bytes(heads, head_dim):
    gen = torch.Generator().manual_seed(heads)
    qkv = torch.randn(7, 3 * heads * head_dim, generator=gen)  # K and V as rows of a fused projection (strided)
    k = qkv[:, heads * head_dim : 2 * heads * head_dim].view(7, heads, head_dim)
    v = qkv[:, 2 * heads * head_dim :].view(7, heads, head_dim)
    k[2, 0] = 0.0
    v[4] *= 1e4
    slots = torch.tensor([9, 0, 3, 4, 15, 1, 8])
    shape = (4, 4, heads, head_dim + kv_int8.SCALE_BYTES)
    pools = [torch.zeros(shape, dtype=torch.int8) for _ in range(4)]
    cpu.store_kv(k, v, pools[0], pools[1], slots)
    torch_store_kv(k, v, pools[2], pools[3], slots)
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])
    no_scales = torch.zeros(4, 4, heads, head_dim, dtype=torch.int8)
    with pytest.raises(ValueError, match=f"rows of {head_dim} elements do not hold a torch.int8 head of {head_dim}"):
        cpu.store_kv(k, v, no_scales, no_scales.clone(), slots)


@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [(9, 3, 64, 16), (8, 2, 128, 32), (4, 1, 32, 4)])
@pytest.mark.parametrize("seq_lens", [[1, 5, 16, 17, 100, 333], [1, 7, 64, 65, 255, 256, 257, 513, 9, 30]])
def test_decode_attention_reads_int8_rows_as_their_values(heads, kv_heads, head_dim, block_size, seq_lens):
    """The same answer as float64 attention over the rows' values (d q); NaN scales fill every slot no request
    owns, so a row read by mistake shows."""
    k_float, v_float, tables = make_cache(seq_lens, kv_heads, head_dim, block_size, torch.float32, seed=heads)
    k_cache, v_cache = kv_int8.quantize_rows(k_float), kv_int8.quantize_rows(v_float)
    q = torch.randn(len(seq_lens), heads, head_dim, generator=torch.Generator().manual_seed(3))
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    cpu.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim**-0.5, out)
    keys, values = (kv_int8.dequantize_rows(c, torch.float64) for c in (k_cache, v_cache))
    ref = ref_decode_attention(q.double(), keys, values, tables, lens, head_dim**-0.5)
    assert not out.isnan().any()
    assert torch.allclose(out.double(), ref, atol=2e-5)


def test_pool_size_and_where_int8_runs():
    spec = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.int8)
    assert spec.row_width == 68 and spec.bytes_per_token == 2 * 30 * 3 * 68
    assert KVCacheSpec(30, 3, 64, 16, torch.bfloat16).bytes_per_token == 2 * 30 * 3 * 64 * 2
    cpu_dev = torch.device("cpu")
    assert EngineConfig(kv_cache_dtype="int8").resolve_kv_cache_dtype(torch.bfloat16, cpu_dev) == torch.int8
    with pytest.raises(ValueError, match="runs on a CPU's cpu or torch attention only"):
        EngineConfig(kv_cache_dtype="int8").resolve_kv_cache_dtype(torch.float32, torch.device("cuda"))
    with pytest.raises(ValueError, match="runs on a CPU's cpu or torch attention only"):
        EngineConfig(kv_cache_dtype="int8", attention_backend="triton").resolve_kv_cache_dtype(torch.float32, cpu_dev)


@pytest.mark.parametrize("kind, backend", [("llama-gqa-tied", "cpu"), ("qwen3-qknorm", "cpu"), ("qwen2-bias", "torch")])
def test_int8_kv_cache_matches_transformers_with_rounded_kv(kind, backend, tiny_model):
    """Greedy tokens equal transformers' with each K/V row rounded to int8 as it enters the cache, with chunked
    prefill, multi-block tables and the C decoder's mixed steps; the pool holds ~3.8x fp32's tokens."""
    from transformers import AutoModelForCausalLM

    folder = tiny_model(kind)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 5, 17, 40)]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    def as_stored(x):
        return kv_int8.dequantize_rows(kv_int8.quantize_rows(x), x.dtype)

    expected = [hf_greedy(hf, p, 24, kv_round=as_stored) for p in prompts]
    engines = {dtype: LLM(str(folder), block_size=4, max_num_batched_tokens=16, kv_cache_memory=4 << 20,
                          attention_backend=backend, kv_cache_dtype=dtype) for dtype in ("auto", "int8")}
    llm = engines["int8"]
    assert llm.engine.kv_cache.layers[0][0].dtype == torch.int8
    assert llm.engine.kv_cache.num_blocks > 3 * engines["auto"].engine.kv_cache.num_blocks
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    assert [o.outputs[0].token_ids for o in outs] == expected
    bm = llm.engine.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks
