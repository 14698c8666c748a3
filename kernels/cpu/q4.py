"""Linear weights that are exactly 4-bit blocks, held as such for the C kernels (``hp_linear_q4`` in ``ops.c``).

Why: a decode step at a small batch streams every weight from memory once, so its time is the weights' bytes over
the memory's bandwidth. The default SmolLM2 weights come from a GGUF file in Q4_1: every 32 consecutive inputs of
an output share a d and an m (fp16), and each weight is exactly ``d q + m`` with q in 0..15. Loaded as fp32 they
take 4 bytes a weight; as Q4 panels 0.75, and the kernel rebuilds the very fp32 values in registers, so products
are bit-identical to the fp32 panels' (tested). Nothing is approximated: a weight is packed this way only when
every one of its values is reproduced exactly; others take BF16 or fp32 panels (``pack_weight_compact``).

NOTE: ``HARPOON_CPU_Q4=0`` keeps such weights in fp32 panels (for A/B measurements).
"""

from __future__ import annotations

import os

import torch

GROUP = 32  # inputs per (d, m) pair: Q4_GROUP in ops.c


def enabled() -> bool:
    return os.environ.get("HARPOON_CPU_Q4", "1") != "0"


def block_bytes(panel_width: int) -> int:
    """Bytes of one panel's 32 inputs: d and m for each column as floats, then a nibble per weight."""
    return 2 * panel_width * 4 + GROUP * panel_width // 2


def q4_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(d [N, K/32], m [N, K/32], q [N, K/32, 32] uint8) with ``d q + m`` bit-identical to ``weight`` [N, K] fp32,
    d and m fp16 values, q in 0..15; None where any block is not of that form (or K % 32 != 0)."""
    n, k = weight.shape
    if weight.dtype != torch.float32 or k % GROUP or not n:
        return None
    # NOTE: the first row alone refuses almost every weight that is not Q4 (an fp32 or bf16 checkpoint) for a
    # thousandth of the whole check, which took ~0.5 s per 45M weights: over a minute of start-up for a 7B model.
    if n > 1 and q4_blocks(weight[:1]) is None:
        return None
    blocks = weight.reshape(n, k // GROUP, GROUP)
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
    if not torch.equal(rebuilt.view(torch.int32), blocks.view(torch.int32)):
        return None
    return d, m, q.to(torch.uint8)


def pack_weight_q4(weight: torch.Tensor, panel_width: int) -> torch.Tensor | None:
    """``weight`` [N, K] as Q4 panels [ceil(N / P), K / 32, block_bytes(P)] uint8 (P = panel_width, zero-padded
    columns), or None where it is not exactly Q4 (see ``q4_blocks``). The layout is documented at Q4_BLOCK_BYTES in
    ops.c: per panel and 32 inputs, d [P] and m [P] as floats, then lanes of eight nibbles of one column."""
    found = q4_blocks(weight)
    if found is None:
        return None
    d, m, q = found
    n, groups = d.shape
    panels, vectors = -(-n // panel_width), panel_width // 8
    padded = panels * panel_width
    d, m = (torch.cat([t, t.new_zeros(padded - n, groups)]) for t in (d, m))
    q = torch.cat([q, q.new_zeros(padded - n, groups, GROUP)])
    scales = [t.view(panels, panel_width, groups).transpose(1, 2).contiguous().view(torch.uint8) for t in (d, m)]
    # q [column = 8 v + lane, group, 8 g + 2 b + h] -> [group, g, v, lane, byte b]: nibble h of byte b is k = 2 b + h
    q = q.view(panels, vectors, 8, groups, GROUP // 8, 4, 2).permute(0, 3, 4, 1, 2, 5, 6)
    nibbles = (q[..., 0] | (q[..., 1] << 4)).reshape(panels, groups, -1)
    return torch.cat([*scales, nibbles], dim=-1).contiguous()
