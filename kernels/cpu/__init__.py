"""fp32 CPU kernels in C (``ops.c``; ``amx.c`` its bfloat16 products on AMX tiles; ``decoder.c`` chains them into
a whole decode step; ``blocks.c`` finds the 4- and 8-bit blocks of weights at load; ``gguf_pack.c`` packs a GGUF
file's blocks into panels; ``shm_sum.c`` sums a tensor across tensor-parallel ranks), compiled on first use with
the host's C compiler and loaded with ctypes (``library.py``); this module wraps them for torch tensors.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from kernels import cdiv, kv_int8
from kernels.cpu import blocks
from kernels.cpu.formats import WEIGHT_FORMATS
from kernels.cpu.library import available, library
from kernels.cpu.pages import advise_huge_pages, empty_panels

__all__ = ["WEIGHT_FORMATS", "available", "library"]  # and the wrappers below

def _check(t: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    if t.dtype != dtype or not t.is_cpu:
        raise ValueError(f"{name}: expected a CPU {dtype} tensor, got {t.dtype} on {t.device}")


def _check_tokens(t: torch.Tensor, name: str) -> None:
    """``t`` [tokens, heads, head_dim], fp32 on the CPU, with the heads of a token contiguous (any token stride)."""
    _check(t, torch.float32, name)
    if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
        raise ValueError(f"{name}: the heads of a token must be contiguous, got strides {t.stride()}")


def panel_width() -> int:
    """Output columns per panel (NR in ops.c)."""
    return library().hp_panel_width()


def register_rows() -> int:
    """The most rows a product over compact panels computes without widening them into fp32 first (MRF in ops.c)."""
    return library().hp_register_rows()


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
    _check(weight, torch.float32, "weight")
    weight = weight.contiguous()
    n, k = weight.shape
    panel = library().hp_panel_width()
    packed = empty_panels(cdiv(n, panel), k, panel, dtype=torch.float32)
    library().hp_pack_weight(weight.data_ptr(), packed.data_ptr(), n, k)
    return packed


FORMAT_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int16: "BF16C", torch.float16: "BF16A",
                torch.float8_e4m3fn: "Q4A", torch.float8_e5m2: "Q6A", torch.float8_e4m3fnuz: "Q8A",
                torch.float8_e5m2fnuz: "Q4S", torch.float4_e2m1fn_x2: "Q6S", torch.float8_e8m0fnu: "Q8S",
                torch.bits4x2: "Q4KS", torch.bits8: "Q6KS",
                **blocks.BLOCK_PANEL_NAMES, **blocks.K_QUANT_NAMES}
# The compact panels: the same fp32 values as fp32 panels in fewer bytes (BF16, Q4, Q8, Q5, Q6M, Q4K, Q5K, Q6K), which
# the products widen to fp32 as they read them (widen_panels gives those fp32 panels)
COMPACT_DTYPES = frozenset({torch.bfloat16, torch.uint8, torch.int8, torch.int32, torch.float64, torch.uint16,
                            torch.uint32, torch.uint64})
HP_Q8X = 256  # ops.h: the int8-activation flag on a format's code
# enum hp_kv_format (ops.h) of each K/V pool dtype; an int8 pool's rows are kernels/kv_int8.py's
KV_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}


def kv_format(k_cache: torch.Tensor, v_cache: torch.Tensor, head_dim: int | None = None) -> int:
    """The C kernels' code for a pair of K/V pools, which must be contiguous CPU tensors of one supported dtype (and,
    given ``head_dim``, rows of that many values)."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in KV_FORMATS or t.dtype != k_cache.dtype or not t.is_cpu or not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous CPU pool of float32, bfloat16 or int8 like k_cache, got "
                             f"{t.dtype} on {t.device}")
        if head_dim is not None and t.shape[-1] != kv_int8.row_width(head_dim, t.dtype):
            raise ValueError(f"{name}: rows of {t.shape[-1]} elements do not hold a {t.dtype} head of {head_dim}")
    return KV_FORMATS[k_cache.dtype]


def pack_weight_blocks(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` [N, K] as Q4 panels (uint8) where its values are 4-bit blocks, as Q8 panels (int8) where they
    are 8-bit blocks (``blocks.py``), else None."""
    _check(weight, torch.float32, "weight")
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
    if kind in blocks.K_QUANT_DTYPES:
        return blocks.pack_k_quant(kind, values, d, m, sub, width)
    if kind == "q4":
        return blocks.pack_q4(d, m, values, width)
    if kind == "q6m":
        return blocks.pack_bytes(kind, [d[:, 0::2], d[:, 1::2], m[:, 0::2], m[:, 1::2]], values, width)
    return blocks.pack_bytes(kind, [d] if m is None else [d, m], values, width)


def pack_gguf_rows(ggml_type: int, rows: torch.Tensor, in_features: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Panels of a GGUF file's blocks read where they lie (``gguf_pack.c``): ``rows`` [N] int64, the address of each
    output row's first block (ggml type ``ggml_type``, ``in_features`` inputs a row), in a mapping that outlives the
    call. The same panels as ``pack_blocks`` of the decoded blocks; written into ``out`` where given (a lab's
    repetitions)."""
    dtype = blocks.GGUF_PANEL_DTYPES.get(ggml_type)
    if dtype is None:
        raise ValueError(f"ggml type {ggml_type} has no panel format")
    rows = rows.to(torch.int64).contiguous()
    width, n = panel_width(), rows.shape[0]
    if dtype in blocks.K_QUANT_NAMES:
        per, block_bytes = blocks.SUPER, blocks.k_quant_block_bytes(dtype, width)
    else:
        scales = 2 if dtype == torch.uint8 else blocks.BYTE_BLOCK_SCALES[dtype]
        per = blocks.GROUP
        block_bytes = blocks.q4_block_bytes(width) if dtype == torch.uint8 else blocks.q8_block_bytes(width, scales)
    if in_features % per:
        raise ValueError(f"ggml type {ggml_type}: {in_features} inputs are not whole blocks of {per}")
    shape = (cdiv(n, width), in_features // per, block_bytes // dtype.itemsize)
    if out is None:
        out = empty_panels(*shape, dtype=dtype)
    elif out.shape != shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor of {shape}")
    written = library().hp_pack_gguf(ggml_type, rows.data_ptr(), n, in_features, width, out.data_ptr())
    if written != out.numel() * dtype.itemsize:
        raise ValueError(f"ggml type {ggml_type}: packed {written} bytes, expected {out.numel() * dtype.itemsize}")
    return out


# ggml types whose blocks widened panels hold (gguf_pack.c): Q4_0, Q4_1 and Q4_K as Q4A, Q6_K as Q6A, Q8_0 and
# Q5_0 as Q8A
GGUF_WIDENED_DTYPES = {2: torch.float8_e4m3fn, 3: torch.float8_e4m3fn, 12: torch.float8_e4m3fn, 14: torch.float8_e5m2,
                       8: torch.float8_e4m3fnuz, 6: torch.float8_e4m3fnuz}


def pack_gguf_widened(ggml_type: int, rows: torch.Tensor, in_features: int) -> torch.Tensor:
    """Q4A, Q6A or Q8A panels of a GGUF file's blocks read where they lie (``gguf_pack.c``), as ``pack_gguf_rows``
    packs the other panels: the same panels as ``pack_weight_q4a`` / ``_q6a`` / ``_q8a`` of the decoded blocks. Only
    where ``"amx" in bf16_dots()``."""
    dtype = GGUF_WIDENED_DTYPES.get(ggml_type)
    if dtype is None:
        raise ValueError(f"ggml type {ggml_type} has no widened panel format")
    if "amx" not in bf16_dots():
        raise ValueError("Q4A, Q6A and Q8A panels need AMX tiles, which this CPU or build lacks")
    rows = rows.to(torch.int64).contiguous()
    out = empty_panels(cdiv(rows.shape[0], BF16A_WIDTH), in_features // blocks.GROUP,
                              2 * WIDENED_TILE_BYTES[dtype], dtype=dtype)
    written = library().hp_pack_gguf_widened(ggml_type, rows.data_ptr(), rows.shape[0], in_features, out.data_ptr())
    if written != out.numel():
        raise ValueError(f"ggml type {ggml_type}: packed {written} bytes, expected {out.numel()}")
    return out


# ops.h: per 32 columns and 256 inputs, two tiles' headers (d, and Q4KS's dmin, in fp16; Q4KS's 6-bit scales and
# mins as bytes [8][16] each, Q6KS's int8 scales [16][16]), then 8 x 2 tiles of q (Q4A's nibbles, Q6A's q)
KSPLIT_SUPER_BYTES = {torch.bits4x2: 2 * (16 * 2 * 2 + 2 * 8 * 16) + 8 * 2 * 16 * 16,
                      torch.bits8: 2 * (16 * 2 + 16 * 16) + 8 * 2 * (16 * 16 + 8 * 16)}
GGUF_KSPLIT_DTYPES = {12: torch.bits4x2, 14: torch.bits8}  # ggml's Q4_K and Q6_K


def pack_gguf_ksplit(ggml_type: int, rows: torch.Tensor, in_features: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Q4KS or Q6KS panels of a GGUF file's Q4_K or Q6_K blocks read where they lie (``gguf_pack.c``): Q4S's and
    Q6S's products, fp32 on AMX tiles with the same bits, from the file's scales per 256 inputs instead of fp32
    scales per 32 (or 16), in 0.58 and 0.82 bytes a weight where Q4S and Q6S take 0.75 and 1 (bits4x2 or bits8
    [ceil(N / 32), K / 256, super-block bytes], dtypes that only name the format); written into ``out`` (as
    returned before) where given (a lab's repetitions). Only where ``"amx" in bf16_dots()``."""
    dtype = GGUF_KSPLIT_DTYPES.get(ggml_type)
    if dtype is None:
        raise ValueError(f"ggml type {ggml_type} has no K-quant split panel format (Q4_K and Q6_K have)")
    if "amx" not in bf16_dots():
        raise ValueError(f"{FORMAT_NAMES[dtype]} panels need AMX tiles, which this CPU or build lacks")
    if in_features % blocks.SUPER:
        raise ValueError(f"{FORMAT_NAMES[dtype]} panels need in_features a multiple of {blocks.SUPER}, got "
                         f"{in_features}")
    rows = rows.to(torch.int64).contiguous()
    shape = (cdiv(rows.shape[0], BF16A_WIDTH), in_features // blocks.SUPER, KSPLIT_SUPER_BYTES[dtype])
    if out is None:
        out = empty_panels(*shape, dtype=torch.uint8)
    elif out.shape != shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {FORMAT_NAMES[dtype]} tensor of {shape}")
    out = out.view(torch.uint8)
    written = library().hp_pack_gguf_ksplit(ggml_type, rows.data_ptr(), rows.shape[0], in_features, out.data_ptr())
    if written != out.numel():
        raise ValueError(f"ggml type {ggml_type}: packed {written} bytes, expected {out.numel()}")
    return out.view(dtype)


def pack_weight_compact(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] in the fewest bytes that hold it exactly, for ``linear``, which computes the same bits from
    each: Q4 or Q8 panels where its values are such blocks (``pack_weight_blocks``), BF16 panels where every
    value's low 16 bits are zero (a bf16 checkpoint loaded as fp32; an even K), else fp32 panels (``pack_weight``).
    NOTE: ``HARPOON_CPU_Q4=0`` / ``HARPOON_CPU_Q8=0`` / ``HARPOON_CPU_BF16=0`` turn each off (for A/B
    measurements)."""
    packed = pack_weight_blocks(weight)
    if packed is not None:
        return packed
    _check(weight, torch.float32, "weight")
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


BF16A_WIDTH = 32  # ops.h: HP_BF16A_WIDTH


def pack_weight_bf16a(weight: torch.Tensor) -> torch.Tensor:
    """A weight [N, K] as BF16A panels: the BF16C layout, BF16A_WIDTH columns a panel (float16 [ceil(N / 32), K,
    32], a dtype that only names the format), two whole tiles of weights for AMX, which alone computes them (the
    same bits as BF16C panels through AMX). Only where ``"amx" in bf16_dots()`` and K % 32 == 0."""
    if "amx" not in bf16_dots():
        raise ValueError("BF16A panels need AMX tiles, which this CPU or build lacks")
    if weight.shape[1] % 32:
        raise ValueError(f"BF16A panels need in_features a multiple of 32, got {weight.shape[1]}")
    return _bf16_pairs(weight, BF16A_WIDTH, torch.float16)


Q4A_TILE_BYTES = 2 * 16 * 4 + 16 * 16  # amx.c: a tile's d and m (fp32) for its 16 columns, then 16 rows of nibbles
Q6A_TILE_BYTES = Q4A_TILE_BYTES + 8 * 16  # its two d (k 0-15, 16-31), the low nibbles, then 8 x 16 bytes of high bits
Q8A_TILE_BYTES = 16 * 4 + 16 * 32  # a tile's d (fp32) for its 16 columns, then 16 rows of 32 bytes
WIDENED_TILE_BYTES = {torch.float8_e4m3fn: Q4A_TILE_BYTES, torch.float8_e5m2: Q6A_TILE_BYTES,
                      torch.float8_e4m3fnuz: Q8A_TILE_BYTES,
                      torch.float8_e5m2fnuz: Q4A_TILE_BYTES, torch.float4_e2m1fn_x2: Q6A_TILE_BYTES,
                      torch.float8_e8m0fnu: Q8A_TILE_BYTES}  # of Q4A, Q6A and Q8A panels, and Q4S, Q6S, Q8S (the same)
SPLIT_DTYPES = {torch.float8_e4m3fn: torch.float8_e5m2fnuz, torch.float8_e5m2: torch.float4_e2m1fn_x2,
                torch.float8_e4m3fnuz: torch.float8_e8m0fnu}  # Q4A, Q6A, Q8A -> Q4S, Q6S, Q8S


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
    packed = torch.cat([*scales, _low_nibbles(nibbles)], dim=-1).reshape(panels, q.shape[1], 2 * Q4A_TILE_BYTES)
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
    return packed.reshape(panels, blocks_k, 2 * Q6A_TILE_BYTES).view(torch.float8_e5m2)


def pack_weight_q8a(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Q8 blocks (the q8 kind: values ``q`` int8 [N, K/32, 32], ``d`` fp32 [N, K/32]; GGUF's Q8_0 and Q5_0) as Q8A
    panels for AMX, widened as Q4A panels are: the bits of the BF16A panels of d q, in 1.125 bytes a weight. Per 32
    columns and 32 inputs, two tiles of Q8A_TILE_BYTES: 16 columns' d, then per pair of inputs 32 bytes, columns
    0-7's (each column's k then k + 1), then columns 8-15's (float8_e4m3fnuz [ceil(N / 32), K / 32, 2
    Q8A_TILE_BYTES]). Only where ``"amx" in bf16_dots()``."""
    panels, values, blocks_k = _widened_values(q.view(torch.uint8))
    packed = torch.cat([_tile_scales(d, panels, 1), values.reshape(panels, blocks_k, 2, 512)], dim=-1)
    return packed.reshape(panels, blocks_k, 2 * Q8A_TILE_BYTES).view(torch.float8_e4m3fnuz)


def as_split(widened: torch.Tensor) -> torch.Tensor:
    """Q4A, Q6A or Q8A panels as Q4S, Q6S or Q8S panels: the same bytes, multiplied in fp32 on AMX (amx.c: the
    activations split exactly into three bfloat16 parts, each block's tile sums scaled by d and m in fp32), not
    rounded to bfloat16."""
    if widened.dtype not in SPLIT_DTYPES:
        raise ValueError(f"Q4S, Q6S and Q8S panels are Q4A, Q6A or Q8A panels' bytes, got "
                         f"{FORMAT_NAMES.get(widened.dtype, widened.dtype)}")
    return widened.view(SPLIT_DTYPES[widened.dtype])


def _widened_values(q: torch.Tensor) -> tuple[int, torch.Tensor, int]:
    """Values [N, K/32, 32] (uint8) in a widened panel's order, zero columns past N:
    [panel, block, tile, pair of k, half (columns 0-7, 8-15), column and k of the pair (16)]."""
    if "amx" not in bf16_dots():
        raise ValueError("Q4A, Q6A and Q8A panels need AMX tiles, which this CPU or build lacks")
    n, blocks_k, _ = q.shape
    panels = cdiv(n, BF16A_WIDTH)
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
    """``t``'s rows (a weight's columns) and zero rows up to whole panels of BF16A_WIDTH."""
    pad = panels * BF16A_WIDTH - t.shape[0]
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


BF16_DOTS = {"fma": 0, "dpbf16": 1, "amx": 2}  # enum hp_bf16_dot (ops.h): the bodies that compute BF16C panels


def _bodies(found: int, codes: dict[str, int]) -> list[str]:
    """The names of ``codes`` whose bit is set in ``found``, the library's mask of the bodies it has."""
    return [name for name, code in codes.items() if found & 1 << code]


def _set_body(set_code: Callable[[int], int], codes: dict[str, int], name: str, what: str,
              available: Callable[[], list[str]]) -> str:
    """``name``'s code through the library's setter ``set_code`` (which answers the code before, or -1 where the
    build lacks it); the name of the body before."""
    before = set_code(codes.get(name, -1))
    if before < 0:
        raise ValueError(f"this build has no {name!r} {what} (it has {available()})")
    return next(n for n, code in codes.items() if code == before)


def bf16_dots() -> list[str]:
    """The bodies this build and CPU can compute BF16C panels with: the portable FMAs always; avx512_bf16's dot
    product (the same bits) and AMX tiles (their own bits) where present."""
    return _bodies(library().hp_bf16_dots(), BF16_DOTS)


def set_bf16_dot(name: str) -> str:
    """Which of ``bf16_dots()`` computes BF16C panels from now on, in every thread (the backend times them at
    start; one body for all products, so a row's bits do not depend on the batch). Returns the body before."""
    return _set_body(library().hp_set_bf16_dot, BF16_DOTS, name, "bfloat16 body", bf16_dots)


@contextmanager
def bf16_body(name: str) -> Iterator[None]:
    """``set_bf16_dot(name)`` for a ``with`` block, the body before it back after (timings, tests, benches)."""
    before = set_bf16_dot(name)
    try:
        yield
    finally:
        set_bf16_dot(before)


F32_BODIES = {"panels": 0, "pairs": 1}  # enum hp_f32_body (ops.c): the bodies of fp32 products from 5 rows on


def f32_bodies() -> list[str]:
    """The bodies this build has for fp32 products of 5 rows and more, all with the same bits: each 24-column panel
    on its own (one 16-lane and one 8-lane FMA a row and k) and, where built for AVX-512, whole panels two at a
    time (three 16-lane FMAs)."""
    return _bodies(library().hp_f32_bodies(), F32_BODIES)


def set_f32_body(name: str) -> str:
    """Which of ``f32_bodies()`` computes fp32 products from now on, in every thread (the backend times them at
    start). Returns the body before."""
    return _set_body(library().hp_set_f32_body, F32_BODIES, name, "fp32 body", f32_bodies)


def packed_geometry(packed: torch.Tensor) -> tuple[int, int]:
    """(in_features, output columns held) of panels of any format in ``WEIGHT_FORMATS``."""
    if packed.dtype not in WEIGHT_FORMATS or packed.dim() != 3:
        raise ValueError(f"expected packed panels of {sorted(map(str, WEIGHT_FORMATS))}, got {packed.dtype} "
                         f"{tuple(packed.shape)}")
    width = panel_width()
    if packed.dtype in blocks.K_QUANT_NAMES:
        expected = blocks.k_quant_block_bytes(packed.dtype, width)
        if packed.shape[2] * packed.element_size() != expected:
            raise ValueError(f"{blocks.K_QUANT_NAMES[packed.dtype]} panels hold {expected} bytes per 256 inputs, "
                             f"got {tuple(packed.shape)} {packed.dtype}")
        return packed.shape[1] * blocks.SUPER, packed.shape[0] * width
    if packed.dtype in KSPLIT_SUPER_BYTES:
        if packed.shape[2] != KSPLIT_SUPER_BYTES[packed.dtype]:
            raise ValueError(f"{FORMAT_NAMES[packed.dtype]} panels hold {KSPLIT_SUPER_BYTES[packed.dtype]} bytes per "
                             f"256 inputs, got {tuple(packed.shape)}")
        return packed.shape[1] * blocks.SUPER, packed.shape[0] * BF16A_WIDTH
    if packed.dtype in WIDENED_TILE_BYTES:
        expected = 2 * WIDENED_TILE_BYTES[packed.dtype]
        if packed.shape[2] != expected:
            raise ValueError(f"{FORMAT_NAMES[packed.dtype]} panels hold {expected} bytes per 32 inputs, got "
                             f"{tuple(packed.shape)}")
        return packed.shape[1] * blocks.GROUP, packed.shape[0] * BF16A_WIDTH
    if packed.dtype == torch.uint8 or packed.dtype in blocks.BYTE_BLOCK_SCALES:
        expected = (blocks.q4_block_bytes(width) if packed.dtype == torch.uint8
                    else blocks.q8_block_bytes(width, blocks.BYTE_BLOCK_SCALES[packed.dtype]))
        if packed.shape[2] * packed.element_size() != expected:
            raise ValueError(f"{blocks.BLOCK_PANEL_NAMES[packed.dtype]} panels hold {expected} bytes per 32 inputs, "
                             f"got {tuple(packed.shape)} {packed.dtype}")
        return packed.shape[1] * blocks.GROUP, packed.shape[0] * width
    return packed.shape[1], packed.shape[0] * packed.shape[2]


def q8x_available() -> bool:
    """Whether this CPU multiplies block panels with int8 activations (``linear(..., int8_activations=True)``): it
    has integer dot products (AVX512-VNNI or AVX-VNNI, or AVX2's maddubs)."""
    return bool(library().hp_q8x_available())


Q8X_DOTS = {"vnni": 1, "maddubs": 2}  # ops.c: the integer dot products the int8-activation products can use


def q8x_dots() -> list[str]:
    """The integer dot products this build has for int8-activation products (``Q8X_DOTS``)."""
    found = library().hp_q8x_dots()
    return [name for name, bit in Q8X_DOTS.items() if found & bit]


def set_q8x_dot(name: str) -> None:
    """Which of ``q8x_dots()`` the int8-activation products use from now on (the backend times them at start)."""
    if library().hp_set_q8x_dot(Q8X_DOTS.get(name, 0)):
        raise ValueError(f"this build has no {name!r} dot product (it has {q8x_dots()})")


def q8x_tiles_available() -> bool:
    """Whether AMX tiles can take the int8-activation products (this build and CPU have AMX-INT8, and the kernel
    lets the process use the tiles): the same bits as the dot products, 16 rows a tile op."""
    return bool(library().hp_q8x_tiles_available())


def set_q8x_tile_rows(rows: int) -> None:
    """From how many rows on AMX tiles take the int8-activation products from now on (0: never; the backend
    times them at start)."""
    if library().hp_set_q8x_tile_rows(rows):
        raise ValueError(f"no AMX tiles for the int8 products here (rows={rows})")


def _fitting_rows(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x`` as fp32 rows (``_rows``) that ``packed``'s panels take, which hold at least ``out_features`` columns."""
    x = _rows(x, "x")
    in_features, columns = packed_geometry(packed)
    if in_features != x.shape[1] or columns < out_features:
        raise ValueError(f"packed weight {tuple(packed.shape)} does not fit x {tuple(x.shape)} -> {out_features}")
    return x


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None,
           int8_activations: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for fp32 ``x`` [M, K] (rows may be strided) and ``packed = pack_weight(weight)`` or
    ``pack_weight_compact(weight)``. ``int8_activations``: block panels (a GGUF file's) multiply ``x`` rounded to
    int8 per 32 inputs, as llama.cpp does, where ``q8x_available()`` (not exact: see ops.c); other panels ignore
    it. ``out``: where to write it, fp32 [M, out_features] with rows that may be strided (some columns of a wider
    output)."""
    x = _fitting_rows(x, packed, out_features)
    m, k = x.shape
    y = torch.empty(m, out_features, dtype=torch.float32) if out is None else out
    _check(y, torch.float32, "out")
    if y.shape != (m, out_features) or (m and out_features > 1 and y.stride(1) != 1):
        raise ValueError(f"out: expected [{m}, {out_features}] with contiguous rows, got {tuple(y.shape)} "
                         f"strides {y.stride()}")
    b = 0 if bias is None else bias.contiguous().data_ptr()
    if m:
        fmt = WEIGHT_FORMATS[packed.dtype] | (HP_Q8X if int8_activations else 0)
        library().hp_linear_packed(fmt, x.data_ptr(), x.stride(0), packed.data_ptr(), b, y.data_ptr(), y.stride(0),
                                    m, out_features, k)
    return y


def argmax_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor | None:
    """``linear(x, packed, out_features).argmax(-1)`` (the first of equal maxima, a NaN the largest) [M] int64,
    from the same products without writing them, where AMX computes ``packed``'s format; else None."""
    x = _fitting_rows(x, packed, out_features)
    m, k = x.shape
    ids = torch.empty(m, dtype=torch.int64)
    found = library().hp_argmax_packed(WEIGHT_FORMATS[packed.dtype], x.data_ptr(), x.stride(0), packed.data_ptr(),
                                        m, out_features, k, ids.data_ptr())
    return ids if found == 0 else None


def embed_rows(packed: torch.Tensor, ids: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``weight[ids]`` [len(ids), K] fp32, read from ``packed``, the panels of ``weight`` [num_rows, K] in any
    format ``linear`` takes, so an embedding table tied to a packed LM head needs no row-major copy. Q4A, Q6A and
    Q8A panels give the fp32 values their tiles round to bfloat16, as Q4S, Q6S and Q8S panels (the same bytes) do."""
    in_features = _inputs_of_rows(packed, num_rows)
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(ids.shape[0], in_features, dtype=torch.float32)
    bad = library().hp_embed_rows(WEIGHT_FORMATS[packed.dtype], packed.data_ptr(), num_rows, in_features,
                                   ids.data_ptr(), ids.shape[0], out.data_ptr())
    if bad >= 0:
        raise IndexError(f"token id {int(ids[bad])} is out of range for an embedding of {num_rows} rows")
    return out


def _inputs_of_rows(packed: torch.Tensor, num_rows: int) -> int:
    """The inputs (K) of each of a packed weight's rows; ValueError where its panels hold fewer than ``num_rows``."""
    in_features, columns = packed_geometry(packed)
    if columns < num_rows:
        raise ValueError(f"packed weight {tuple(packed.shape)} holds {columns} rows, not {num_rows}")
    return in_features


def row_norms(packed: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``weight.double().norm(dim=1)`` [num_rows] float64, read from ``packed``, the fp32, BF16 or block panels of
    ``weight`` [num_rows, K]: the fp32 values the products use, each panel unpacked once (the LM head's int8 screen
    needs every row's norm, ``engine/backends/greedy_head.py``)."""
    in_features = _inputs_of_rows(packed, num_rows)
    out = torch.empty(num_rows, dtype=torch.float64)
    if library().hp_row_norms(WEIGHT_FORMATS[packed.dtype], packed.data_ptr(), num_rows, in_features,
                               out.data_ptr()):
        raise ValueError(f"row norms do not read {FORMAT_NAMES.get(packed.dtype, packed.dtype)} panels")
    return out


def widen_panels(packed: torch.Tensor) -> torch.Tensor:
    """The fp32 panels (``pack_weight``'s layout) of a weight held as BF16 or block panels: the values the products
    unpack from those, so ``linear`` over either gives the same bits; in fresh memory on huge pages, outside any
    panel arena (they are never a panel cache's)."""
    in_features, columns = packed_geometry(packed)
    out = torch.empty(columns // panel_width(), in_features, panel_width(), dtype=torch.float32)
    advise_huge_pages(out.data_ptr(), out.nbytes)
    if library().hp_widen_panels(WEIGHT_FORMATS[packed.dtype], packed.data_ptr(), columns, in_features,
                                  out.data_ptr()):
        name = FORMAT_NAMES.get(packed.dtype, packed.dtype)
        raise ValueError(f"widen_panels takes compact panels (BF16 or blocks), not {name}")
    return out


def pack_weight_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 copy of a weight [N, K] for ``linear_int8``: one scale per output row (its largest magnitude over
    127, rounded to nearest), in the panel layout of ``hp_linear_i8`` (four k per 32-bit lane). Returns the packed
    bytes [ceil(N / P), K / 4, P / 8, 8, 4] and the scales [ceil(N / P) * P] (zero-padded)."""
    _check(weight, torch.float32, "weight")
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


def linear_int8(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    """Approximately ``x @ weight.T`` for fp32 ``x`` [M, K] and ``packed, scales = pack_weight_int8(weight)``."""
    x = _rows(x, "x")
    m, k = x.shape
    if packed.dtype != torch.int8 or packed.shape[1] * 4 != k or scales.numel() < out_features:
        raise ValueError(f"int8 weight {tuple(packed.shape)} does not fit x {tuple(x.shape)} -> {out_features}")
    y = torch.empty(m, out_features, dtype=torch.float32)
    if m:
        library().hp_linear_i8(
            x.data_ptr(), x.stride(0), packed.data_ptr(), scales.data_ptr(), y.data_ptr(), out_features, m,
            out_features, k,
        )
    return y


def q8x_rounding_error(x: torch.Tensor) -> torch.Tensor:
    """[M] float64, at least ||x_m - x^_m|| for each row of fp32 ``x`` [M, K] (K % 32 == 0), x^ being x as the
    int8-activation products (``linear(..., int8_activations=True)``) round it."""
    x = _rows(x, "x")
    m, k = x.shape
    if k % 32:
        raise ValueError(f"q8x_rounding_error: K = {k} is not a multiple of 32")
    err = torch.empty(m, dtype=torch.float64)
    if m:
        library().hp_q8x_rounding_error(x.data_ptr(), x.stride(0), m, k, err.data_ptr())
    return err


def screened_argmax(
    hidden: torch.Tensor, approx: torch.Tensor, error: torch.Tensor, packed: torch.Tensor, max_candidates: int,
    row_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per row m of ``hidden`` [M, K], the argmax of ``linear(hidden, packed, N)`` given ``approx`` [M, N] within
    ``s_m error`` [N] (float64) of it, where s_m is ``row_scale`` [M] (float64) or ||h_m||: the columns that may hold
    the largest logit are recomputed exactly from ``packed`` (fp32 or block panels, as ``linear`` takes them, but
    not BF16C or widened ones). Returns [M] int64, -1 in a row with more than ``max_candidates`` of them or a value
    that is not finite."""
    hidden = _rows(hidden, "hidden")
    _check(approx, torch.float32, "approx")
    _check(error, torch.float64, "error")
    m, n = approx.shape
    k = hidden.shape[1]
    in_features, columns = packed_geometry(packed)
    if packed.dtype in (torch.int16, *KSPLIT_SUPER_BYTES, *WIDENED_TILE_BYTES):
        raise ValueError(f"screened_argmax cannot recompute columns of {FORMAT_NAMES.get(packed.dtype)} panels")
    if (hidden.shape[0] != m or error.shape != (n,) or not approx.is_contiguous() or in_features != k
            or columns < n or (row_scale is not None and row_scale.shape != (m,))):
        raise ValueError(f"screened_argmax: hidden {tuple(hidden.shape)}, approx {tuple(approx.shape)}, error "
                         f"{tuple(error.shape)}, packed {tuple(packed.shape)} do not match")
    if row_scale is not None:
        _check(row_scale, torch.float64, "row_scale")
    tokens = torch.empty(m, dtype=torch.int64)
    library().hp_screened_argmax(hidden.data_ptr(), hidden.stride(0), m, k, approx.data_ptr(), error.data_ptr(),
                                  None if row_scale is None else row_scale.data_ptr(), WEIGHT_FORMATS[packed.dtype],
                                  packed.data_ptr(), n, max_candidates, tokens.data_ptr())
    return tokens


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim], any token stride, contiguous inside a token
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    out: torch.Tensor,  # [num_seqs, num_heads, head_dim], written in place
) -> None:
    _check_tokens(q, "q")
    _check_tokens(out, "out")
    _check(block_tables, torch.int32, "block_tables")
    _check(seq_lens, torch.int32, "seq_lens")
    num_seqs, num_heads, head_dim = q.shape
    fmt = kv_format(k_cache, v_cache, head_dim)
    _, block_size, num_kv_heads, _ = k_cache.shape
    if not seq_lens.is_contiguous():
        raise ValueError("seq_lens must be contiguous")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    if head_dim % 8:
        raise ValueError(f"head_dim must be a multiple of 8, got {head_dim}")
    library().hp_paged_decode_attention(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        scale,
        fmt,
    )


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """``x`` as fp32 rows that are contiguous inside (any row stride)."""
    _check(x, torch.float32, name)
    return x if x.stride(-1) == 1 else x.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` [..., D] into a new contiguous tensor."""
    rows = _rows(x.reshape(-1, x.shape[-1]), "x")
    out = torch.empty(x.shape, dtype=torch.float32)
    library().hp_rms_norm(
        rows.data_ptr(), rows.stride(0), weight.data_ptr(), out.data_ptr(), rows.shape[0], rows.shape[1], eps
    )
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` in place, then returns RMSNorm(residual); both [M, D] contiguous."""
    if not (x.is_contiguous() and residual.is_contiguous()):
        raise ValueError("add_rms_norm needs contiguous x and residual")
    out = torch.empty(x.shape, dtype=torch.float32)
    library().hp_add_rms_norm(
        x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps
    )
    return out


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotary embedding in place on ``x`` [T, heads, head_dim] (heads contiguous, any token stride)."""
    _check_tokens(x, "x")
    t, heads, head_dim = x.shape
    _check(positions, torch.int64, "positions")
    library().hp_rotary(
        x.data_ptr(), x.stride(0), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), t, heads, head_dim
    )


def shm_sum_bytes(ranks: int, slot: int) -> int:
    """The shared segment ``shm_sum`` needs for ``ranks`` ranks summing up to ``slot`` floats a call."""
    return library().hp_shm_sum_bytes(ranks, slot)


def shm_sum(base: int, rank: int, ranks: int, slot: int, x: torch.Tensor, generation: int, timeout_s: float) -> bool:
    """x (contiguous fp32, at most ``slot`` elements) summed in place across the ranks through the shared segment at
    address ``base`` (``shm_sum.c``); False if a rank had not arrived within ``timeout_s`` (call again to go on
    waiting)."""
    _check(x, torch.float32, "x")
    return library().hp_shm_sum(base, rank, ranks, slot, x.data_ptr(), x.numel(), generation, timeout_s) == 0


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for rows [M, 2I] -> [M, I]."""
    gate_up = gate_up.contiguous()
    m, two_i = gate_up.shape
    out = torch.empty(m, two_i // 2, dtype=torch.float32)
    library().hp_silu_mul(gate_up.data_ptr(), out.data_ptr(), m, two_i // 2)
    return out


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits[rows[i], t] = -inf wherever bit t of bitmask[i] is clear; logits [B, vocab] fp32 with unit column
    stride, rows [R] int64, bitmask [R, ceil(vocab / 32)] int32 (xgrammar's layout)."""
    _check(logits, torch.float32, "logits")
    _check(rows, torch.int64, "rows")
    _check(bitmask, torch.int32, "bitmask")
    batch, vocab = logits.shape
    if logits.stride(1) != 1 or bitmask.shape != (rows.numel(), cdiv(vocab, 32)):
        raise ValueError(f"apply_token_bitmask: logits {tuple(logits.shape)} (strides {logits.stride()}), "
                         f"rows {tuple(rows.shape)} and bitmask {tuple(bitmask.shape)} do not fit")
    if rows.numel() and not 0 <= int(rows.min()) <= int(rows.max()) < batch:
        raise ValueError(f"apply_token_bitmask: rows out of range [0, {batch})")
    rows, bitmask = rows.contiguous(), bitmask.contiguous()
    library().hp_apply_token_bitmask(logits.data_ptr(), logits.stride(0), rows.data_ptr(), bitmask.data_ptr(),
                                      rows.numel(), bitmask.shape[1], vocab)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Writes k, v [T, kv_heads, head_dim] (heads contiguous, any token stride) into their int64 cache slots."""
    _check_tokens(k, "k")
    _check_tokens(v, "v")
    t, heads, head_dim = k.shape
    _check(slot_mapping, torch.int64, "slot_mapping")
    fmt = kv_format(k_cache, v_cache, head_dim)
    library().hp_store_kv(
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slot_mapping.data_ptr(),
        t,
        heads,
        head_dim,
        fmt,
    )
