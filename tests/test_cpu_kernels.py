"""The C kernels of kernels/cpu against float64 torch references, and the engine's choice of backend.

Built from source on first use; every machine this project tests on has a C compiler, so a failed build fails here
instead of silently falling back to the torch path."""

from __future__ import annotations

import pytest
import torch

from engine.models.llama import RMSNorm
from engine.models.rotary import _rotate_half
from kernels import cpu, kv_int8
from kernels.reference import ref_decode_attention
from tests.test_kernels import make_cache


def test_kernels_build():
    assert cpu.available()


@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 16, 65, 300])
@pytest.mark.parametrize("k,n", [(576, 960), (64, 20), (1536, 576), (8, 49), (300, 33)])
def test_linear_matches_float64(m, k, n):
    gen = torch.Generator().manual_seed(m * 1000 + n)
    x, w, b = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    packed = cpu.pack_weight(w)
    ref = x.double() @ w.double().T
    assert torch.allclose(cpu.linear(x, packed, n).double(), ref, atol=1e-3, rtol=1e-4)
    assert torch.allclose(cpu.linear(x, packed, n, b).double(), ref + b.double(), atol=1e-3, rtol=1e-4)
    wide = torch.randn(m, k + 9, generator=gen)
    strided = wide[:, 5 : 5 + k]  # rows of a fused projection's output: row stride != k
    assert torch.allclose(cpu.linear(strided, packed, n).double(), strided.double() @ w.double().T, atol=1e-3)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (8, 8, 128, 32), (8, 2, 64, 4), (4, 1, 32, 16)]
)
@pytest.mark.parametrize(  # fewer than 8 sequences split their contexts in 64-position chunks, 8 or more in 256
    "seq_lens", [[1, 5, 16, 17, 100, 333, 1000], [1, 5, 16, 17, 64, 65, 255, 256, 257, 513, 1000]]
)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_attention(heads, kv_heads, head_dim, block_size, seq_lens, kv_dtype):
    """A bfloat16 pool is read as the same values widened to fp32, so the reference is exact for either pool."""
    k_cache, v_cache, tables = make_cache(seq_lens, kv_heads, head_dim, block_size, kv_dtype, seed=heads)
    q = torch.randn(len(seq_lens), heads, head_dim, generator=torch.Generator().manual_seed(3))
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    cpu.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim**-0.5, out)
    ref = ref_decode_attention(q.double(), k_cache.double(), v_cache.double(), tables, lens, head_dim**-0.5)
    assert not out.isnan().any()  # NaN sits in every slot the kernel must not read
    assert torch.allclose(out.double(), ref, atol=2e-5)


def test_decode_attention_reads_strided_queries():
    k_cache, v_cache, tables = make_cache([7, 40], 2, 64, 16, torch.float32, seed=5)
    qkv = torch.randn(2, (4 + 2 * 2) * 64)
    q = qkv[:, : 4 * 64].view(2, 4, 64)  # as the attention layer slices it out of the fused projection
    lens = torch.tensor([7, 40], dtype=torch.int32)
    out = torch.empty(2, 4, 64)
    cpu.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, out)
    ref = ref_decode_attention(q.double(), k_cache.double(), v_cache.double(), tables, lens, 0.125)
    assert torch.allclose(out.double(), ref, atol=2e-5)


def test_decode_attention_with_peaked_scores():
    """Scores hundreds apart: most exponentials underflow to zero, the top few decide (the vector exp's range)."""
    k_cache, v_cache, tables = make_cache([300, 9], 2, 64, 16, torch.float32, seed=7)
    q = 40 * torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(8))
    lens = torch.tensor([300, 9], dtype=torch.int32)
    out = torch.empty_like(q)
    cpu.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, out)
    ref = ref_decode_attention(q.double(), k_cache.double(), v_cache.double(), tables, lens, 0.125)
    assert torch.allclose(out.double(), ref, atol=2e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("chunk,start", [(1, 0), (7, 0), (9, 15), (20, 250), (40, 3)])
def test_prompt_chunk_queries_give_the_bits_they_give_alone(kv_dtype, block_size, chunk, start):
    """A prompt chunk's tokens ride along as decode queries (the one-call decoder), each with its request's block
    table: the kernel takes consecutive ones together, each cache block loaded once for all of them. Each query must
    come out with the bits it has when no neighbour shares its loads (the same batch reversed: no token then
    continues the one before it). A second request's chunk follows the first's with contexts that keep counting up
    (its block table differs), and from position 250 the chunk crosses a 256-position split: queries of one run
    reach different numbers of chunks."""
    prompt_a, prompt_b = list(range(start + 1, start + chunk + 1)), list(range(start + chunk + 1, start + chunk + 6))
    seq_lens = [5, 300, 17, *prompt_a, *prompt_b]  # 3 decodes, then the two chunks
    k_cache, v_cache, tables = make_cache([5, 300, 17, start + chunk, start + chunk + 5], 2, 64, block_size,
                                          torch.float32, seed=chunk + start)
    if kv_dtype == torch.int8:  # a pool of int8 rows and their scales, of the same values (no NaN filler)
        k_cache, v_cache = (kv_int8.to_pool(c.nan_to_num(), torch.int8) for c in (k_cache, v_cache))
    else:
        k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    tables = torch.cat([tables[:3], tables[3:4].expand(chunk, -1), tables[4:5].expand(5, -1)]).contiguous()
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(len(seq_lens), 6, 64, generator=torch.Generator().manual_seed(4))
    out = torch.full_like(q, float("nan"))
    cpu.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, out)
    back = torch.arange(len(seq_lens) - 1, -1, -1)
    alone = torch.full_like(q, float("nan"))
    cpu.paged_decode_attention(q[back].contiguous(), k_cache, v_cache, tables[back].contiguous(),
                               lens[back].contiguous(), 0.125, alone)
    assert torch.equal(out.view(torch.int32), alone[back].view(torch.int32))
    keys, values = (kv_int8.read(c, torch.float64) for c in (k_cache, v_cache))
    ref = ref_decode_attention(q.double(), keys, values, tables, lens, 0.125)
    assert torch.allclose(out.double(), ref, atol=2e-5)


@pytest.mark.parametrize("width", [1536, 100])  # a multiple of the vector width, and one with a tail
def test_silu_mul_is_accurate_over_the_whole_range(width):
    g = torch.linspace(-120, 120, 64 * width).view(64, width)  # past exp's overflow on both sides
    u = torch.randn(64, width, generator=torch.Generator().manual_seed(9))
    out = cpu.silu_mul(torch.cat([g, u], dim=1)).double()
    ref = g.double() * torch.sigmoid(g.double()) * u.double()
    assert torch.allclose(out, ref, rtol=1e-6, atol=1e-30)


def test_norms_match_transformers_order():
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576, generator=gen)
    x, residual = torch.randn(5, 576, generator=gen), torch.randn(5, 576, generator=gen)
    assert torch.allclose(cpu.rms_norm(x, norm.weight, 1e-5), norm(x), atol=1e-5)
    expected, expected_residual = norm(x, residual)
    res = residual.clone()
    out = cpu.add_rms_norm(x, res, norm.weight, 1e-5)
    assert torch.equal(res, expected_residual)  # the residual add is exact
    assert torch.allclose(out, expected, atol=1e-5)
    head_norm = RMSNorm(64, 1e-5)  # Qwen3's q/k norm: over head_dim of 3-D rows
    head_norm.weight.data = torch.randn(64, generator=gen)
    heads = torch.randn(3, 4, 64, generator=gen)
    assert torch.allclose(cpu.rms_norm(heads, head_norm.weight, 1e-5), head_norm(heads), atol=1e-5)


def test_rotary_silu_and_store():
    gen = torch.Generator().manual_seed(1)
    cos, sin = torch.randn(50, 64, generator=gen), torch.randn(50, 64, generator=gen)
    qkv = torch.randn(6, 5 * 64, generator=gen)
    positions = torch.tensor([0, 3, 7, 8, 9, 49])
    q = qkv[:, : 3 * 64].view(6, 3, 64)
    expected = q * cos[positions, None] + _rotate_half(q) * sin[positions, None]
    cpu.rotary_(q, positions, cos, sin)
    assert torch.allclose(qkv[:, : 3 * 64].view(6, 3, 64), expected, atol=1e-5)

    gate_up = torch.randn(4, 2 * 96, generator=gen)
    g, u = gate_up.split(96, dim=-1)
    assert torch.allclose(cpu.silu_mul(gate_up), torch.nn.functional.silu(g) * u, atol=1e-6)

    k, v = qkv[:, 3 * 64 : 4 * 64].view(6, 1, 64), qkv[:, 4 * 64 :].view(6, 1, 64)
    k_cache, v_cache = torch.zeros(4, 4, 1, 64), torch.zeros(4, 4, 1, 64)
    slots = torch.tensor([15, 0, 5, 6, 7, 9])
    cpu.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(16, 1, 64)[slots], k) and torch.equal(v_cache.view(16, 1, 64)[slots], v)


def test_store_kv_rounds_into_bfloat16_as_torch_does():
    """Ties to even, the largest finite values rounding to infinity, infinities, NaN and subnormals: the bits of
    torch's own conversion, which the torch attention path stores (a NaN stays a NaN; torch's payloads vary)."""
    special = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -(1 + 2**-8), 3.3895e38, -3.4e38,
                            float("inf"), float("-inf"), float("nan"), 1e-40, -1e-45, 0.0, -0.0, 2**-126])
    k = torch.cat([special, torch.randn(64 * 4 - len(special), generator=torch.Generator().manual_seed(2))]) * 1.0
    k = k.view(4, 1, 64)
    v = -k.flip(0)
    k_cache, v_cache = torch.zeros(2, 4, 1, 64, dtype=torch.bfloat16), torch.zeros(2, 4, 1, 64, dtype=torch.bfloat16)
    slots = torch.tensor([7, 0, 3, 4])
    cpu.store_kv(k, v, k_cache, v_cache, slots)
    for pool, src in ((k_cache, k), (v_cache, v)):
        stored, expected = pool.view(8, 1, 64)[slots], src.to(torch.bfloat16)
        assert torch.equal(stored.isnan(), expected.isnan()) and stored.isnan().sum() == 1
        assert torch.equal(stored.nan_to_num(0).view(torch.int16), expected.nan_to_num(0).view(torch.int16))
    with pytest.raises(ValueError, match="v_cache: expected a contiguous CPU pool"):
        cpu.store_kv(k, v, k_cache, v_cache.float(), slots)


def test_wrong_dtype_is_refused():
    with pytest.raises(ValueError, match="float32"):
        cpu.pack_weight(torch.ones(4, 4, dtype=torch.float64))


def test_auto_backend_picks_the_c_kernels_for_fp32_and_bf16_cpu():
    from engine.backends import backend_name
    from engine.config import EngineConfig

    cfg, cpu_dev = EngineConfig(), torch.device("cpu")
    assert backend_name(cfg, cpu_dev, torch.float32) == "cpu"
    assert backend_name(cfg, cpu_dev, torch.bfloat16) == "cpu"
    assert backend_name(cfg, cpu_dev, torch.float16) == "torch"
    assert backend_name(EngineConfig(attention_backend="torch"), cpu_dev, torch.float32) == "torch"


def test_kv_cache_dtype_is_the_models_or_bfloat16():
    from engine.config import EngineConfig

    cpu_dev = torch.device("cpu")
    assert EngineConfig().resolve_kv_cache_dtype(torch.float32, cpu_dev) == torch.float32
    assert EngineConfig().resolve_kv_cache_dtype(torch.bfloat16, cpu_dev) == torch.bfloat16
    assert EngineConfig(kv_cache_dtype="bfloat16").resolve_kv_cache_dtype(torch.float32, cpu_dev) == torch.bfloat16
    with pytest.raises(ValueError, match="needs a float32 or bfloat16 model"):
        EngineConfig(kv_cache_dtype="bfloat16").resolve_kv_cache_dtype(torch.float16, cpu_dev)
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto, bfloat16 or int8, got 'fp8'"):
        EngineConfig(kv_cache_dtype="fp8")


def test_cpu_backend_refuses_float16(tiny_model):
    from engine import LLM

    with pytest.raises(ValueError, match="float32 or bfloat16 on a CPU"):
        LLM(str(tiny_model("llama-gqa-tied")), attention_backend="cpu", dtype="float16")


def test_layout_checks_name_the_tensor():
    q = torch.randn(2, 4, 64).transpose(0, 1)  # heads not contiguous inside a token
    with pytest.raises(ValueError, match="x: the heads of a token must be contiguous"):
        cpu.rotary_(q, torch.zeros(4, dtype=torch.int64), torch.ones(1, 64), torch.zeros(1, 64))
    k = torch.randn(3, 1, 64, dtype=torch.float64)
    with pytest.raises(ValueError, match="k: expected a CPU torch.float32"):
        cpu.store_kv(k, k, torch.zeros(1, 4, 1, 64), torch.zeros(1, 4, 1, 64), torch.zeros(3, dtype=torch.int64))


def test_decoder_refuses_what_does_not_fit_the_model():
    from kernels.cpu.decoder import Decoder, DecoderShape, LayerWeights

    shape = DecoderShape(hidden=16, num_heads=2, num_kv_heads=1, head_dim=8, intermediate=24, eps=1e-6, scale=0.35)

    def layer(**changes):
        weights = dict(input_norm=torch.ones(16), post_norm=torch.ones(16), qkv=cpu.pack_weight(torch.randn(32, 16)),
                       o=cpu.pack_weight(torch.randn(16, 16)), gate_up=cpu.pack_weight(torch.randn(48, 16)),
                       down=cpu.pack_weight(torch.randn(16, 24)))
        return LayerWeights(**{**weights, **changes})

    rotary = torch.zeros(64, 8), torch.ones(64, 8)
    with pytest.raises(ValueError, match=r"layers\[1\].down: packed .* does not hold a 24 -> 16 weight"):
        Decoder(shape, [layer(), layer(down=torch.randn(16, 24))], torch.ones(16), *rotary)
    with pytest.raises(ValueError, match=r"layers\[0\].qkv_bias: expected shape \(32,\)"):
        Decoder(shape, [layer(qkv_bias=torch.zeros(16))], torch.ones(16), *rotary)
    decoder = Decoder(shape, [layer()], torch.ones(16), *rotary)
    cache = torch.zeros(4, 4, 1, 8)
    batch = dict(positions=torch.zeros(2, dtype=torch.int64), slot_mapping=torch.tensor([0, 4]),
                 block_tables=torch.tensor([[0], [1]], dtype=torch.int32), seq_lens=torch.ones(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"kv_caches\[0\].v: shape \(4, 4, 2, 8\) does not match"):
        decoder(torch.randn(2, 16), **batch, kv_caches=[(cache, torch.zeros(4, 4, 2, 8))])
    with pytest.raises(ValueError, match="positions: expected a CPU torch.int64"):
        decoder(torch.randn(2, 16), **{**batch, "positions": torch.zeros(2, dtype=torch.int32)},
                kv_caches=[(cache, cache.clone())])
    out = decoder(torch.randn(2, 16), **batch, kv_caches=[(cache, cache.clone())])
    assert out.shape == (2, 16) and out.isfinite().all()
