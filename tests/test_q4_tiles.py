"""Q4 blocks (GGUF Q4_0, Q4_1, Q4_K) multiplied in fp32 on AMX tiles: Q4S panels (``kernels/cpu/amx.c``). Not the
bits of the fp32 panels' FMA chain, but fp32's accuracy: each activation split exactly into three bfloat16 parts,
exact products, fp32 sums; and a row's bits do not depend on the other rows of its batch."""

from __future__ import annotations

import pytest
import torch

from kernels import cdiv, cpu

pytestmark = pytest.mark.skipif(not cpu.available() or "amx" not in cpu.bf16_dots(),
                                reason="needs the C kernels and AMX tiles")

U = 2.0**-24  # fp32's unit roundoff


def q4_blocks(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random Q4_1-like blocks: values 0..15, fp16 d and m (as a GGUF file's), in QuantizedWeight's q4 form."""
    q = torch.randint(0, 16, (n, k // 32, 32), generator=gen, dtype=torch.uint8)
    d = (torch.rand(n, k // 32, generator=gen) * 0.01 + 0.001).half().float()
    m = (-8 * d - torch.rand(n, k // 32, generator=gen) * 0.002).half().float()
    return q, d, m


def activations(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Rows of full 24-bit significands over a wide range of magnitudes, both signs."""
    scale = torch.exp2(torch.randint(-12, 12, (m, k), generator=gen).float())
    return torch.randn(m, k, generator=gen) * scale


def q4s(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return cpu.as_q4s(cpu.pack_weight_q4a(q, d, m))


def test_one_hot_weights_give_each_activation_back_exactly():
    """Column j's only weight is 2^(j % 4) at input j: y[:, j] = x[:, j] 2^(j % 4) d, one exact product. A split that
    dropped or rounded a part of x (24 significant bits, 8 a part) would lose its low bits here."""
    gen = torch.Generator().manual_seed(1)
    k = n = 64
    q = torch.zeros(n, k // 32, 32, dtype=torch.uint8)
    for j in range(n):
        q[j, j // 32, j % 32] = 1 << (j % 4)
    d, m = torch.full((n, k // 32), 0.25), torch.zeros(n, k // 32)
    x = activations(21, k, gen)
    want = x * torch.tensor([2.0 ** (j % 4) * 0.25 for j in range(n)])
    assert torch.equal(cpu.linear(x, q4s(q, d, m), n), want)


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40, 64])
@pytest.mark.parametrize("k,n", [(576, 960), (1536, 100), (32, 49)])  # whole panels; a partial last; one block
def test_products_are_fp32_accurate(rows, k, n):
    """Against float64 over the same weights (d q + m, unrounded), every output within the error of an fp32 sum of
    its terms and of the per-32 sums of d and m: (K + 40) u (sum_k |x_k| (|d q_k| + |m|)), and the bias added."""
    gen = torch.Generator().manual_seed(rows * 7 + k)
    q, d, m = q4_blocks(n, k, gen)
    x, bias = activations(rows, k, gen), torch.randn(n, generator=gen)
    dq = (q.double() * d.double().unsqueeze(-1)).reshape(n, k)
    mm = m.double().repeat_interleave(32, dim=1)
    want = x.double() @ (dq + mm).T + bias.double()
    bound = (k + 40) * U * (x.double().abs() @ (dq.abs() + mm.abs()).T) + U * want.abs()
    got = cpu.linear(x, q4s(q, d, m), n, bias).double()
    assert bool(((got - want).abs() <= bound).all())


@pytest.mark.parametrize("k,n", [(576, 960), (1536, 100)])
def test_a_rows_bits_do_not_depend_on_its_batch(k, n):
    """A row alone, among 16 (one tile of rows), 17 (two, the second nearly empty) or 64, first or last: the same
    bits, as greedy tokens must not depend on what else is in the batch."""
    gen = torch.Generator().manual_seed(k)
    q, d, m = q4_blocks(n, k, gen)
    packed = q4s(q, d, m)
    x = activations(64, k, gen)
    alone = torch.cat([cpu.linear(x[i:i + 1].clone(), packed, n) for i in range(64)])
    for rows in (16, 17, 64):
        assert torch.equal(cpu.linear(x[:rows], packed, n), alone[:rows]), rows
    flipped = cpu.linear(x.flip(0).contiguous(), packed, n)
    assert torch.equal(flipped.flip(0), alone)


def test_q4s_panels_are_q4a_bytes_and_only_those():
    gen = torch.Generator().manual_seed(0)
    q, d, m = q4_blocks(40, 64, gen)
    q4a = cpu.pack_weight_q4a(q, d, m)
    panels = cpu.as_q4s(q4a)
    assert cpu.FORMAT_NAMES[panels.dtype] == "Q4S" and torch.equal(panels.view(torch.uint8), q4a.view(torch.uint8))
    assert cpu.packed_geometry(panels) == (64, cdiv(40, 32) * 32)
    with pytest.raises(ValueError, match="Q4A panels' bytes"):
        cpu.as_q4s(cpu.pack_weight_q8a(torch.zeros(32, 2, 32, dtype=torch.int8), torch.ones(32, 2)))
    with pytest.raises(ValueError, match="AMX products only"):
        cpu.embed_rows(panels, torch.tensor([0]), 40)
