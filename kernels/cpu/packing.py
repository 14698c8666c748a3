"""Packs a linear layer's weight into the panels of a format of the table (``formats.py``) for the C products: dense
weights into the fewest bytes that hold them exactly (fp32, BF16, Q4, Q8), bfloat16 ones into BF16C or BF16A,
decoded blocks into their block panels, and a GGUF file's blocks as they lie in it (``gguf_pack.c``), for the exact
products or AMX's.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from kernels import cdiv
from kernels.cpu import blocks
from kernels.cpu.bodies import bf16_dots, panel_width
from kernels.cpu.formats import BY_NAME, GROUP, TILE_WIDTH, format_of, gguf_format, split_of
from kernels.cpu.library import library
from kernels.cpu.ops import check
from kernels.cpu.pages import empty_panels


def panel_layout() -> str:
    """A name for the layouts the packing functions here write (``pack_gguf_rows``, ``pack_weight_compact``,
    ``pack_weight_bf16c`` ...): the build's (its sources, compiler and CPU, ``_build``), the Python that shapes
    panels (``blocks.py`` and this module) and the switches that turn a kind of panel off. Equal names, the same
    panels from the same weights."""
    code = hashlib.sha256(Path(blocks.__file__).read_bytes() + Path(__file__).read_bytes()).hexdigest()[:16]
    switches = "".join(str(int(on())) for on in (blocks.q4_enabled, blocks.q8_enabled, bf16_panels_enabled))
    return f"{Path(library()._name).stem}-{code}-{switches}"


def bf16_panels_enabled() -> bool:
    return os.environ.get("HARPOON_CPU_BF16", "1") != "0"


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A linear layer's weight [N, K] in the panel layout ``linear`` reads: [ceil(N / P), K, P], zero-padded."""
    check(weight, torch.float32, "weight")
    weight = weight.contiguous()
    n, k = weight.shape
    panel = library().hp_panel_width()
    packed = empty_panels(cdiv(n, panel), k, panel, dtype=torch.float32)
    library().hp_pack_weight(weight.data_ptr(), packed.data_ptr(), n, k)
    return packed


def pack_weight_blocks(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` [N, K] as Q4 panels (uint8) where its values are 4-bit blocks, as Q8 panels (int8) where they
    are 8-bit blocks (``blocks.py``), else None."""
    check(weight, torch.float32, "weight")
    width = library().hp_panel_width()
    packed = blocks.pack_weight_q4(weight, width) if blocks.q4_enabled() else None
    if packed is None and blocks.q8_enabled():
        packed = blocks.pack_weight_q8(weight, width)
    return packed


def pack_blocks(kind: str, values: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                sub: torch.Tensor | None = None) -> torch.Tensor:
    """Panels of a weight given as blocks (``engine/models/quantized.py``'s kinds): ``values`` [N, K/32, 32], d
    [N, K/32] (q6, q6m: [N, K/16], a d per 16 inputs; K-quants: [N, K/256]), m like d or None, ``sub`` a K-quant's
    sub-scales. ``linear`` computes from them the bits it computes from the fp32 panels of the dequantized weight.
    (The q6 kind, a K-quant's values per 16 inputs, is packed as its K-quant or widened to q6m.)"""
    width = panel_width()
    if kind in ("q4k", "q5k", "q6k"):
        return blocks.pack_k_quant(kind, values, d, m, sub, width)
    if kind == "q4":
        return blocks.pack_q4(d, m, values, width)
    if kind == "q6m":
        return blocks.pack_bytes(kind, [d[:, 0::2], d[:, 1::2], m[:, 0::2], m[:, 1::2]], values, width)
    return blocks.pack_bytes(kind, [d] if m is None else [d, m], values, width)


# The C packer of each kind of products a GGUF file's blocks are packed for, as they lie in the file (gguf_pack.c)
_GGUF_PACKERS = {"exact": "hp_pack_gguf", "tiles": "hp_pack_gguf_widened", "tiles-fp32": "hp_pack_gguf_ksplit"}


def pack_gguf(ggml_type: int, rows: torch.Tensor, in_features: int, products: str = "exact",
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Panels of a GGUF file's blocks read where they lie (``gguf_pack.c``), in the format of the table that holds
    ``ggml_type`` for ``products`` (``formats.gguf_format``): ``rows`` [N] int64, the address of each output row's
    first block (``in_features`` inputs a row), in a mapping that outlives the call. The same panels as packing the
    decoded blocks (``pack_blocks``, ``pack_weight_q4a`` ...); written into ``out`` where given (a lab's
    repetitions). The AMX formats only where ``"amx" in bf16_dots()``."""
    fmt = gguf_format(ggml_type, products)
    if fmt is None:
        raise ValueError(f"ggml type {ggml_type} has no panel format for {products} products")
    if fmt.tiles and "amx" not in bf16_dots():
        raise ValueError(f"{fmt.name} panels need AMX tiles, which this CPU or build lacks")
    if in_features % fmt.inputs:
        raise ValueError(f"{fmt.name} panels need in_features a multiple of {fmt.inputs}, got {in_features}")
    rows = rows.to(torch.int64).contiguous()
    n, width = rows.shape[0], fmt.width(panel_width())
    shape = (cdiv(n, width), in_features // fmt.inputs, fmt.block_bytes(panel_width()) // fmt.tag.itemsize)
    if out is None:
        out = empty_panels(*shape, dtype=torch.uint8 if fmt.tag.itemsize == 1 else fmt.tag)
    elif out.shape != shape or out.dtype != fmt.tag or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {fmt.name} tensor of {shape}")
    out = out.view(torch.uint8) if fmt.tag.itemsize == 1 else out
    pack = getattr(library(), _GGUF_PACKERS[products])
    args = (width,) if products == "exact" else ()
    written = pack(ggml_type, rows.data_ptr(), n, in_features, *args, out.data_ptr())
    if written != out.numel() * out.element_size():
        raise ValueError(f"ggml type {ggml_type}: packed {written} bytes, expected {out.numel() * out.element_size()}")
    return out.view(fmt.tag)


def pack_gguf_rows(ggml_type: int, rows: torch.Tensor, in_features: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """``pack_gguf`` for the exact products: Q4, Q8, Q5 or the K-quants' panels."""
    return pack_gguf(ggml_type, rows, in_features, "exact", out)


def pack_gguf_widened(ggml_type: int, rows: torch.Tensor, in_features: int) -> torch.Tensor:
    """``pack_gguf`` for AMX's bfloat16 products: Q4A, Q6A or Q8A panels, widened as the tiles multiply them."""
    return pack_gguf(ggml_type, rows, in_features, "tiles")


def pack_gguf_ksplit(ggml_type: int, rows: torch.Tensor, in_features: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """``pack_gguf`` for AMX's fp32 products of Q4_K and Q6_K: Q4KS or Q6KS panels, which keep the file's scales
    per 256 inputs (0.58 and 0.82 bytes a weight where Q4S and Q6S take 0.75 and 1)."""
    return pack_gguf(ggml_type, rows, in_features, "tiles-fp32", out)


def pack_weight_compact(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] in the fewest bytes that hold it exactly, for ``linear``, which computes the same bits from
    each: Q4 or Q8 panels where its values are such blocks (``pack_weight_blocks``), BF16 panels where every
    value's low 16 bits are zero (a bf16 checkpoint loaded as fp32; an even K), else fp32 panels (``pack_weight``).
    NOTE: ``HARPOON_CPU_Q4=0`` / ``HARPOON_CPU_Q8=0`` / ``HARPOON_CPU_BF16=0`` turn each off (for A/B
    measurements)."""
    packed = pack_weight_blocks(weight)
    if packed is not None:
        return packed
    check(weight, torch.float32, "weight")
    if (bf16_panels_enabled() and weight.shape[1] % 2 == 0
            and not (weight.contiguous().view(torch.int32) & 0xFFFF).any()):
        # the bf16 values, bit for bit (the low halves are zero), each two consecutive k of a column side by side,
        # as ops.c reads them; packed straight, with no fp32 panels first (a first start's arena keeps what it
        # hands out: pages.py's PanelArena)
        return _bf16_pairs(weight, library().hp_panel_width(), torch.bfloat16)
    return pack_weight(weight)


def pack_weight_bf16c(weight: torch.Tensor) -> torch.Tensor:
    """A weight [N, K] (bfloat16, or wider and rounded to it, nearest even) as BF16C panels: int16 [ceil(N / P), K,
    P] in the BF16 panel layout (two consecutive k of one column per 32-bit lane), which ``linear`` computes in
    bfloat16 (the activations rounded too, the products summed in fp32). K must be even. Packed panel by panel, so
    a bfloat16 weight never has an fp32 copy."""
    if weight.shape[1] % 2:
        raise ValueError(f"BF16C panels need an even in_features, got {weight.shape[1]}")
    return _bf16_pairs(weight, library().hp_panel_width(), torch.int16)


def pack_weight_bf16a(weight: torch.Tensor) -> torch.Tensor:
    """A weight [N, K] as BF16A panels: the BF16C layout, TILE_WIDTH columns a panel (float16 [ceil(N / 32), K,
    32], a dtype that only names the format), two whole tiles of weights for AMX, which alone computes them (the
    same bits as BF16C panels through AMX). Only where ``"amx" in bf16_dots()`` and K % 32 == 0."""
    if "amx" not in bf16_dots():
        raise ValueError("BF16A panels need AMX tiles, which this CPU or build lacks")
    if weight.shape[1] % 32:
        raise ValueError(f"BF16A panels need in_features a multiple of 32, got {weight.shape[1]}")
    return _bf16_pairs(weight, TILE_WIDTH, BY_NAME["BF16A"].tag)


def pack_weight_q4a(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Q4 blocks (``engine/models/quantized.py``'s q4 kind: values ``q`` uint8 [N, K/32, 32] in 0..15, ``d`` and ``m``
    fp32 [N, K/32]) as Q4A panels for AMX, which widens them to bfloat16 tiles as it multiplies: the bits of the
    BF16A panels of the weight dequantized (d q + m in fp32) and rounded to bfloat16, in 0.75 bytes a weight
    instead of 2. Per 32 columns and 32 inputs, two tiles of Q4A_TILE_BYTES: 16 columns' d, their m, then per pair
    of inputs (k, k + 1) 16 bytes whose low nibbles are columns 0-7's and high nibbles columns 8-15's, each
    column's k then k + 1 (float8 [ceil(N / 32), K / 32, 2 Q4A_TILE_BYTES], a dtype that only names the format).
    Only where ``"amx" in bf16_dots()``."""
    panels, nibbles, _ = _widened_values(q)
    scales = [_tile_scales(t, panels, 1) for t in (d, m)]
    packed = torch.cat([*scales, _low_nibbles(nibbles)], dim=-1).reshape(panels, q.shape[1],
                                                                         2 * BY_NAME["Q4A"].tile_bytes())
    return packed.view(torch.float8_e4m3fn)


def pack_weight_q6a(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Q6 blocks (the q6 kind: values ``q`` int8 [N, K/32, 32] in -32..31, ``d`` fp32 [N, K/16], a Q6_K's scales
    formed per 16 inputs) as Q6A panels for AMX, widened as Q4A panels are: the bits of the BF16A panels of d q, in 1
    byte a weight. Per 32 columns and 32 inputs, two tiles of Q6A_TILE_BYTES: 16 columns' d for inputs 0-15, for
    16-31, then q + 32's low four bits as Q4A's nibbles, then its high two bits, per two pairs of inputs 16 bytes
    (bits 0-1 and 2-3 beside the first pair's low and high nibble of that byte, 4-5 and 6-7 the second pair's)
    (float8_e5m2 [ceil(N / 32), K / 32, 2 Q6A_TILE_BYTES]). Only where ``"amx" in bf16_dots()``."""
    panels, values, blocks_k = _widened_values((q.to(torch.int16) + 32).to(torch.uint8))
    high = (values >> 4).view(panels, blocks_k, 2, 8, 2, 2, 16)  # [.., pair of pairs, pair, half, 16]
    high = (high[:, :, :, :, 0, 0] | high[:, :, :, :, 0, 1] << 2 | high[:, :, :, :, 1, 0] << 4
            | high[:, :, :, :, 1, 1] << 6).reshape(panels, blocks_k, 2, 128)
    packed = torch.cat([_tile_scales(d, panels, 2), _low_nibbles(values & 15), high], dim=-1)
    return packed.reshape(panels, blocks_k, 2 * BY_NAME["Q6A"].tile_bytes()).view(torch.float8_e5m2)


def pack_weight_q8a(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Q8 blocks (the q8 kind: values ``q`` int8 [N, K/32, 32], ``d`` fp32 [N, K/32]; GGUF's Q8_0 and Q5_0) as Q8A
    panels for AMX, widened as Q4A panels are: the bits of the BF16A panels of d q, in 1.125 bytes a weight. Per 32
    columns and 32 inputs, two tiles of Q8A_TILE_BYTES: 16 columns' d, then per pair of inputs 32 bytes, columns
    0-7's (each column's k then k + 1), then columns 8-15's (float8_e4m3fnuz [ceil(N / 32), K / 32, 2
    Q8A_TILE_BYTES]). Only where ``"amx" in bf16_dots()``."""
    panels, values, blocks_k = _widened_values(q.view(torch.uint8))
    packed = torch.cat([_tile_scales(d, panels, 1), values.reshape(panels, blocks_k, 2, 512)], dim=-1)
    return packed.reshape(panels, blocks_k, 2 * BY_NAME["Q8A"].tile_bytes()).view(torch.float8_e4m3fnuz)


def as_split(widened: torch.Tensor) -> torch.Tensor:
    """Q4A, Q6A or Q8A panels as Q4S, Q6S or Q8S panels: the same bytes, multiplied in fp32 on AMX (amx_bf16.c: the
    activations split exactly into three bfloat16 parts, each block's tile sums scaled by d and m in fp32), not
    rounded to bfloat16."""
    fmt = format_of(widened)
    if fmt.products != "tiles" or fmt.inputs != GROUP:
        raise ValueError(f"Q4S, Q6S and Q8S panels are Q4A, Q6A or Q8A panels' bytes, got {fmt.name}")
    return widened.view(split_of(fmt).tag)


def _widened_values(q: torch.Tensor) -> tuple[int, torch.Tensor, int]:
    """Values [N, K/32, 32] (uint8) in a widened panel's order, zero columns past N:
    [panel, block, tile, pair of k, half (columns 0-7, 8-15), column and k of the pair (16)]."""
    if "amx" not in bf16_dots():
        raise ValueError("Q4A, Q6A and Q8A panels need AMX tiles, which this CPU or build lacks")
    n, blocks_k, _ = q.shape
    panels = cdiv(n, TILE_WIDTH)
    q = _padded(q, panels)
    # [panel, tile, half, column, block, pair, k of the pair] -> [panel, block, tile, pair, half, column, k]
    values = q.view(panels, 2, 2, 8, blocks_k, 16, 2).permute(0, 4, 1, 5, 2, 3, 6).reshape(
        panels, blocks_k, 2, 16, 2, 16)
    return panels, values, blocks_k


def _low_nibbles(values: torch.Tensor) -> torch.Tensor:
    """A tile's 16 rows of 16 bytes: each byte the low nibble of half 0's value and the high nibble of half 1's."""
    panels, blocks_k = values.shape[:2]
    return (values[..., 0, :] | values[..., 1, :] << 4).reshape(panels, blocks_k, 2, 256)


def _tile_scales(t: torch.Tensor, panels: int, per_block: int) -> torch.Tensor:
    """Scales [N, K/32 per_block] (fp32) as each tile's bytes: per block, tile, and scale of the block, 16 columns."""
    t = _padded(t, panels)
    blocks_k = t.shape[1] // per_block
    return (t.float().view(panels, 2, 16, blocks_k, per_block).permute(0, 3, 1, 4, 2).contiguous()
            .view(torch.uint8).reshape(panels, blocks_k, 2, per_block * 64))


def _padded(t: torch.Tensor, panels: int) -> torch.Tensor:
    """``t``'s rows (a weight's columns) and zero rows up to whole panels of TILE_WIDTH."""
    pad = panels * TILE_WIDTH - t.shape[0]
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def _bf16_pairs(weight: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight's bfloat16 bits [N, K] as [ceil(N / width), K / 2, width, 2]: each 32-bit lane holds k and k + 1
    of one column. Written once, straight into panels on 2 MiB pages. Why: a padded copy and then a transposed copy
    of each weight had come first, and the largest's two copies were in the load's peak (packing the 1B's shapes
    took 1106 MiB at its peak, now 606: the panels alone)."""
    n, k = weight.shape
    bits = weight.to(torch.bfloat16).contiguous()
    out = empty_panels(cdiv(n, width), k // 2, width, 2, dtype=torch.int16)
    library().hp_pack_words(bits.data_ptr(), out.data_ptr(), n, k // 2, width)
    return out.view(-1, k, width).view(dtype)


def pack_weight_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 copy of a weight [N, K] for ``linear_int8``: one scale per output row (its largest magnitude over
    127, rounded to nearest), in the panel layout of ``hp_linear_i8`` (four k per 32-bit lane). Returns the packed
    bytes [ceil(N / P), K / 4, P / 8, 8, 4] and the scales [ceil(N / P) * P] (zero-padded)."""
    check(weight, torch.float32, "weight")
    n, k = weight.shape
    if k % 4:
        raise ValueError(f"int8 panels need in_features divisible by 4, got {k}")
    panel = library().hp_panel_width()
    padded = cdiv(n, panel) * panel
    scales = torch.zeros(padded, dtype=torch.float32)
    scales[:n] = weight.abs().amax(dim=1) / 127
    quantized = torch.zeros(padded, k, dtype=torch.int8)
    safe = torch.where(scales[:n] > 0, scales[:n], 1.0).unsqueeze(1)
    quantized[:n] = (weight / safe).round().clamp(-127, 127).to(torch.int8)
    packed = quantized.view(padded // panel, panel // 8, 8, k // 4, 4).permute(0, 3, 1, 2, 4).contiguous()
    return packed, scales


def int8_rows(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The int8 weight [N, K] that ``pack_weight_int8`` packed, back in row layout."""
    return packed.permute(0, 2, 3, 1, 4).reshape(-1, packed.shape[1] * 4)[:out_features]
