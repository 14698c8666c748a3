"""Weights held in fewer bytes where that is exact: 4-bit blocks (GGUF Q4_1, as the default model's projections, Q4_0
and Q4_K) in Q4 panels, 8-bit blocks (GGUF Q8_0, as its embedding and LM head, and Q5_0) in Q8 panels, bf16 values
in BF16 panels. Each gives the same bits as the fp32 panels of the same weights, from the kernel alone up to a whole
model's logprobs."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from engine import LLM, SamplingParams
from engine.backends import cpu_bodies
from engine.backends.greedy_head import Int8ScreenedHead, ScreenedGreedyHead
from kernels import cdiv, cpu
from kernels.cpu import blocks
from tests.conftest import hf_greedy


def to_q4_grid(w: torch.Tensor) -> torch.Tensor:
    """``w`` [N, K] rounded to Q4_1 blocks as llama.cpp quantizes: per 32 inputs, m = fp16(min) and
    d = fp16((max - min) / 15), each value d q + m with q = round((x - min) / d)."""
    n, k = w.shape
    blocks = w.reshape(n, k // 32, 32)
    low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    d, m = ((high - low) / 15).half().float(), low.half().float()
    q = torch.round((blocks - low) / torch.where(d > 0, d, 1.0)).clamp(0, 15)
    return (d * q + m).reshape(n, k)


def to_q8_grid(w: torch.Tensor) -> torch.Tensor:
    """``w`` [N, K] rounded to Q8_0 blocks as llama.cpp quantizes: per 32 inputs, d = max |x| / 127 (stored as
    fp16, while q = round(x / d) uses the unrounded d), each value fp16(d) q."""
    n, k = w.shape
    blocks = w.reshape(n, k // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.round(blocks / torch.where(d > 0, d, 1.0)).clamp(-127, 127).to(torch.int8)  # no -0
    return (d.half().float() * q).reshape(n, k)


def to_q4_k_grid(w: torch.Tensor) -> torch.Tensor:
    """``w`` [N, K] rounded to Q4_K blocks as llama.cpp quantizes, less its search for better scales: per 32 inputs
    a scale D and a min M, each an fp16 of the super-block (8 blocks) times a 6-bit integer, each value D q - M
    with q = round((x + M) / D) in 0..15, as gguf's dequantizer computes it (D q is exact)."""
    n, k = w.shape
    g = w.reshape(-1, 32)
    g = torch.cat([g, g.new_zeros(-len(g) % 8, 32)]).view(-1, 8, 32)
    low, high = g.amin(-1).clamp(max=0), g.amax(-1)
    scale, mins = (high - low) / 15, -low
    d = (scale.amax(-1, keepdim=True) / 63).half().float()
    dmin = (mins.amax(-1, keepdim=True) / 63).half().float()
    big_d = (d * torch.round(scale / torch.where(d > 0, d, 1.0)).clamp(0, 63)).unsqueeze(-1)
    big_m = (dmin * torch.round(mins / torch.where(dmin > 0, dmin, 1.0)).clamp(0, 63)).unsqueeze(-1)
    q = torch.round((g + big_m) / torch.where(big_d > 0, big_d, 1.0)).clamp(0, 15)
    return (big_d * q - big_m).view(-1, 32)[: n * k // 32].reshape(n, k)


def gguf_grid(kind: GGMLQuantizationType):
    """``w`` [N, K] through gguf's own quantizer and dequantizer."""
    def snap(w: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(quants.dequantize(quants.quantize(w.numpy(), kind), kind).astype(np.float32))
    return snap


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 90, 300])  # registers to 4 or 8 rows; unpacked after; row blocks
@pytest.mark.parametrize("k,n", [(576, 960), (64, 20), (1536, 576), (32, 49)])
@pytest.mark.parametrize("grid", ["q4", "q8", "q4_0", "q4_k", "q5_0"])
def test_block_panels_compute_the_bits_of_fp32_panels(grid, m, k, n):
    snap, _, dtype = GRIDS[grid]
    gen = torch.Generator().manual_seed(m * 1000 + n)
    w = snap(torch.randn(n, k, generator=gen) * 0.1)
    compact, full = cpu.pack_weight_compact(w), cpu.pack_weight(w)
    assert compact.dtype == dtype and compact.numel() * compact.element_size() < full.numel() * 4 / 3  # bytes
    x, bias = torch.randn(m, k + 7, generator=gen)[:, 3 : 3 + k], torch.randn(n, generator=gen)  # strided rows
    assert torch.equal(bits(cpu.linear(x, compact, n)), bits(cpu.linear(x, full, n)))
    assert torch.equal(bits(cpu.linear(x, compact, n, bias)), bits(cpu.linear(x, full, n, bias)))
    ref = x.double() @ w.double().T
    assert torch.allclose(cpu.linear(x, compact, n).double(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("grid", ["fp32", "q4", "q8", "q4_k"])
@pytest.mark.parametrize("k,n", [(576, 960), (1536, 120), (64, 20)])  # pairs of whole panels, with one or none left
def test_a_rows_products_do_not_depend_on_its_batch(grid, k, n):
    """Rows alone (1-4 rows stream the panels in registers) and inside batches of 9 and 90 (unpacked slices, whole
    panels two at a time on 16-lane FMAs where the CPU has them) get the same bits: greedy tokens must not depend
    on what else is in the batch."""
    gen = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, generator=gen) * 0.1
    packed = cpu.pack_weight(w) if grid == "fp32" else cpu.pack_weight_compact(GRIDS[grid][0](w))
    x, bias = torch.randn(90, k, generator=gen), torch.randn(n, generator=gen)
    for b in (None, bias):
        alone = torch.cat([cpu.linear(x[i : i + 1], packed, n, b) for i in range(9)])
        assert torch.equal(bits(cpu.linear(x[:9], packed, n, b)), bits(alone))
        assert torch.equal(bits(cpu.linear(x, packed, n, b)[:9]), bits(alone))


@pytest.mark.skipif(len(cpu.f32_bodies()) < 2, reason="this build has one fp32 body")
@pytest.mark.parametrize("grid", ["fp32", "q4", "q8", "q4_k"])
@pytest.mark.parametrize("m,k,n", [(5, 576, 960), (90, 1536, 120), (300, 64, 20), (17, 576, 49)])
def test_the_fp32_bodies_give_the_same_bits(grid, m, k, n):
    """Each panel on its own and whole panels two at a time (the backend keeps whichever times faster): one FMA
    chain a column either way, so a switch between them changes no token."""
    gen = torch.Generator().manual_seed(m + n)
    w = torch.randn(n, k, generator=gen) * 0.1
    packed = cpu.pack_weight(w) if grid == "fp32" else cpu.pack_weight_compact(GRIDS[grid][0](w))
    x, bias = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
    results = []
    for name in cpu.f32_bodies():
        body = cpu.Body(f32=name)
        results.append([bits(cpu.linear(x, packed, n, b, body=body)) for b in (None, bias)])
    assert all(torch.equal(a, b) for other in results[1:] for a, b in zip(results[0], other, strict=True))


def test_q4_blocks_give_back_the_grid_exactly():
    w = to_q4_grid(torch.randn(7, 64))
    d, m, q = blocks.q4_blocks(w)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    assert torch.equal(d, d.half().float()) and torch.equal(m, m.half().float())
    assert torch.equal(bits((d.unsqueeze(-1) * q + m.unsqueeze(-1)).reshape(7, 64)), bits(w))
    constant = torch.full((3, 32), -0.5)  # d = 0: every q is 0
    assert cpu.pack_weight_compact(constant).dtype == torch.uint8


def test_q8_blocks_give_back_the_grid_exactly():
    w = to_q8_grid(torch.randn(7, 64))
    assert blocks.q4_blocks(w) is None
    d, q = blocks.q8_blocks(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    assert torch.equal(d, d.half().float())
    assert torch.equal(bits((d.unsqueeze(-1) * q).reshape(7, 64)), bits(w))
    zeros = torch.zeros(3, 32)  # d = 0: every q is 0
    assert blocks.q8_blocks(zeros) is not None
    assert cpu.pack_weight_compact(zeros).dtype == torch.uint8  # on both grids: Q4, the fewer bytes
    assert cpu.pack_weight_compact(to_q8_grid(torch.randn(24, 64))).dtype == torch.int8


def test_gguf_k_quant_and_legacy_blocks_are_found_exactly():
    """Q4_K sub-blocks with any 6-bit scale and min and any q (random raw blocks through gguf's own dequantizer, so
    many reach neither q = 0 nor 15, and some have a scale of 0), Q4_0 with a negative d (its q = 8 gives -0.0,
    which d q + m rebuilds as +0.0), Q5_0 (d (q - 16), in Q8 panels)."""
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(48, 6, 144), dtype=np.uint8)  # 48 rows of 6 super-blocks: 1536 inputs
    for offset in (0, 2):  # d and dmin, fp16
        scale = rng.uniform(1e-4, 3e-3, (48, 6)).astype(np.float16)
        raw[..., offset : offset + 2] = scale.view(np.uint8).reshape(48, 6, 2)
    w = torch.from_numpy(quants.dequantize(raw.reshape(48, -1), GGMLQuantizationType.Q4_K).astype(np.float32))
    d, m, q = blocks.q4_blocks(w)
    assert torch.equal(bits((d.unsqueeze(-1) * q + m.unsqueeze(-1)).reshape(48, 1536)), bits(w))
    constant = w.view(-1, 32).amin(-1) == w.view(-1, 32).amax(-1)  # a scale of 0
    assert ((q.amin(-1) > 0) | (q.amax(-1) < 15)).sum() > 100 and constant.sum() > 10  # of 2304 blocks
    q4_0 = GRIDS["q4_0"][0](torch.randn(16, 64))
    negative_zero = (q4_0 == 0) & q4_0.signbit()
    assert negative_zero.any()
    d, m, q = blocks.q4_blocks(q4_0)
    rebuilt = (d.unsqueeze(-1) * q + m.unsqueeze(-1)).reshape(16, 64)
    assert torch.equal(rebuilt, q4_0) and torch.equal(bits(rebuilt[~negative_zero]), bits(q4_0[~negative_zero]))
    q5_0 = GRIDS["q5_0"][0](torch.randn(16, 64))
    assert blocks.q4_blocks(q5_0) is None
    d, q = blocks.q8_blocks(q5_0)
    assert torch.equal(bits((d.unsqueeze(-1) * q).reshape(16, 64)), bits(q5_0)) and int(q.abs().max()) == 16


@pytest.mark.parametrize("m", [1, 3, 4, 5, 90])
@pytest.mark.parametrize("k,n", [(576, 960), (40, 20)])
def test_bf16_panels_compute_the_bits_of_fp32_panels(m, k, n):
    gen = torch.Generator().manual_seed(m + n)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16).float()
    compact, full = cpu.pack_weight_compact(w), cpu.pack_weight(w)
    assert compact.dtype == torch.bfloat16 and compact.shape == full.shape
    panels, _, width = full.shape  # two consecutive k of a column side by side, the even one first
    assert torch.equal(compact.float().view(panels, k // 2, width, 2).transpose(2, 3).reshape(full.shape), full)
    x, bias = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
    assert torch.equal(bits(cpu.linear(x, compact, n, bias)), bits(cpu.linear(x, full, n, bias)))


def test_weights_that_are_not_exactly_q4_keep_fp32_panels(monkeypatch):
    w = to_q4_grid(torch.randn(24, 64))
    assert cpu.pack_weight_compact(w).dtype == torch.uint8
    off = w.clone()
    off[5, 40] = torch.nextafter(off[5, 40], torch.tensor(1.0))  # one value one ulp off its block's grid
    assert blocks.q4_blocks(off) is None
    assert cpu.pack_weight_compact(off).dtype == torch.float32
    nan = w.clone()
    nan[0, 0] = float("nan")
    assert cpu.pack_weight_compact(nan).dtype == torch.float32
    assert cpu.pack_weight_compact(torch.randn(24, 64)).dtype == torch.float32  # fp32 checkpoints
    assert cpu.pack_weight_compact(to_q4_grid(torch.randn(8, 64))[:, :48].contiguous()).dtype == torch.float32
    bf16 = torch.randn(24, 64).to(torch.bfloat16).float()
    assert cpu.pack_weight_compact(bf16).dtype == torch.bfloat16
    assert cpu.pack_weight_compact(bf16[:, :63].contiguous()).dtype == torch.float32  # BF16 panels pair the k
    bf16[3, 3] = torch.nextafter(bf16[3, 3], torch.tensor(10.0))  # one value with a low bit set
    assert cpu.pack_weight_compact(bf16).dtype == torch.float32
    q8 = to_q8_grid(torch.randn(24, 64))
    assert cpu.pack_weight_compact(q8).dtype == torch.int8
    q = torch.randint(-127, 128, (32,)).float()
    q[0] = 127
    wide_d = q8.clone()
    wide_d[2, :32] = q / 3  # exactly d q, but d = 1/3 is no fp16 value
    off, inf, negative_zero = q8.clone(), q8.clone(), q8.clone()
    off[2, 7] = torch.nextafter(off[2, 7], torch.tensor(10.0))  # one value one ulp off its block's grid
    inf[2, 7] = float("inf")
    negative_zero[2, 7] = -0.0  # d q gives +0.0 only
    for bad in (wide_d, off, inf, negative_zero):
        assert blocks.q8_blocks(bad) is None
        assert cpu.pack_weight_compact(bad).dtype == torch.float32
    monkeypatch.setenv("HARPOON_CPU_Q8", "0")
    assert cpu.pack_weight_compact(q8).dtype == torch.float32
    monkeypatch.setenv("HARPOON_CPU_Q4", "0")
    assert cpu.pack_weight_compact(w).dtype == torch.float32
    monkeypatch.setenv("HARPOON_CPU_BF16", "0")
    assert cpu.pack_weight_compact(bf16.to(torch.bfloat16).float()).dtype == torch.float32


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_one_block_off_the_grid_anywhere_refuses_the_weight(where):
    """The search stops early once a block is refused, each thread in its own part of the weight: whichever block it
    is, the whole weight is refused."""
    gen = torch.Generator().manual_seed(1)
    for grid, find in ((to_q4_grid, blocks.q4_blocks), (to_q8_grid, blocks.q8_blocks)):
        w = grid(torch.randn(256, 512, generator=gen))
        assert find(w) is not None
        row, col = {"first": (0, 0), "middle": (128, 300), "last": (255, 511)}[where]
        w[row, col] = torch.nextafter(w[row, col], torch.tensor(10.0))
        assert find(w) is None


GRIDS = {  # how a checkpoint's weights are snapped, the switch that turns their format off, its packed dtype
    "q4": (to_q4_grid, "HARPOON_CPU_Q4", torch.uint8),
    "q8": (to_q8_grid, "HARPOON_CPU_Q8", torch.int8),
    "q4_0": (gguf_grid(GGMLQuantizationType.Q4_0), "HARPOON_CPU_Q4", torch.uint8),
    "q4_k": (to_q4_k_grid, "HARPOON_CPU_Q4", torch.uint8),
    "q5_0": (gguf_grid(GGMLQuantizationType.Q5_0), "HARPOON_CPU_Q8", torch.int8),
    "bf16": (lambda w: w.to(torch.bfloat16).float(), "HARPOON_CPU_BF16", torch.bfloat16),
}


@pytest.mark.parametrize("grid", sorted(GRIDS))
def test_a_model_runs_from_compact_panels_with_the_bits_of_fp32_panels(grid, tiny_model, tmp_path, monkeypatch):
    """The tiny Llama with every projection and its untied LM head snapped to the grid: the same logprobs with the
    format on and off, and transformers' greedy tokens. A head of Q4 or Q8 blocks takes their panels, and only a Q8
    one may be screened (by its int8-activation product); a bf16 one keeps fp32 panels, which the screened greedy
    head reads."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    snap, _, dtype = GRIDS[grid]
    source = tiny_model("llama-mha-untied-llama3-rope")
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith(("proj.weight", "embed_tokens.weight")) or name == "lm_head.weight":
                param.copy_(snap(param))
    hf.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(source).save_pretrained(tmp_path)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 6, 30, 70)]
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=3)
    results = []
    monkeypatch.setattr(cpu_bodies, "screen_row_range", lambda screen: ((1, 256), {}))
    for enabled in ("1", "0"):
        for each in {switch for _, switch, _ in GRIDS.values()}:  # off: all of them (Q4_0 blocks fit Q8 panels too)
            monkeypatch.setenv(each, enabled)
        llm = LLM(str(tmp_path), block_size=4, kv_cache_memory=4 << 20, attention_backend="cpu", gemm_kernels="c",
                  max_num_batched_tokens=32)
        model = llm.engine.model
        head = dtype if enabled == "1" and grid != "bf16" else torch.float32
        formats = {m.kernel.packed.dtype for m in model.modules() if getattr(m, "kernel", None) is not None
                   and hasattr(m.kernel, "out_features")}
        assert formats == ({dtype, head} if enabled == "1" else {torch.float32})
        assert model.lm_head.kernel.packed.dtype == head
        greedy = llm.engine.backend.greedy_head  # Q8 panels: by their int8 product (timing aside, patched above)
        expected = (ScreenedGreedyHead if head == torch.float32
                    else Int8ScreenedHead if head == torch.int8 and cpu.q8x_available() else type(None))
        assert type(greedy) is expected
        # an untied embedding of Q4/Q8 blocks is looked up from its own panels, and its fp32 table freed
        assert (model.embed_tokens.kernel is not None) == (head != torch.float32)
        assert model.embed_tokens.weight.numel() == (0 if head != torch.float32 else 512 * 64)
        outs = llm.generate(prompts, params)
        results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
    assert results[0] == results[1]
    assert [ids for ids, _ in results[0]] == [hf_greedy(hf, p, 16) for p in prompts]


@pytest.mark.parametrize("grid", ["q4", "q8", "q4_0", "q4_k", "q5_0", "bf16", "fp32"])
@pytest.mark.parametrize("k", [64, 800])  # 800: more than one KC slice of a panel
def test_embedding_rows_read_from_panels_are_the_table_bit_for_bit(grid, k):
    n = 49  # rows in three panels, the last one part padding
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(k)) * 0.1
    w = GRIDS[grid][0](w) if grid in GRIDS else w
    packed = cpu.pack_weight_compact(w)
    assert packed.dtype == (GRIDS[grid][2] if grid in GRIDS else torch.float32)
    table = w + 0.0 if grid == "q4_0" else w  # Q4_0's -0.0 comes back +0.0 (test_gguf_k_quant_and_legacy...)
    for ids in (torch.tensor([7]), torch.tensor([0, n - 1, 24, 23, 0]), torch.randint(0, n, (300,))):  # 300: threads
        assert torch.equal(bits(cpu.embed_rows(packed, ids, n)), bits(table[ids]))
    for bad in (-1, n):
        with pytest.raises(IndexError, match=f"token id {bad} is out of range for an embedding of {n} rows"):
            cpu.embed_rows(packed, torch.tensor([3, bad]), n)
    with pytest.raises(ValueError, match="holds 72 rows, not 73"):
        cpu.embed_rows(packed, torch.tensor([3]), 73)
    # every row's norm at once (the LM head's int8 screen), of the same values: the rows' own, in double
    norms = cpu.row_norms(packed, n)
    assert norms.dtype == torch.float64 and norms.shape == (n,)
    torch.testing.assert_close(norms, table.double().norm(dim=1), rtol=1e-13, atol=0)
    with pytest.raises(ValueError, match="holds 72 rows, not 73"):
        cpu.row_norms(packed, 73)
    # panels of the AMX tiles' layouts are refused, not read as panels of slices (Q8A: Q8S's bytes)
    widened = torch.zeros(cdiv(n, 32), k // 32, 2 * cpu.WIDENED_TILE_BYTES[torch.float8_e4m3fnuz],
                          dtype=torch.float8_e4m3fnuz)
    with pytest.raises(ValueError, match="do not read Q8A panels"):
        cpu.row_norms(widened, n)


def test_linear_refuses_what_is_not_packed_panels():
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="Q4 panels hold .* bytes per 32 inputs"):
        cpu.linear(x, torch.zeros(1, 2, 5, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="Q8 panels hold .* bytes per 32 inputs"):
        cpu.linear(x, torch.zeros(1, 64, 24, dtype=torch.int8), 4)  # int8 panels of the screened head
    with pytest.raises(ValueError, match="expected packed panels"):
        cpu.linear(x, cpu.pack_weight_int8(torch.randn(24, 64))[0], 4)
    with pytest.raises(ValueError, match="does not fit"):
        cpu.linear(x, cpu.pack_weight_compact(to_q4_grid(torch.randn(8, 96))), 8)
