"""A GGUF file's blocks multiplied in fp32 on AMX tiles: Q4S, Q6S and Q8S panels (``kernels/cpu/amx.c``; the bytes
of Q4A, Q6A and Q8A panels). Not the bits of the fp32 panels' FMA chain, but fp32's accuracy: each activation split
exactly into three bfloat16 parts, exact products, fp32 sums; and a row's bits do not depend on the other rows of
its batch."""

from __future__ import annotations

import pytest
import torch

from kernels import cdiv, cpu

pytestmark = pytest.mark.skipif(not cpu.available() or "amx" not in cpu.bf16_dots(),
                                reason="needs the C kernels and AMX tiles")

U = 2.0**-24  # fp32's unit roundoff
KINDS = ["q4", "q6", "q8"]


def blocks_of(kind: str, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random blocks as a GGUF file's, in QuantizedWeight's forms, and their weights' terms: (panels, d q [N, K]
    float64, |m| [N, K] float64). q4: values 0..15, fp16 d and m per 32 inputs (Q4_1); q6: -32..31, a d per 16
    (Q6_K's scales formed); q8: -128..127, a d per 32 (Q8_0)."""
    per = 16 if kind == "q6" else 32
    d = (torch.rand(n, k // per, generator=gen) * 0.01 + 0.001).half().float()
    if kind == "q4":
        q = torch.randint(0, 16, (n, k // 32, 32), generator=gen, dtype=torch.uint8)
        m = (-8 * d - torch.rand(n, k // 32, generator=gen) * 0.002).half().float()
        packed = cpu.pack_weight_q4a(q, d, m)
    elif kind == "q6":
        q = torch.randint(-32, 32, (n, k // 32, 32), generator=gen, dtype=torch.int8)
        m = torch.zeros(n, k // per)
        packed = cpu.pack_weight_q6a(q, d)
    else:
        q = torch.randint(-128, 128, (n, k // 32, 32), generator=gen, dtype=torch.int8)
        m = torch.zeros(n, k // per)
        packed = cpu.pack_weight_q8a(q, d)
    dq = q.double().reshape(n, k) * d.double().repeat_interleave(per, dim=1)
    return cpu.as_split(packed), dq, m.double().repeat_interleave(per, dim=1)


def activations(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Rows of full 24-bit significands over a wide range of magnitudes, both signs."""
    scale = torch.exp2(torch.randint(-12, 12, (m, k), generator=gen).float())
    return torch.randn(m, k, generator=gen) * scale


@pytest.mark.parametrize("kind", KINDS)
def test_one_hot_weights_give_each_activation_back_exactly(kind):
    """Column j's only weight is 2^(j % 4) d at input j: y[:, j] = x[:, j] 2^(j % 4) d, one exact product. A split
    that dropped or rounded a part of x (24 significant bits, 8 a part) would lose its low bits here."""
    gen = torch.Generator().manual_seed(1)
    k = n = 64
    q = torch.zeros(n, k // 32, 32, dtype=torch.uint8 if kind == "q4" else torch.int8)
    for j in range(n):
        q[j, j // 32, j % 32] = 1 << (j % 4)
    d = torch.full((n, k // (16 if kind == "q6" else 32)), 0.25)
    packed = {"q4": lambda: cpu.pack_weight_q4a(q, d, torch.zeros_like(d)), "q6": lambda: cpu.pack_weight_q6a(q, d),
              "q8": lambda: cpu.pack_weight_q8a(q, d)}[kind]()
    x = activations(21, k, gen)
    want = x * torch.tensor([2.0 ** (j % 4) * 0.25 for j in range(n)])
    assert torch.equal(cpu.linear(x, cpu.as_split(packed), n), want)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40, 64])
@pytest.mark.parametrize("k,n", [(576, 960), (1536, 100), (32, 49)])  # whole panels; a partial last; one block
def test_products_are_fp32_accurate(kind, rows, k, n):
    """Against float64 over the same weights (d q + m, unrounded), every output within the error of an fp32 sum of
    its terms and of the per-block sums of d and m: (K + 40) u (sum_k |x_k| (|d q_k| + |m|)), and the bias added."""
    gen = torch.Generator().manual_seed(rows * 7 + k)
    packed, dq, m = blocks_of(kind, n, k, gen)
    x, bias = activations(rows, k, gen), torch.randn(n, generator=gen)
    want = x.double() @ (dq + m).T + bias.double()
    bound = (k + 40) * U * (x.double().abs() @ (dq.abs() + m.abs()).T) + U * want.abs()
    got = cpu.linear(x, packed, n, bias).double()
    assert bool(((got - want).abs() <= bound).all())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k,n", [(576, 960), (1536, 100)])
def test_a_rows_bits_do_not_depend_on_its_batch(kind, k, n):
    """A row alone, among 16 (one tile of rows), 17 (two, the second nearly empty) or 64, first or last: the same
    bits, as greedy tokens must not depend on what else is in the batch."""
    gen = torch.Generator().manual_seed(k)
    packed, _, _ = blocks_of(kind, n, k, gen)
    x = activations(64, k, gen)
    alone = torch.cat([cpu.linear(x[i:i + 1].clone(), packed, n) for i in range(64)])
    for rows in (16, 17, 64):
        assert torch.equal(cpu.linear(x[:rows], packed, n), alone[:rows]), rows
    flipped = cpu.linear(x.flip(0).contiguous(), packed, n)
    assert torch.equal(flipped.flip(0), alone)


def test_split_panels_are_the_widened_panels_bytes_and_only_those():
    gen = torch.Generator().manual_seed(0)
    for kind, name in (("q4", "Q4S"), ("q6", "Q6S"), ("q8", "Q8S")):
        panels, _, _ = blocks_of(kind, 40, 64, gen)
        assert cpu.FORMAT_NAMES[panels.dtype] == name
        assert cpu.packed_geometry(panels) == (64, cdiv(40, 32) * 32)
    with pytest.raises(ValueError, match="Q8A panels' bytes"):
        cpu.as_split(cpu.pack_weight_bf16a(torch.zeros(32, 64)))


@pytest.mark.parametrize("kind", KINDS)
def test_lookups_read_each_weight_from_the_panels(kind):
    """A tied LM head of a split format is the embedding table too: rows read from its panels are the weights, d q +
    m in fp32 (one rounding; exact where there is no m), for columns in either tile of a panel and in a partial last
    panel."""
    gen = torch.Generator().manual_seed(3)
    n, k = 70, 96
    packed, dq, m = blocks_of(kind, n, k, gen)
    ids = torch.tensor([0, 7, 8, 15, 16, 23, 31, 32, 47, 69, 5])
    assert torch.equal(cpu.embed_rows(packed, ids, n), (dq + m)[ids].float())  # d q exact, + m rounded once
    with pytest.raises(IndexError):
        cpu.embed_rows(packed, torch.tensor([n]), n)


K_QUANTS = {12: ("Q4_K", 144, (0, 2), "Q4KS"), 14: ("Q6_K", 210, (208,), "Q6KS")}  # bytes a block, its fp16 at


def k_quant_rows(ggml_type: int, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random Q4_K or Q6_K blocks as a file holds them (every bit random but the fp16 scales: finite, both signs, some
    zero), and each row's address, as a FileBlocks hands them over."""
    _, size, halves, _ = K_QUANTS[ggml_type]
    raw = torch.randint(0, 256, (n, k // 256, size), generator=gen, dtype=torch.uint8)
    for at in halves:
        half = (torch.randn(n, k // 256, generator=gen) * 1e-3).half()
        half[:, ::3] = 0
        raw[:, :, at:at + 2] = half.view(torch.uint8).reshape(n, k // 256, 2)
    raw = raw.reshape(n, -1).contiguous()
    return raw, raw.data_ptr() + torch.arange(n, dtype=torch.int64) * raw.shape[1]


@pytest.mark.parametrize("ggml_type", list(K_QUANTS), ids=lambda t: K_QUANTS[t][0])
@pytest.mark.parametrize("k,n", [(256, 40), (1536, 100), (512, 960), (2048, 33)])
def test_k_quant_split_panels_give_the_split_panels_bits_in_the_files_bytes(ggml_type, k, n):
    """A Q4_K or Q6_K weight's Q4KS or Q6KS panels (its scales per 256 inputs kept) and its Q4S or Q6S panels (the
    scales formed per 32 or 16 inputs in fp32) hold the same values: the same products bit for bit at any batch,
    with a bias, the same lookups, within 3% of the file's bytes where Q4S takes 1.33x and Q6S 1.22x."""
    gen = torch.Generator().manual_seed(k + n + ggml_type)
    name, size, _, format_name = K_QUANTS[ggml_type]
    raw, rows = k_quant_rows(ggml_type, n, k, gen)
    split = cpu.as_split(cpu.pack_gguf_widened(ggml_type, rows, k))
    ours = cpu.pack_gguf_ksplit(ggml_type, rows, k)
    assert cpu.FORMAT_NAMES[ours.dtype] == format_name and cpu.packed_geometry(ours) == (k, cdiv(n, 32) * 32)
    weights = cdiv(n, 32) * 32 * k
    assert ours.numel() / weights < 1.03 * size / 256 and split.numel() / weights == (0.75 if name == "Q4_K" else 1)
    bias = torch.randn(n, generator=gen)
    for rows_ in (1, 5, 16, 17, 40, 64):
        x = activations(rows_, k, gen)
        assert torch.equal(cpu.linear(x, ours, n, bias), cpu.linear(x, split, n, bias)), rows_
    ids = torch.tensor([0, 7, 8, 15, 16, 23, 31, n - 1, 5])
    assert torch.equal(cpu.embed_rows(ours, ids, n), cpu.embed_rows(split, ids, n))
    del raw  # the blocks' bytes lived until here


def test_k_quant_split_panels_need_whole_super_blocks_of_their_two_types():
    gen = torch.Generator().manual_seed(0)
    raw, rows = k_quant_rows(12, 8, 256, gen)
    with pytest.raises(ValueError, match="multiple of 256"):
        cpu.pack_gguf_ksplit(12, rows, 128)
    with pytest.raises(ValueError, match="Q4KS panels hold"):
        cpu.packed_geometry(cpu.pack_gguf_ksplit(12, rows, 256)[:, :, :100])
    with pytest.raises(ValueError, match="no K-quant split panel format"):
        cpu.pack_gguf_ksplit(2, rows, 256)  # Q4_0: Q4S panels
    del raw
