"""Linear weights that are exactly 4- or 8-bit blocks, held as such for the C kernels (``hp_linear_packed`` in
``ops.c``).

Why: a decode step at a small batch streams every weight from memory once, so its time is the weights' bytes over
the memory's bandwidth. The default SmolLM2 weights come from a GGUF file whose projections are Q4_1 (every 32
consecutive inputs of an output share a d and an m, fp16, and each weight is exactly ``d q + m`` with q in 0..15)
and whose embedding, which is also the LM head, is Q8_0 (``d q`` with q in -127..127). Loaded as fp32 they take 4
bytes a weight; as Q4 panels 0.75 and as Q8 panels 1.125, and the kernel rebuilds the very fp32 values in
registers, so products are bit-identical to the fp32 panels' (tested). Nothing is approximated: a weight is packed
this way only when every one of its values is reproduced exactly; others take BF16 or fp32 panels
(``pack_weight_compact``).

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


def _same_bits(rebuilt: torch.Tensor, blocks: torch.Tensor) -> bool:
    return torch.equal(rebuilt.view(torch.int32), blocks.view(torch.int32))


def _q4_of(blocks: torch.Tensor) -> Blocks | None:
    low, high = blocks.amin(-1), blocks.amax(-1)
    # NOTE: quantizing a block of GGUF Q4_1 maps its smallest value to q = 0 and its largest to q = 15, so m is the
    # block's minimum and d its range over 15, both rounded to fp16; the check below decides, not this reasoning.
    m = low.half().float()
    d = ((high - low) / 15).half().float()
    if not (torch.isfinite(d).all() and torch.isfinite(m).all()):
        return None
    step = torch.where(d > 0, d, 1.0).unsqueeze(-1)
    q = torch.round((blocks - m.unsqueeze(-1)) / step).clamp_(0, 15)
    rebuilt = d.unsqueeze(-1) * q + m.unsqueeze(-1)  # d q is exact: one rounding, as in the kernel
    return (d, m, q.to(torch.uint8)) if _same_bits(rebuilt, blocks) else None


def _q8_of(blocks: torch.Tensor) -> Blocks | None:
    # NOTE: GGUF Q8_0 maps a block's largest magnitude to q = +-127, so d is that magnitude over 127 (an fp16 value,
    # checked); again the bitwise check decides.
    d = blocks.abs().amax(-1) / 127
    if not torch.isfinite(d).all() or not torch.equal(d.half().float(), d):
        return None
    q = torch.round(blocks / torch.where(d > 0, d, 1.0).unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    # d q is exact; rebuilt from the integers, so a -0.0 weight (which d 0 cannot give) is refused
    return (d, q) if _same_bits(d.unsqueeze(-1) * q, blocks) else None


def q4_blocks(weight: torch.Tensor) -> Blocks | None:
    """(d [N, K/32], m [N, K/32], q [N, K/32, 32] uint8) with ``d q + m`` bit-identical to ``weight`` [N, K] fp32,
    d and m fp16 values, q in 0..15; None where any block is not of that form (or K % 32 != 0)."""
    return _exact_blocks(weight, _q4_of)


def q8_blocks(weight: torch.Tensor) -> Blocks | None:
    """(d [N, K/32], q [N, K/32, 32] int8) with ``d q`` bit-identical to ``weight`` [N, K] fp32, d an fp16 value, q
    in -127..127; None where any block is not of that form (or K % 32 != 0)."""
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
