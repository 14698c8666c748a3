"""Linear weights that are exactly 4- or 8-bit blocks, held as such for the C kernels (``hp_linear_packed`` in
``ops.c``).

Why: a decode step at a small batch streams every weight from memory once, so its time is the weights' bytes over
the memory's bandwidth. The default SmolLM2 weights come from a GGUF file whose projections are Q4_1 (every 32
consecutive inputs of an output share a d and an m, fp16, and each weight is exactly ``d q + m`` with q in 0..15)
and whose embedding, which is also the LM head, is Q8_0 (``d q`` with q in -127..127). Loaded as fp32 they take 4
bytes a weight; as Q4 panels 0.75 and as Q8 panels 1.125, and the kernel rebuilds the very fp32 values in
registers, so products are bit-identical to the fp32 panels' (tested). Nothing is approximated: a weight is packed
this way only when every one of its values is reproduced exactly; others take BF16 or fp32 panels
(``pack_weight_compact``). The same panels hold the other GGUF formats that are such blocks per 32 inputs once
dequantized: Q4_0 and Q4_K in Q4 panels (Q4_K's d and m have up to 17 significant bits, not 11: still exact), Q5_0
in Q8 panels; Q5_1, Q5_K and Q6_K are not (a 5-bit q with an m, or a scale per 16 inputs) and keep fp32 panels.

NOTE: ``HARPOON_CPU_Q4=0`` / ``HARPOON_CPU_Q8=0`` keep such weights in fp32 panels (for A/B measurements).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

GROUP = 32  # inputs per block: Q4_GROUP and Q8_GROUP in ops.c, as GGUF's


def q4_enabled() -> bool:
    return os.environ.get("HARPOON_CPU_Q4", "1") != "0"


def q8_enabled() -> bool:
    return os.environ.get("HARPOON_CPU_Q8", "1") != "0"


def q4_block_bytes(panel_width: int) -> int:
    """Bytes of one Q4 panel's 32 inputs: d and m for each column as floats, then a nibble per weight."""
    return 2 * panel_width * 4 + GROUP * panel_width // 2


def q8_block_bytes(panel_width: int) -> int:
    """Bytes of one Q8 panel's 32 inputs: d for each column as a float, then a byte per weight."""
    return panel_width * 4 + GROUP * panel_width


Blocks = tuple[torch.Tensor, ...]


def _exact_blocks(weight: torch.Tensor, find: Callable[[torch.Tensor], Blocks | None]) -> Blocks | None:
    """``find`` over a weight [N, K] fp32 seen as blocks [N, K/32, 32], or None where K % 32 != 0 or the first row
    already fails. NOTE: the first row alone refuses almost every weight that is not on the grid (an fp32 or bf16
    checkpoint) for a thousandth of the whole check, which took ~0.5 s per 45M weights: over a minute of start-up
    for a 7B model."""
    n, k = weight.shape
    if weight.dtype != torch.float32 or k % GROUP or not n:
        return None
    if n > 1 and find(weight[:1].reshape(1, k // GROUP, GROUP)) is None:
        return None
    return find(weight.reshape(n, k // GROUP, GROUP))


def _same_bits(rebuilt: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Per block, whether every value is rebuilt bit for bit."""
    return (rebuilt.view(torch.int32) == blocks.view(torch.int32)).all(-1)


SCALE_BITS = 17  # significant bits of an fp16 times a 6-bit integer: a K-quant sub-block's scale or min


def _round_bits(x: torch.Tensor, bits: int) -> torch.Tensor:
    """fp32 ``x`` rounded to ``bits`` significant bits (half away from zero), as a candidate for a scale that has
    that many; the exact check decides."""
    drop = 24 - bits
    i = x.contiguous().view(torch.int32)
    return ((i + (1 << (drop - 1))) & ~((1 << drop) - 1)).view(torch.float32)


def _same_values(rebuilt: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Per block, whether every value is rebuilt. NOTE: by value, so a -0.0 weight may come back +0.0 (GGUF Q4_0
    with a negative d gives -0.0 where q = 8; d q + m cannot): the panels' products still have the bits of the fp32
    panels', as an accumulator that starts at +0.0 never becomes -0.0 (x + -0.0 is +0.0 for x = +0.0)."""
    return (rebuilt == blocks).all(-1)


def _q4_of(blocks: torch.Tensor) -> Blocks | None:
    """Each block [..., 32] as d q + m, q in 0..15, trying the scales of GGUF's 4-bit formats in turn; a block keeps
    the first d and m that rebuild every one of its values.
    - Q4_1: m is the block's smallest value and d its range over 15, both fp16 (its quantizer maps the smallest
      value to q = 0 and the largest to 15).
    - Q4_0, d' (q - 8) with d' fp16: its quantizer maps the value of largest magnitude to q = 0, so that value is
      -8 d'; as d q + m, d = |d'| and m = -8 d (d' > 0) or -7 d (d' < 0, q reversed).
    - Q4_K: d and m (minus the sub-block's min) are each an fp16 times a 6-bit integer, so of at most 17
      significant bits (``SCALE_BITS``), and its blocks need not reach q = 0 or 15. First d = the range over 15 and
      m = the smallest value, rounded to 17 bits; then d = the range over the steps it spans (counted in the
      smallest gap between two values) and m = the smallest value less d q_low, for each q_low it could have."""
    shape, blocks = blocks.shape[:-1], blocks.reshape(-1, GROUP)
    low, high = blocks.amin(-1), blocks.amax(-1)
    if not (torch.isfinite(low).all() and torch.isfinite(high).all()):
        return None
    span = high - low
    d, m = (span / 15).half().float(), low.half().float()
    q, done = _q4_fit(blocks, d, m)  # every block at once: the default weights' Q4_1 stop here
    todo = (~done).nonzero().squeeze(-1)

    def settle(idx: torch.Tensor, step: torch.Tensor, least: torch.Tensor) -> torch.Tensor:
        """Gives the blocks ``idx`` that ``step`` and ``least`` rebuild those; returns which of ``idx`` are left."""
        fit, ok = _q4_fit(blocks[idx], step, least)
        won = idx[ok]
        d[won], m[won], q[won] = step[ok], least[ok], fit[ok]
        return ~ok

    if len(todo):
        largest = torch.where(-low[todo] > high[todo], low[todo], high[todo])
        step = largest.abs() / 8
        fp16 = step.half().float() == step  # few blocks of other formats: fit only these
        least = torch.where(largest < 0, -8 * step, -7 * step)
        tried = todo[fp16]
        todo = torch.cat([todo[~fp16], tried[settle(tried, step[fp16], least[fp16])]])
    if len(todo):
        todo = todo[settle(todo, _round_bits(span[todo] / 15, SCALE_BITS), _round_bits(low[todo], SCALE_BITS))]
    if len(todo):
        gaps = blocks[todo].sort(-1).values.diff(dim=-1)
        gap = torch.where(gaps > 0, gaps, torch.inf).amin(-1)
        steps = torch.where(torch.isfinite(gap), torch.round(span[todo] / gap), 1.0)
        step = _round_bits(span[todo] / steps, SCALE_BITS)  # 0 for a block of one value
        for q_low in range(16):
            left = settle(todo, step, _round_bits((low[todo].double() - step.double() * q_low).float(), SCALE_BITS))
            todo, step = todo[left], step[left]
            if not len(todo):
                break
    if len(todo):
        return None
    return d.view(shape), m.view(shape), q.to(torch.uint8).view(*shape, GROUP)


def _q4_fit(blocks: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, whether d q + m rebuilds each block): q the nearest in 0..15. d q is exact (d of at most 17 significant
    bits, q of 4): one rounding, as in the kernel, fused or not."""
    step = torch.where(d != 0, d, 1.0).unsqueeze(-1)
    q = torch.round((blocks - m.unsqueeze(-1)) / step).clamp_(0, 15)
    return q, _same_values(d.unsqueeze(-1) * q + m.unsqueeze(-1), blocks)


def _q8_of(blocks: torch.Tensor) -> Blocks | None:
    """Each block [..., 32] as d q, d an fp16 value and q in -127..127, trying in turn the d of GGUF's Q8_0 (the
    largest magnitude over 127, as its quantizer maps that value to q = +-127) and of Q5_0 (d (q - 16) with q in
    0..31: minus the value of largest magnitude over 16, as its quantizer maps that to q = 0); a block keeps the
    first that rebuilds every one of its values, bit for bit."""
    largest = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True)).squeeze(-1)
    d = largest.abs() / 127
    q, done = _q8_fit(blocks, d)  # every block at once: the default weights' Q8_0 stop here
    todo = (~done).nonzero(as_tuple=True)
    if len(todo[0]):
        # a block of zeros keeps their sign in d (gguf's quantizer gives a -0.0 d for it, and d 0 = -0.0)
        scale = torch.where(largest[todo] == 0, largest[todo], largest[todo] / -16)
        fit, ok = _q8_fit(blocks[todo], scale)
        if not bool(ok.all()):
            return None
        d[todo], q[todo] = scale, fit
    return d, q


def _q8_fit(blocks: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, whether d q rebuilds each block bit for bit): q the nearest in -127..127, d an fp16 value (checked), so d
    q is exact; rebuilt from the integers, so a -0.0 weight only where d q gives it (d <= -0.0)."""
    q = torch.round(blocks / torch.where(d != 0, d, 1.0).unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, _same_bits(d.unsqueeze(-1) * q, blocks) & torch.isfinite(d) & (d.half().float() == d)


def q4_blocks(weight: torch.Tensor) -> Blocks | None:
    """(d [N, K/32], m [N, K/32], q [N, K/32, 32] uint8) with ``d q + m`` equal to ``weight`` [N, K] fp32 (bit for
    bit but for the sign of a zero, see ``_same_values``), d and m of at most 17 significant bits, q in 0..15; None
    where any block is not of that form (or K % 32 != 0)."""
    return _exact_blocks(weight, _q4_of)


def q8_blocks(weight: torch.Tensor) -> Blocks | None:
    """(d [N, K/32], q [N, K/32, 32] int8) with ``d q`` bit-identical to ``weight`` [N, K] fp32, d an fp16 value, q
    in -127..127 (GGUF Q8_0 or Q5_0); None where any block is not of that form (or K % 32 != 0)."""
    return _exact_blocks(weight, _q8_of)


def _panel_scales(t: torch.Tensor, panels: int, panel_width: int) -> torch.Tensor:
    """Per-column scales [N, K/32] as the bytes of [panels, K/32, panel_width] floats, padded with zeros."""
    n, groups = t.shape
    t = torch.cat([t, t.new_zeros(panels * panel_width - n, groups)])
    return t.view(panels, panel_width, groups).transpose(1, 2).contiguous().view(torch.uint8)


def _padded(q: torch.Tensor, panels: int, panel_width: int) -> torch.Tensor:
    return torch.cat([q, q.new_zeros(panels * panel_width - q.shape[0], *q.shape[1:])])


def pack_weight_q4(weight: torch.Tensor, panel_width: int) -> torch.Tensor | None:
    """``weight`` [N, K] as Q4 panels [ceil(N / P), K / 32, q4_block_bytes(P)] uint8 (P = panel_width, zero-padded
    columns), or None where it is not exactly Q4 (see ``q4_blocks``). The layout is documented at Q4_BLOCK_BYTES in
    ops.c: per panel and 32 inputs, d [P] and m [P] as floats, then lanes of eight nibbles of one column."""
    found = q4_blocks(weight)
    if found is None:
        return None
    d, m, q = found
    groups = d.shape[1]
    panels, vectors = -(-d.shape[0] // panel_width), panel_width // 8
    # q [column = 8 v + lane, group, 8 g + 2 b + h] -> [group, g, v, lane, byte b]: nibble h of byte b is k = 2 b + h
    q = _padded(q, panels, panel_width).view(panels, vectors, 8, groups, GROUP // 8, 4, 2).permute(0, 3, 4, 1, 2, 5, 6)
    nibbles = (q[..., 0] | (q[..., 1] << 4)).reshape(panels, groups, -1)
    return torch.cat([_panel_scales(d, panels, panel_width), _panel_scales(m, panels, panel_width), nibbles],
                     dim=-1).contiguous()


def pack_weight_q8(weight: torch.Tensor, panel_width: int) -> torch.Tensor | None:
    """``weight`` [N, K] as Q8 panels [ceil(N / P), K / 32, q8_block_bytes(P)] int8 (P = panel_width, zero-padded
    columns), or None where it is not exactly Q8 (see ``q8_blocks``). The layout is documented at Q8_BLOCK_BYTES in
    ops.c: per panel and 32 inputs, d [P] as floats, then lanes of four bytes of one column."""
    found = q8_blocks(weight)
    if found is None:
        return None
    d, q = found
    groups = d.shape[1]
    panels, vectors = -(-d.shape[0] // panel_width), panel_width // 8
    # q [column = 8 v + lane, group, 4 g + b] -> [group, g, v, lane, byte b]
    q = _padded(q, panels, panel_width).view(panels, vectors, 8, groups, GROUP // 4, 4).permute(0, 3, 4, 1, 2, 5)
    return torch.cat([_panel_scales(d, panels, panel_width).view(torch.int8), q.reshape(panels, groups, -1)],
                     dim=-1).contiguous()
