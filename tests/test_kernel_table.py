"""Every product of the CPU kernels against its reference, driven by the table of formats (as llama.cpp's
test-backend-ops runs every op x type x backend): format x product body x row count, on the bodies this build and
CPU have (the others skipped with the reason).

- The exact formats (fp32 and the compact ones) give the bits of the fp32 panels of their dequantized weight, the
  generic reference, through every fp32 body, at any row count.
- The int8-activation products of every block format are within the activations' rounding of a float64 product,
  with the same bits from every dot product and from AMX's tiles.
- The bfloat16 products (BF16C; BF16A and the widened blocks on AMX) are within fp32 sums' rounding of the float64
  product of the bfloat16-rounded operands, with the same bits from the FMAs and avx512_bf16's dot product.
- The AMX formats computed to fp32's accuracy are within fp32 sums' rounding of the float64 product.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine.gguf_weights import TensorEntry, read
from engine.models.quantized import QuantizedWeight
from kernels import cpu
from tests.test_gguf_weights import random_blocks

pytestmark = pytest.mark.skipif(not cpu.available(), reason="needs a C compiler for kernels/cpu")

N, K = 40, 1024  # two panels of 24 (the last partial), two 768-input slices (KC), four K-quant super-blocks
ROWS = (1, 4, 8, 9, 33, 64, 130)  # one, the registers' 4 or 8 (MRF), one past them, a partial group, a row block
# the GGUF type each format's blocks come from (the table's gguf column); Q6M: Q4_K rows fused with Q6_K ones
SOURCE = {"Q4": Q.Q4_1, "Q8": Q.Q8_0, "Q5": Q.Q5_1, "Q4K": Q.Q4_K, "Q5K": Q.Q5_K, "Q6K": Q.Q6_K, "Q4A": Q.Q4_0,
          "Q6A": Q.Q6_K, "Q8A": Q.Q8_0, "Q4S": Q.Q4_K, "Q6S": Q.Q6_K, "Q8S": Q.Q5_0, "Q4KS": Q.Q4_K, "Q6KS": Q.Q6_K}
AMX = "amx" in cpu.bf16_dots() if cpu.available() else False


def _blocks(kind: Q, seed: int, rows: int = N):
    raw = random_blocks(np.random.default_rng(seed), kind, rows, K)
    entry = TensorEntry(kind.name, int(kind), (rows, K), 0, raw.nbytes)
    return read(entry, raw.reshape(-1)), raw


def made(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Panels of format ``name`` and the fp32 weight [N, K] they hold (the values its products use)."""
    fmt, gen = cpu.BY_NAME[name], torch.Generator().manual_seed(sum(map(ord, name)))
    if name in SOURCE:
        kind = SOURCE[name]
        blocks, raw = _blocks(kind, len(name) + int(kind))
        dense = blocks.decoded().dequantize(torch.float32)
        rows = torch.arange(N, dtype=torch.int64) * raw.shape[1] + raw.ctypes.data
        if fmt.products == "exact":
            packed = cpu.pack_gguf_rows(int(kind), rows, K)
        elif fmt.same_bytes_as:
            packed = cpu.as_split(cpu.pack_gguf_widened(int(kind), rows, K))
        else:
            packed = cpu.pack_gguf(int(kind), rows, K, fmt.products)
        made.keep.append(raw)  # the packers read the bytes where they lie: keep them while the panels live
        return packed, dense
    if name == "Q6M":
        head, _ = _blocks(Q.Q4_K, 1, N // 2)
        tail, _ = _blocks(Q.Q6_K, 2, N // 2)
        weight = QuantizedWeight.cat([head.decoded(), tail.decoded()])
        assert weight.kind == "q6m"
        packed = cpu.pack_blocks(weight.kind, weight.values(), weight.d, weight.m, weight.sub)
        return packed, weight.dequantize(torch.float32)
    w = torch.randn(N, K, generator=gen) / K**0.5
    if name == "F32":
        return cpu.pack_weight(w), w
    w = w.bfloat16().float()  # the bfloat16 formats hold a bfloat16 weight's values
    pack = {"BF16": cpu.pack_weight_compact, "BF16C": cpu.pack_weight_bf16c, "BF16A": cpu.pack_weight_bf16a}[name]
    return pack(w), w


made.keep = []


def cases() -> list:
    """(format, body name, body) for every format and every body that computes it."""
    out = []
    for fmt in cpu.FORMATS:
        if fmt.products == "exact":
            bodies = [(f"f32={b}", cpu.Body(f32=b)) for b in cpu.f32_bodies()]
        elif fmt.products == "bfloat16":
            bodies = [(f"bf16={b}", cpu.Body(bf16=b)) for b in cpu.bf16_dots()]
        else:  # the AMX formats: the tiles alone
            bodies = [("tiles", cpu.DEFAULT_BODY)]
        mark = [pytest.mark.skipif(fmt.tiles and not AMX, reason="needs AMX tiles, which this CPU lacks")]
        out += [pytest.param(fmt.name, body, id=f"{fmt.name}-{label}", marks=mark) for label, body in bodies]
    return out


def int8_cases() -> list:
    """(format, body name, body) for every block format and every body of its int8-activation products."""
    bodies = [(f"int8={d}", cpu.Body(int8_dot=d)) for d in cpu.q8x_dots()]
    if cpu.q8x_tiles_available():
        bodies.append(("int8=tiles", cpu.Body(int8_tile_rows=1)))
    blocks = [f.name for f in cpu.FORMATS if f.compact and f.inputs > 1]
    if not bodies:
        return [pytest.param(None, None, marks=pytest.mark.skip(reason="no integer dot products on this CPU"))]
    return [pytest.param(name, body, id=f"{name}-{label}") for name in blocks for label, body in bodies]


def _inputs(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(m, K, generator=gen) for m in ROWS]
    xs[-1][3, :32] = 0  # a block of zero activations
    return xs


@pytest.mark.parametrize(("name", "body"), cases() if cpu.available() else [])
def test_every_format_and_body_against_its_reference(name, body):
    fmt = cpu.BY_NAME[name]
    packed, w = made(name)
    assert cpu.packed_geometry(packed) == (K, -(-N // fmt.width(cpu.panel_width())) * fmt.width(cpu.panel_width()))
    bias = torch.randn(N, generator=torch.Generator().manual_seed(7))
    generic = cpu.pack_weight(w)  # the reference of the exact formats: fp32 panels, the build's default body
    for x in _inputs(len(name)):
        y = cpu.linear(x, packed, N, bias, body=body)
        if fmt.products == "exact":
            assert torch.equal(y.view(torch.int32), cpu.linear(x, generic, N, bias).view(torch.int32)), (name, len(x))
            reference, operands = x.double() @ w.double().T, (x, w)
        elif fmt.products in ("bfloat16", "tiles"):
            xb, wb = x.bfloat16().double(), w.bfloat16().double()
            reference, operands = xb @ wb.T, (xb, wb)
            if body.bf16 not in (None, "amx"):  # the vector bodies sum alike: the FMAs' bits
                fma = cpu.linear(x, packed, N, bias, body=cpu.Body(bf16="fma"))
                assert torch.equal(y.view(torch.int32), fma.view(torch.int32)), (name, len(x))
        else:  # tiles-fp32
            reference, operands = x.double() @ w.double().T, (x, w)
        magnitude = operands[0].abs().double() @ operands[1].abs().double().T
        assert torch.all((y.double() - bias.double() - reference).abs() <= 1e-6 * K**0.5 * magnitude + 1e-6), \
            (name, len(x))


@pytest.mark.parametrize(("name", "body"), int8_cases() if cpu.available() else [])
def test_every_block_format_with_int8_activations(name, body):
    """Within the activations' rounding: at most half an int8 step (max |x| / 254 per 32 inputs) a value, so the
    error of a product is at most that times |w|, summed; and the same bits from every body of the kind."""
    packed, w = made(name)
    first = cpu.Body(int8_dot=cpu.q8x_dots()[0])
    for x in _inputs(len(name) + 1):
        y = cpu.linear(x, packed, N, int8_activations=True, body=body)
        step = x.abs().view(len(x), K // 32, 32).amax(dim=2).repeat_interleave(32, dim=1) / 254
        bound = (step.double() @ w.double().abs().T) * 1.01 + 1e-5 * (x.abs().double() @ w.double().abs().T)
        assert torch.all((y.double() - x.double() @ w.double().T).abs() <= bound), (name, len(x))
        same = cpu.linear(x, packed, N, int8_activations=True, body=first)
        assert torch.equal(y.view(torch.int32), same.view(torch.int32)), (name, len(x))
