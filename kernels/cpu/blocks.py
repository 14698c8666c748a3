"""Linear weights that are exactly 4- or 8-bit blocks, held as such for the C kernels (``hp_linear_packed`` in
``linear.c``).

Why: a decode step at a small batch streams every weight from memory once, so its time is the weights' bytes over
the memory's bandwidth. The default SmolLM2 weights come from a GGUF file whose projections are Q4_1 (every 32
consecutive inputs of an output share a d and an m, fp16, and each weight is exactly ``d q + m`` with q in 0..15)
and whose embedding, which is also the LM head, is Q8_0 (``d q`` with q in -127..127). Loaded as fp32 they take 4
bytes a weight; as Q4 panels 0.75 and as Q8 panels 1.125, and the kernel rebuilds the very fp32 values in
registers, so products are bit-identical to the fp32 panels' (tested). Nothing is approximated: a weight is packed
this way only when every one of its values is reproduced exactly; others take BF16 or fp32 panels
(``pack_weight_compact``). The same panels hold the other GGUF formats that are such blocks per 32 inputs once
dequantized: Q4_0 and Q4_K in Q4 panels (Q4_K's d and m have up to 17 significant bits, not 11: still exact), Q5_0
in Q8 panels; Q5_1, Q5_K and Q6_K are not (a 5-bit q with an m, or a scale per 16 inputs) and keep fp32 panels
when found in fp32 weights. A GGUF file read directly (``engine/gguf_weights.py``) hands its blocks over as they are
(``pack_q4``, ``pack_bytes``, ``pack_k_quant``): the K-quants to Q4K, Q5K and Q6K panels that keep the file's
scales, Q5_1 to Q5 panels, and a fused projection mixing types to Q6M.

NOTE: ``HARPOON_CPU_Q4=0`` / ``HARPOON_CPU_Q8=0`` keep such weights in fp32 panels (for A/B measurements).
"""

from __future__ import annotations

import os

import torch

from kernels import cdiv
from kernels.cpu.formats import BY_NAME, FORMATS, GROUP, SUPER
from kernels.cpu.library import library


def q4_enabled() -> bool:
    return os.environ.get("HARPOON_CPU_Q4", "1") != "0"


def q8_enabled() -> bool:
    return os.environ.get("HARPOON_CPU_Q8", "1") != "0"


# The block formats of the table by the name engine/models/quantized.py gives their blocks (q4, q8, q5, q6m, q4k ...)
KIND_FORMATS = {f.kind: f for f in FORMATS if f.kind}


Blocks = tuple[torch.Tensor, ...]


def _find(weight: torch.Tensor, q_dtype: torch.dtype) -> Blocks | None:
    """``hp_find_blocks`` (``blocks.c``, which says which scales each format tries) over ``weight`` [N, K] fp32 seen
    as blocks [N, K/32, 32]: (d, m, q) for Q4 (q uint8), (d, q) for Q8 (q int8), or None where K % 32 != 0 or some
    block is not one.
    NOTE: every thread stops at the first block that is not, so a weight off the grid (an fp32 or bf16 checkpoint)
    is refused in a few blocks' time."""
    n, k = weight.shape
    if weight.dtype != torch.float32 or k % GROUP or not n:
        return None
    weight = weight.contiguous()
    d, m = torch.empty(n, k // GROUP), torch.empty(n, k // GROUP)
    q = torch.empty(n, k // GROUP, GROUP, dtype=q_dtype)
    code = BY_NAME["Q4" if q_dtype == torch.uint8 else "Q8"].code
    if library().hp_find_blocks(code, weight.data_ptr(), n * k // GROUP, d.data_ptr(),
                                 m.data_ptr(), q.data_ptr()):
        return None
    return (d, m, q) if q_dtype == torch.uint8 else (d, q)


def q4_blocks(weight: torch.Tensor) -> Blocks | None:
    """(d [N, K/32], m [N, K/32], q [N, K/32, 32] uint8) with ``d q + m`` equal to ``weight`` [N, K] fp32 (bit for
    bit but for the sign of a zero: a -0.0 may come back +0.0, which no product can tell apart), d and m of at most
    17 significant bits, q in 0..15: GGUF's Q4_1, Q4_0 and Q4_K blocks. None where any block is not of that form
    (or K % 32 != 0)."""
    return _find(weight, torch.uint8)


def q8_blocks(weight: torch.Tensor) -> Blocks | None:
    """(d [N, K/32], q [N, K/32, 32] int8) with ``d q`` bit-identical to ``weight`` [N, K] fp32, d an fp16 value, q
    in -127..127 (GGUF Q8_0 or Q5_0); None where any block is not of that form (or K % 32 != 0)."""
    return _find(weight, torch.int8)


def _panel_scales(t: torch.Tensor, panels: int, panel_width: int) -> torch.Tensor:
    """Per-column scales [N, K/32] as the bytes of [panels, K/32, panel_width] floats, padded with zeros."""
    n, groups = t.shape
    t = torch.cat([t, t.new_zeros(panels * panel_width - n, groups)])
    return t.view(panels, panel_width, groups).transpose(1, 2).contiguous().view(torch.uint8)


def _padded(q: torch.Tensor, panels: int, panel_width: int) -> torch.Tensor:
    return torch.cat([q, q.new_zeros(panels * panel_width - q.shape[0], *q.shape[1:])])


def pack_weight_q4(weight: torch.Tensor, panel_width: int) -> torch.Tensor | None:
    """``weight`` [N, K] as Q4 panels [ceil(N / P), K / 32, 24 P] uint8 (P = panel_width, zero-padded
    columns), or None where it is not exactly Q4 (see ``q4_blocks``). The layout is documented at Q4_BLOCK_BYTES in
    panels.h: per panel and 32 inputs, d [P] and m [P] as floats, then lanes of eight nibbles of one column."""
    found = q4_blocks(weight)
    return None if found is None else pack_q4(*found, panel_width)


def pack_q4(d: torch.Tensor, m: torch.Tensor, q: torch.Tensor, panel_width: int) -> torch.Tensor:
    """Q4 panels of ``d q + m``: d, m [N, K/32] fp32, q [N, K/32, 32] uint8 in 0..15 (see ``pack_weight_q4``)."""
    panels = cdiv(d.shape[0], panel_width)
    return torch.cat([_panel_scales(d, panels, panel_width), _panel_scales(m, panels, panel_width),
                      _nibble_blocks(q, panels, panel_width)], dim=-1).contiguous()


def _nibble_blocks(q: torch.Tensor, panels: int, panel_width: int) -> torch.Tensor:
    """q [N, K/32, 32] (0..15) as the nibbles of Q4 blocks: [panels, K/32, 16 P] bytes."""
    groups, vectors = q.shape[1], panel_width // 8
    # q [column = 8 v + lane, group, 8 g + 2 b + h] -> [group, g, v, lane, byte b]: nibble h of byte b is k = 2 b + h
    q = _padded(q, panels, panel_width).view(panels, vectors, 8, groups, GROUP // 8, 4, 2).permute(0, 3, 4, 1, 2, 5, 6)
    return (q[..., 0] | (q[..., 1] << 4)).reshape(panels, groups, -1)


def _byte_blocks(q: torch.Tensor, panels: int, panel_width: int) -> torch.Tensor:
    """q [N, K/32, 32] (int8, or uint8 below 128) in the int8 panel layout: [panels, K/32, 32 P] int8."""
    groups, vectors = q.shape[1], panel_width // 8
    # q [column = 8 v + lane, group, 4 g + b] -> [group, g, v, lane, byte b]
    q = _padded(q.view(torch.int8), panels, panel_width).view(panels, vectors, 8, groups, GROUP // 4, 4)
    return q.permute(0, 3, 4, 1, 2, 5).reshape(panels, groups, -1)


def pack_k_quant(kind: str, q: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor | None, sub: torch.Tensor,
                 panel_width: int) -> torch.Tensor:
    """K-quant panels: q [N, K/32, 32] values, d (and dmin for q4k, q5k) [N, K/256] fp32, sub the sub-scales
    (uint8 [N, K/32, 2] scale and min; q6k: int8 [N, K/16]). K % 256 == 0."""
    n, groups = q.shape[:2]
    supers, panels = groups * GROUP // SUPER, cdiv(n, panel_width)

    def columns(t: torch.Tensor, per_lane: int = 1) -> torch.Tensor:
        """[N, supers, c] -> bytes [panels, supers, c / per_lane, P, per_lane]: ``per_lane`` values of a column in
        each of its lanes (the sub-scales four to a 32-bit lane)."""
        t = _padded(t.reshape(n, supers, -1), panels, panel_width).view(panels, panel_width, supers, -1, per_lane)
        return t.permute(0, 2, 3, 1, 4).contiguous().view(torch.int8).reshape(panels, supers, -1)

    if kind == "q6k":
        header = [columns(d.float()), columns(sub.view(torch.int8), 4)]
    else:  # the file's fp16 d and dmin (exact), its 12 bytes of scales and mins
        header = [columns(d.half()), columns(dmin.half()), columns(k4_packed(sub.reshape(n, supers, 8, 2)), 4)]
    if kind == "q4k":
        blocks = _nibble_blocks(q, panels, panel_width)
    elif kind == "q6k":
        blocks = _six_bit_blocks(q, panels, panel_width)
    else:
        blocks = _byte_blocks(q, panels, panel_width)
    weights = blocks.view(torch.int8).reshape(panels, supers, -1)
    return torch.cat([*header, weights], dim=-1).contiguous().view(KIND_FORMATS[kind].tag)


def k4_packed(sub: torch.Tensor) -> torch.Tensor:
    """Q4_K's and Q5_K's eight 6-bit scales and mins [..., 8, 2] as the file packs them in 12 bytes [..., 12]
    (ggml's get_scale_min_k4 undone): scales 0-3 and mins 0-3 in the low six bits of bytes 0-3 and 4-7, the high two
    bits of scales and mins 4-7 above them, their low four bits in bytes 8-11 (scale low, min high)."""
    sc, mn = sub[..., 0].to(torch.uint8), sub[..., 1].to(torch.uint8)
    low, high = (sc[..., :4], mn[..., :4]), (sc[..., 4:], mn[..., 4:])
    return torch.cat([low[0] | (high[0] >> 4) << 6, low[1] | (high[1] >> 4) << 6, (high[0] & 15) | (high[1] & 15) << 4],
                     dim=-1)


def _six_bit_blocks(q: torch.Tensor, panels: int, panel_width: int) -> torch.Tensor:
    """Q6_K's values q [N, K/32, 32] (-32..31) as Q6K panel groups: q + 32 in a Q4 block's nibbles, then the high two
    bits (panels.h, Q6_HIGH): per column, word j of a group covers nibble words 2 j and 2 j + 1, byte i of it the values
    k = 16 j + 8 c + 2 i + o at bits 2 (2 c + o). [panels, K/32, 24 P] bytes."""
    u = (q.to(torch.int16) + 32).to(torch.uint8)
    low = _nibble_blocks(u & 15, panels, panel_width)
    groups = q.shape[1]
    # [column, group, k = 16 j + 8 c + 2 i + o] -> [group, j, column, i] bytes of sum over (c, o) of h << 2 (2 c + o)
    h = (_padded(u >> 4, panels, panel_width).view(panels, panel_width, groups, 2, 2, 4, 2)).to(torch.int32)
    shifts = (2 * (2 * torch.arange(2).view(2, 1, 1) + torch.arange(2).view(1, 1, 2))).to(torch.int32)  # [c, 1, o]
    high = (h << shifts).sum(dim=(4, 6)).to(torch.uint8)  # [panels, P, groups, j, i]
    high = high.permute(0, 2, 3, 1, 4).reshape(panels, groups, -1)
    return torch.cat([low, high], dim=-1)


def pack_weight_q8(weight: torch.Tensor, panel_width: int) -> torch.Tensor | None:
    """``weight`` [N, K] as Q8 panels [ceil(N / P), K / 32, 36 P] int8 (P = panel_width, zero-padded
    columns), or None where it is not exactly Q8 (see ``q8_blocks``). The layout is documented at Q8_BLOCK_BYTES in
    panels.h: per panel and 32 inputs, d [P] as floats, then lanes of four bytes of one column."""
    found = q8_blocks(weight)
    return None if found is None else pack_bytes("q8", [found[0]], found[1], panel_width)


def pack_bytes(kind: str, scales: list[torch.Tensor], q: torch.Tensor, panel_width: int) -> torch.Tensor:
    """Panels of byte blocks (``KIND_FORMATS[kind]``: Q8, Q5 or Q6M): ``scales`` [N, K/32] fp32 each, in the order
    the format reads them, then q [N, K/32, 32] (int8, or uint8 values below 128) in the int8 panel layout. The
    bytes are those of int8 [ceil(N / P), K / 32, (4 len(scales) + 32) P], viewed as the format's tag."""
    fmt = KIND_FORMATS[kind]
    if len(scales) != (fmt.column_bytes - GROUP) // 4:  # a float a column per scale vector, then a byte per input
        raise ValueError(f"{kind} panels hold {(fmt.column_bytes - GROUP) // 4} scale vectors, got {len(scales)}")
    panels = cdiv(q.shape[0], panel_width)
    vectors_of = [_panel_scales(s.float(), panels, panel_width).view(torch.int8) for s in scales]
    return torch.cat([*vectors_of, _byte_blocks(q, panels, panel_width)], dim=-1).contiguous().view(fmt.tag)
